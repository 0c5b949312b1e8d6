-- ARG: id, bytes, devices (JSON, in the ledger's order), device indexes (e.g. "0,1"), priority,
-- tenant, and a mode: 'queue' queues what cannot be granted at once; 'wait' answers {'wait',
-- snapshot} instead (the deadline decision is then taken on that snapshot, and a second call
-- queues); 'try' answers {'busy', 0} instead and never queues (try_reserve). Asking again
-- with the same id answers the state of the first ask (a call that timed out). A refusal answers
-- {'full', waiting, snapshot} ('tenant' fourth when it is the tenant's own bound): Retry-After
-- from the state that refused it, with no ticket taken.
local function main()
  if reap() > 0 then dispatch() end
  local id, n, t = ARG[1], tonumber(ARG[2]), ARG[6]
  local dev = granted_device(id)
  if dev then return {'granted', dev} end
  local waiting = redis.call('ZCARD', K_QUEUE)
  if redis.call('HEXISTS', K_TICKET, id) == 1 then return {'queued', waiting} end
  local devs = cjson.decode(ARG[3])
  if waiting == 0 and not warming and fits_quota(account(t), n) then
    dev = place(n, devs)
    if dev then
      grant(id, n, dev, t)
      return {'granted', dev}
    end
  end
  if ARG[7] == 'try' then return {'busy', 0} end
  if ARG[7] == 'wait' then return {'wait', snapshot(t)} end  -- before any queue check, as the in-process ledger
  -- Refused: the state of this instant comes back with the refusal, for its Retry-After.
  if waiting >= cfg.queue then
    redis.call('HINCRBY', K_COUNT, 'rejected:queue-full', 1)
    return {'full', waiting, snapshot(t)}
  end
  local own, tenant_queue = account(t).waiting, (cfg.tenants[t] or cfg.default)[3]
  if tenant_queue >= 0 and own >= tenant_queue then  -- the tenant's own bound (TenantPolicy.max_queue)
    redis.call('HINCRBY', K_COUNT, 'rejected:queue-full', 1)
    return {'full', own, snapshot(t), 'tenant'}
  end
  local seq = redis.call('HINCRBY', K_COUNT, 'seq', 1)
  local p = tonumber(ARG[5])
  local lane = ARG[5] .. ':' .. size_class(n) .. ':' .. ARG[4] .. ':' .. t
  tenant_queued(t, n)
  redis.call('HSET', K_TICKET, id, cjson.encode({n = ARG[2], d = devs, p = p, s = seq, l = lane, b = 0, t = t}))
  redis.call('ZADD', K_QUEUE, seq, id)
  redis.call('ZADD', lane_key(lane), seq, id)
  redis.call('SADD', K_LANES, lane)
  redis.call('HINCRBY', K_COUNT, 'waiting_bytes', ARG[2])
  redis.call('HINCRBY', K_COUNT, 'bytes:' .. lane, ARG[2])
  redis.call('HINCRBY', K_COUNT, 'n:' .. lane, 1)
  redis.call('ZADD', K_EXP, int(lease_now + cfg.ttl), id)
  dispatch()
  dev = granted_device(id)
  if dev then return {'granted', dev} end
  return {'queued', waiting + 1}
end
