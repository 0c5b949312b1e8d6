-- ARG: id, bytes to keep, '1' when finished. Keeping is absolute: a shrink lowers the lease and
-- a grow raises it, past capacity (and quota) if need be, since the bytes are in use either way;
-- each process sends one reservation's changes in order (upkeep), so a retried or late call
-- repeats an amount already set and never gives bytes back twice.
local function main()
  local id = ARG[1]
  if ARG[3] == '1' then
    drop_lease(id)
    redis.call('ZREM', K_EXP, id)
  else
    local n, dev = lease_of(id)
    local keep = tonumber(ARG[2])
    if n and keep ~= n then
      redis.call('HINCRBY', K_RES, dev, int(keep - n))
      redis.call('HSET', K_LEASE, id, int(keep) .. ' ' .. dev)
      local t = redis.call('HGET', K_HOLDER, id)
      if t then tenant_holds(t, keep - n, 0) end
      if keep < n then returned(n - keep) end
    end
  end
  reap()
  dispatch()
  return 1
end
