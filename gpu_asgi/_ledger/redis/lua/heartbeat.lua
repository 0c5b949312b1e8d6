-- ARG: the caller's refusals decided without Redis since its last beat (JSON, reason -> count: one
-- increment per reason), then the ids to renew. Returns the ids Redis no longer knows and the shared
-- snapshot (with the boot id).
local function main()
  for reason, n in pairs(cjson.decode(ARG[1])) do
    redis.call('HINCRBY', K_COUNT, 'rejected:' .. reason, int(n))
  end
  reap()
  local missing = {}
  for i = 2, #ARG do
    local id = ARG[i]
    if redis.call('ZSCORE', K_EXP, id) then
      redis.call('ZADD', K_EXP, int(lease_now + cfg.ttl), id)
    else
      missing[#missing + 1] = id
    end
  end
  dispatch()
  return {missing, snapshot(nil)}
end
