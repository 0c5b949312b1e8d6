-- ARG: id. Cheap: nothing is dispatched unless an expired id went (grants happen when bytes move).
local function main()
  if reap() > 0 then dispatch() end
  local dev = granted_device(ARG[1])
  if dev then return {'granted', dev} end
  if redis.call('HEXISTS', K_TICKET, ARG[1]) == 1 then return {'waiting', 0} end
  return {'gone', 0}
end
