-- ARG: id, bytes, device, tenant. Puts back a lease Redis lost (restart, or reaped while its
-- worker could not reach Redis) even past capacity (and quota): the bytes are in use either way.
local function main()
  if not lease_of(ARG[1]) then hold(ARG[1], tonumber(ARG[2]), ARG[3], ARG[4]) end
  redis.call('ZADD', K_EXP, int(lease_now + cfg.ttl), ARG[1])
  return 1
end
