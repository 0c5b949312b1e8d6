-- ARG: id, rejection reason or '', and optionally a tenant. Given one, it answers {had, snapshot}:
-- the state just after the waiter left and the queue moved on, which its Retry-After is read from
-- (as the in-process ledger computes it once the waiter has left the queue).
local function main()
  local had = drop_lease(ARG[1])
  drop_ticket(ARG[1])
  redis.call('ZREM', K_EXP, ARG[1])
  if ARG[2] ~= '' then redis.call('HINCRBY', K_COUNT, 'rejected:' .. ARG[2], 1) end
  reap()
  dispatch()
  if ARG[3] then return {had and 1 or 0, snapshot(ARG[3])} end
  return had and 1 or 0
end
