"""The shared ledger's state in Redis, and the Lua scripts that change it atomically.

Every key carries the hash tag ``{namespace}`` so a script's keys share one cluster slot:

- ``expiry``   sorted set, lease or ticket id → expiry (server milliseconds); heartbeats renew it
- ``lease``    hash, lease id → ``"<bytes> <device>"``
- ``ticket``   hash, ticket id → ``{"n": bytes, "d": [devices], "b": times bypassed}`` (JSON)
- ``queue``    sorted set, ticket id → ``-priority × 2^40 + sequence`` (ZRANGE gives admission order)
- ``reserved`` / ``inflight`` hashes, device → bytes held / leases held
- ``counts``   hash: ``seq``, ``admitted``, ``rejected:<reason>``
- ``released`` hash, server second → bytes given back (the drain rate behind ``Retry-After``)
- ``boot``     hash: ``id`` of this Redis dataset (set when a script finds none), ``warm`` until when
  grants pause after a data loss

A request's ticket and its lease share one id, chosen by the client before the first call, so a
caller that gives up at any point can remove both with ``leave`` whatever the server did.
Admission runs inside the scripts: every script first reaps expired ids, then ``dispatch`` admits
queued tickets in order (a later ticket may pass a blocked head ``max_bypass`` times), turning
each admitted ticket into a lease owned by its waiter and publishing ``{id: device}`` on the wake
channel, so a woken waiter needs no further round trip.
Time is the server's (``TIME``), so the hosts' clocks never matter.

Data loss (Redis restarted without persistence, or flushed): a caller
that knew an earlier ``boot`` id sees a new one, so Redis lost what the workers still hold. Grants
then pause for ``warm`` (1.5 heartbeats) while every worker's heartbeat finds its leases missing
and puts them back (``restore``); requests queue meanwhile. A namespace used for the first time
has no earlier id to compare with and starts at once.
"""

#: Every script starts with these helpers. KEYS: the nine keys above; ARGV: the ledger's config
#: (JSON), the boot id the caller last saw ('' if none), then the script's own arguments (ARG).
PRELUDE = """
local K_EXP, K_LEASE, K_TICKET, K_QUEUE, K_RES, K_INFL, K_COUNT, K_REL, K_BOOT =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local cfg = cjson.decode(ARGV[1])
local ARG = {}
for i = 3, #ARGV do ARG[i - 2] = ARGV[i] end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local function int(x) return string.format('%.0f', x) end

local boot = redis.call('HGET', K_BOOT, 'id')
if not boot then
  boot = int(now)
  redis.call('HSET', K_BOOT, 'id', boot)
end
if ARGV[2] ~= '' and ARGV[2] ~= boot then  -- the caller saw an earlier dataset: it was lost
  redis.call('HSETNX', K_BOOT, 'warm', int(now + cfg.warm))
end
local warming = now < tonumber(redis.call('HGET', K_BOOT, 'warm') or '0')

local function free(dev)
  local cap = cfg.caps[dev]
  if not cap then return -1 end
  return cap - tonumber(redis.call('HGET', K_RES, dev) or '0')
end

local function place(n, devs)
  local best, most = nil, -1
  for _, dev in ipairs(devs) do
    local f = free(dev)
    if f > most then best, most = dev, f end
  end
  if best and most >= n then return best end
  return nil
end

local function hold(id, n, dev)
  redis.call('HINCRBY', K_RES, dev, int(n))
  redis.call('HINCRBY', K_INFL, dev, 1)
  redis.call('HSET', K_LEASE, id, int(n) .. ' ' .. dev)
  redis.call('ZADD', K_EXP, int(now + cfg.ttl), id)
end

local function grant(id, n, dev)
  hold(id, n, dev)
  redis.call('HINCRBY', K_COUNT, 'admitted', 1)
end

local function returned(n)
  if n > 0 then redis.call('HINCRBY', K_REL, int(math.floor(now / 1000)), int(n)) end
end

local function lease_of(id)
  local rec = redis.call('HGET', K_LEASE, id)
  if not rec then return nil end
  local n, dev = string.match(rec, '^(%d+) (.+)$')
  return tonumber(n), dev
end

local function drop_lease(id)
  local n, dev = lease_of(id)
  if not n then return false end
  redis.call('HDEL', K_LEASE, id)
  redis.call('HINCRBY', K_RES, dev, int(-n))
  redis.call('HINCRBY', K_INFL, dev, -1)
  returned(n)
  return true
end

local function drop_ticket(id)
  if redis.call('HDEL', K_TICKET, id) == 0 then return false end
  redis.call('ZREM', K_QUEUE, id)
  return true
end

local function reap()
  local expired = redis.call('ZRANGEBYSCORE', K_EXP, '-inf', now, 'LIMIT', 0, 256)
  for _, id in ipairs(expired) do
    redis.call('ZREM', K_EXP, id)
    drop_lease(id)
    drop_ticket(id)
  end
end

local function dispatch()
  if warming then return end  -- leases lost with the data are being put back
  local granted, count = {}, 0
  local blocked, blocked_id = nil, nil
  for _, id in ipairs(redis.call('ZRANGE', K_QUEUE, 0, -1)) do
    local raw = redis.call('HGET', K_TICKET, id)
    if not raw then
      redis.call('ZREM', K_QUEUE, id)
    else
      local w = cjson.decode(raw)
      local n = tonumber(w.n)
      local dev = place(n, w.d)
      if not dev then
        if not blocked then blocked, blocked_id = w, id end
      else
        if blocked then
          if blocked.b >= cfg.bypass then break end
          blocked.b = blocked.b + 1
          redis.call('HSET', K_TICKET, blocked_id, cjson.encode(blocked))
        end
        drop_ticket(id)
        grant(id, n, dev)
        granted[id], count = dev, count + 1
      end
    end
  end
  if count > 0 then redis.call('PUBLISH', cfg.chan, cjson.encode(granted)) end
end

local function granted_device(id)
  local n, dev = lease_of(id)
  return dev
end
"""

# ARG: id, bytes, devices (JSON), priority
RESERVE = """
reap()
dispatch()
local id, n = ARG[1], tonumber(ARG[2])
local devs = cjson.decode(ARG[3])
local waiting = redis.call('ZCARD', K_QUEUE)
if waiting == 0 and not warming then
  local dev = place(n, devs)
  if dev then
    grant(id, n, dev)
    return {'granted', dev}
  end
end
if waiting >= cfg.queue then
  redis.call('HINCRBY', K_COUNT, 'rejected:queue-full', 1)
  return {'full', waiting}
end
local seq = redis.call('HINCRBY', K_COUNT, 'seq', 1)
redis.call('HSET', K_TICKET, id, cjson.encode({n = ARG[2], d = devs, b = 0}))
redis.call('ZADD', K_QUEUE, int(-tonumber(ARG[4]) * 1099511627776 + seq), id)
redis.call('ZADD', K_EXP, int(now + cfg.ttl), id)
dispatch()
local dev = granted_device(id)
if dev then return {'granted', dev} end
return {'queued', waiting + 1}
"""

# ARG: id
CLAIM = """
reap()
dispatch()
local dev = granted_device(ARG[1])
if dev then return {'granted', dev} end
if redis.call('HEXISTS', K_TICKET, ARG[1]) == 1 then return {'waiting', 0} end
return {'gone', 0}
"""

# ARG: id, rejection reason or ''
LEAVE = """
local had = drop_lease(ARG[1])
drop_ticket(ARG[1])
redis.call('ZREM', K_EXP, ARG[1])
if ARG[2] ~= '' then redis.call('HINCRBY', K_COUNT, 'rejected:' .. ARG[2], 1) end
reap()
dispatch()
return had and 1 or 0
"""

# ARG: id, bytes to keep, '1' when finished. Keeping is absolute and only ever lowers a
# lease, so shrinks that land late or out of order cannot give bytes back twice.
RELEASE = """
local id = ARG[1]
if ARG[3] == '1' then
  drop_lease(id)
  redis.call('ZREM', K_EXP, id)
else
  local n, dev = lease_of(id)
  local keep = tonumber(ARG[2])
  if n and keep < n then
    redis.call('HINCRBY', K_RES, dev, int(keep - n))
    redis.call('HSET', K_LEASE, id, int(keep) .. ' ' .. dev)
    returned(n - keep)
  end
end
reap()
dispatch()
return 1
"""

# ARG: id, bytes, device. Puts back a lease Redis lost (restart, or reaped while its
# worker could not reach Redis) even past capacity: the bytes are in use on the GPU either way.
RESTORE = """
if not lease_of(ARG[1]) then hold(ARG[1], tonumber(ARG[2]), ARG[3]) end
redis.call('ZADD', K_EXP, int(now + cfg.ttl), ARG[1])
return 1
"""

# ARG: ids to renew. Returns the ids Redis no longer knows, the shared snapshot and the boot id.
HEARTBEAT = """
reap()
local missing = {}
for _, id in ipairs(ARG) do
  if redis.call('ZSCORE', K_EXP, id) then
    redis.call('ZADD', K_EXP, int(now + cfg.ttl), id)
  else
    missing[#missing + 1] = id
  end
end
dispatch()
local second = math.floor(now / 1000)
local released, oldest = 0, second
local buckets = redis.call('HGETALL', K_REL)
for i = 1, #buckets, 2 do
  local s = tonumber(buckets[i])
  if s < second - cfg.window then
    redis.call('HDEL', K_REL, buckets[i])
  else
    released = released + tonumber(buckets[i + 1])
    if s < oldest then oldest = s end
  end
end
local waiting_bytes = 0
for _, raw in ipairs(redis.call('HVALS', K_TICKET)) do waiting_bytes = waiting_bytes + tonumber(cjson.decode(raw).n) end
return {missing, redis.call('HGETALL', K_RES), redis.call('HGETALL', K_INFL), redis.call('ZCARD', K_QUEUE),
        int(waiting_bytes), redis.call('HGETALL', K_COUNT), int(released), now - oldest * 1000, boot}
"""
