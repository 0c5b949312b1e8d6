-- The helpers every script shares (after head.lua and clock.lua). A script's body is the
-- function main; epilogue.lua runs it, then finish() records whether bytes are reserved.
local function int(x)
  if x == 0 then return '0' end  -- not '-0', which HINCRBY refuses
  return string.format('%.0f', x)
end

local boot = redis.call('HGET', K_BOOT, 'id')
if not boot then
  boot = int(now)
  redis.call('HSET', K_BOOT, 'id', boot)
end
if ARGV[2] ~= '' and ARGV[2] ~= boot then  -- the caller saw an earlier dataset: it was lost
  redis.call('HSETNX', K_BOOT, 'warm', int(now + cfg.warm))
end
-- The Redis process serving the dataset ('run', its run id): another one than the last script saw
-- means a replica was promoted (a failover) or Redis restarted from its persistence files. Both
-- can lose the last writes it acknowledged (replication and fsync are asynchronous): leases the
-- workers still hold. Grants pause as after a data loss, while the heartbeats put them back.
local moved = false
do
  local run = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
  local seen = redis.call('HGET', K_BOOT, 'run')
  if run and seen ~= run then
    moved = seen ~= false
    if moved then
      local warm = now + cfg.warm
      if warm > tonumber(redis.call('HGET', K_BOOT, 'warm') or '0') then
        redis.call('HSET', K_BOOT, 'warm', int(warm))
      end
      redis.call('HINCRBY', K_COUNT, 'failovers', 1)
    end
    redis.call('HSET', K_BOOT, 'run', run)
  end
end
local warming = now < tonumber(redis.call('HGET', K_BOOT, 'warm') or '0')

-- The lease clock (see above): 'last' is the previous script's time (kept for the drain rate below).
local lease_now
do
  local last = tonumber(redis.call('HGET', K_REL, 'last') or now)
  local lost = tonumber(redis.call('HGET', K_BOOT, 'lost') or '0')
  if moved and now > last then
    -- The spell before a failover's first script does not count at all: the holders must find the
    -- new primary first (through Sentinel, past connections to the old one that time out).
    lost = lost + (now - last)
    redis.call('HSET', K_BOOT, 'lost', int(lost))
  elseif now - last > cfg.beat then  -- nobody could renew in this spell: it counts as one heartbeat
    lost = lost + (now - last - cfg.beat)
    redis.call('HSET', K_BOOT, 'lost', int(lost))
  end
  lease_now = now - lost
end

-- A drain rate's bytes and busy seconds after 'elapsed' more busy seconds (drain.DrainRate): both
-- decay by d, the seconds grow by window * (1 - d), the exact continuous average, so advancing in
-- one step or in several gives the same numbers (to rounding), in the same arithmetic as Python.
local function decayed(b, secs, elapsed)
  local d = math.exp(-elapsed / cfg.window)
  return b * d, secs * d + cfg.window * (1 - d)
end

-- The drain rate (gpu_asgi/_ledger/drain.py): decay by busy time only, since the last script.
do
  local rel = redis.call('HMGET', K_REL, 'bytes', 'seconds', 'last', 'busy')
  local last = tonumber(rel[3] or now)
  if rel[4] == '1' and now > last then
    local b, secs = decayed(tonumber(rel[1] or '0'), tonumber(rel[2] or '0'), (now - last) / 1000)
    redis.call('HSET', K_REL, 'bytes', string.format('%.17g', b), 'seconds', string.format('%.17g', secs))
  end
  if now > last or not rel[3] then redis.call('HSET', K_REL, 'last', int(now)) end
end

local function finish()
  local busy = '0'
  for _, n in ipairs(redis.call('HVALS', K_RES)) do
    if tonumber(n) > 0 then busy = '1' break end
  end
  redis.call('HSET', K_REL, 'busy', busy)
end

local function free(dev)
  local cap = cfg.caps[dev]
  if not cap then return -1 end
  return cap - tonumber(redis.call('HGET', K_RES, dev) or '0')
end

-- The allowed device with the most free bytes (the first such, in the ledger's order), if it fits.
local function place(n, devs)
  local best, most = nil, -1
  for _, dev in ipairs(devs) do
    local f = free(dev)
    if f > most then best, most = dev, f end
  end
  if best and most >= n then return best end
  return nil
end

-- Tenants' accounts: the same fields and arithmetic as gpu_asgi/_ledger/fair_share.py.
local function account(t)
  local r = redis.call('HMGET', K_TEN .. ':' .. t, 'held', 'inflight', 'waiting', 'wbytes', 'vt', 'served', 'last',
    'credit', 'low', 'hcredit', 'high', 'abytes', 'asecs', 'alast')
  local policy = cfg.tenants[t] or cfg.default
  return {name = t, weight = policy[1], quota = policy[2], held = tonumber(r[1] or '0'),
    inflight = tonumber(r[2] or '0'), waiting = tonumber(r[3] or '0'), wbytes = tonumber(r[4] or '0'),
    vt = tonumber(r[5] or '0'), served = tonumber(r[6] or '0'), last = tonumber(r[7] or now),
    credit = tonumber(r[8] or '0'), low = r[9] or '', hcredit = tonumber(r[10] or '0'), high = r[11] or '',
    abytes = tonumber(r[12] or '0'), asecs = tonumber(r[13] or '0'), alast = tonumber(r[14] or now)}
end

local function save(a)
  local key = K_TEN .. ':' .. a.name
  redis.call('HSET', key, 'held', int(a.held), 'inflight', int(a.inflight), 'waiting', int(a.waiting),
    'wbytes', int(a.wbytes), 'vt', string.format('%.17g', a.vt), 'served', string.format('%.17g', a.served),
    'last', int(a.last), 'credit', string.format('%.17g', a.credit), 'low', a.low,
    'hcredit', string.format('%.17g', a.hcredit), 'high', a.high, 'abytes', string.format('%.17g', a.abytes),
    'asecs', string.format('%.17g', a.asecs), 'alast', int(a.alast))
  if a.inflight > 0 or a.waiting > 0 then
    redis.call('PERSIST', key)
    redis.call('SADD', K_TEN, a.name)
  else  -- idle: forgotten after tenant_idle_ttl unless used again
    redis.call('PEXPIRE', key, cfg.idle)
    redis.call('SREM', K_TEN, a.name)
  end
end

-- Virtual time now, without bringing it up to date (stored values change only at shared events).
local function vt_at(a)
  if now > a.last then return a.vt + a.held * ((now - a.last) / 1000) / a.weight end
  return a.vt
end

local function advance(a)
  if now > a.last then
    local elapsed = (now - a.last) / 1000
    a.vt = a.vt + a.held * elapsed / a.weight
    a.served = a.served + a.held * elapsed
    a.last = now
  end
end

-- The tenant's admission rate (fair_share.Account.admissions, a drain.DrainRate): bytes of its
-- waiters admitted, decayed by the seconds it had a waiter, and those seconds. Called before every
-- change of 'waiting', so waiting > 0 says whether it had one since 'alast'.
local function admissions_advance(a)
  if a.waiting > 0 and now > a.alast then a.abytes, a.asecs = decayed(a.abytes, a.asecs, (now - a.alast) / 1000) end
  if now > a.alast then a.alast = now end
end

-- A rate from its decayed sums (drain.drain_rate): 0 until a release and cfg.span weighted seconds.
local function rate_of(b, secs)
  if b > 0 and secs >= cfg.span then return b / secs end
  return 0
end

-- The admission rate as if advanced to now (DrainRate.rate_at).
local function admission_rate(a)
  local b, secs = a.abytes, a.asecs
  if a.waiting > 0 and now > a.alast then b, secs = decayed(b, secs, (now - a.alast) / 1000) end
  return rate_of(b, secs)
end

local function tenant_holds(t, n, leases)
  local a = account(t)
  advance(a)
  a.held, a.inflight = a.held + n, a.inflight + leases
  save(a)
end

-- Whether name x comes before y byte by byte (code-point order for UTF-8, as Python's sort:
-- Lua's own '<' follows the server's locale).
local function before(x, y)
  for i = 1, math.min(#x, #y) do
    local p, q = string.byte(x, i), string.byte(y, i)
    if p ~= q then return p < q end
  end
  return #x < #y
end

-- The virtual times of the other tenants that wait (of those that hold, when none waits), by
-- name, and the lowest and highest of them (the first name among equals).
local function others_of(t)
  local waiting, holding = {}, {}
  for _, other in ipairs(redis.call('SMEMBERS', K_TEN)) do
    if other ~= t then
      local b = account(other)
      if b.waiting > 0 then waiting[other] = vt_at(b) end
      if b.inflight > 0 then holding[other] = vt_at(b) end
    end
  end
  local others = next(waiting) and waiting or holding
  local low, high = nil, nil
  for name, v in pairs(others) do
    if low == nil or v < others[low] or (v == others[low] and before(name, low)) then low = name end
    if high == nil or v > others[high] or (v == others[high] and before(name, high)) then high = name end
  end
  return others, low, high
end

-- A waiter joins; the tenant's first one is lifted (fair_share.lift): no more lead than it had
-- over the tenants it was measured against that are still among the others, never behind the
-- lowest; when neither is, its credit against the lowest now.
local function tenant_queued(t, n)
  local a = account(t)
  admissions_advance(a)
  if a.waiting == 0 then
    advance(a)
    local others, low = others_of(t)
    if low then
      local floor = others[low]
      local target = floor - a.credit
      local kept = nil
      if others[a.low] then kept = others[a.low] - a.credit end
      if others[a.high] then
        local k = others[a.high] - a.hcredit
        if kept == nil or k > kept then kept = k end
      end
      if kept ~= nil then target = math.min(floor, kept) end
      if target > a.vt then a.vt = target end
    end
  end
  a.waiting, a.wbytes = a.waiting + 1, a.wbytes + n
  save(a)
end

-- A waiter left (admitted, timed out, cancelled); the tenant's last one records its lead over the
-- lowest and the highest of the others (fair_share.measure). An admitted one counts in its rate.
local function tenant_left(t, n, admitted)
  local a = account(t)
  admissions_advance(a)
  if admitted then a.abytes = a.abytes + n end
  a.waiting, a.wbytes = math.max(0, a.waiting - 1), math.max(0, a.wbytes - n)
  if a.waiting == 0 then
    local others, low, high = others_of(t)
    a.credit, a.low, a.hcredit, a.high = 0, '', 0, ''
    if low then
      local v = vt_at(a)
      a.low, a.high = low, high
      if others[low] - v > 0 then a.credit = others[low] - v end
      if others[high] - v > 0 then a.hcredit = others[high] - v end
    end
  end
  save(a)
end

local function fits_quota(a, n)
  return a.quota == 0 or a.held + n <= a.quota
end

local function hold(id, n, dev, t)
  redis.call('HINCRBY', K_RES, dev, int(n))
  redis.call('HINCRBY', K_INFL, dev, 1)
  redis.call('HSET', K_LEASE, id, int(n) .. ' ' .. dev)
  redis.call('HSET', K_HOLDER, id, t)
  redis.call('ZADD', K_EXP, int(lease_now + cfg.ttl), id)
  tenant_holds(t, n, 1)
end

local function grant(id, n, dev, t)
  hold(id, n, dev, t)
  redis.call('HINCRBY', K_COUNT, 'admitted', 1)
end

local function returned(n)
  if n > 0 then redis.call('HINCRBYFLOAT', K_REL, 'bytes', n) end
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
  local t = redis.call('HGET', K_HOLDER, id)
  if t then
    redis.call('HDEL', K_HOLDER, id)
    tenant_holds(t, -n, -1)
  end
  returned(n)
  return true
end

local function lane_key(lane) return K_QUEUE .. ':' .. lane end

local function drop_ticket(id, admitted)
  local raw = redis.call('HGET', K_TICKET, id)
  if not raw then return false end
  local w = cjson.decode(raw)
  redis.call('HDEL', K_TICKET, id)
  redis.call('ZREM', K_QUEUE, id)
  redis.call('ZREM', lane_key(w.l), id)
  redis.call('HINCRBY', K_COUNT, 'waiting_bytes', int(-tonumber(w.n)))
  if redis.call('HINCRBY', K_COUNT, 'n:' .. w.l, -1) <= 0 then
    redis.call('HDEL', K_COUNT, 'bytes:' .. w.l, 'n:' .. w.l)
  else
    redis.call('HINCRBY', K_COUNT, 'bytes:' .. w.l, int(-tonumber(w.n)))
  end
  tenant_left(w.t, tonumber(w.n), admitted)
  return true
end

-- Expired leases and tickets (a crashed worker's), by the lease clock; how many went.
local function reap()
  local expired = redis.call('ZRANGEBYSCORE', K_EXP, '-inf', lease_now, 'LIMIT', 0, 256)
  for _, id in ipairs(expired) do
    redis.call('ZREM', K_EXP, id)
    drop_lease(id)
    drop_ticket(id)
  end
  return #expired
end

-- Each lane's first ticket (in no particular order).
local function heads()
  local hs = {}
  for _, lane in ipairs(redis.call('SMEMBERS', K_LANES)) do
    while true do
      local first = redis.call('ZRANGE', lane_key(lane), 0, 0)[1]
      if not first then
        redis.call('SREM', K_LANES, lane)
        break
      end
      local raw = redis.call('HGET', K_TICKET, first)
      if raw then
        local w = cjson.decode(raw)
        w.id, w.bytes = first, tonumber(w.n)
        hs[#hs + 1] = w
        break
      end
      redis.call('ZREM', lane_key(lane), first)  -- a ticket that went without its lane entry
    end
  end
  return hs
end

-- Is head h ahead of head w: its tenant's virtual time lower, or the same and h arrived first?
local function ahead(h, w)
  if h.v ~= w.v then return h.v < w.v end
  return h.s < w.s
end

local function has(list, x)
  for _, y in ipairs(list) do if y == x then return true end end
  return false
end

-- The device a head is admitted on now: among its devices no head ahead of it passed max_bypass
-- times has claimed, the one with the most free bytes, if it fits.
local function placement(w, hs)
  local usable = {}
  for _, dev in ipairs(w.d) do
    local claimed = false
    for _, h in ipairs(hs) do
      if h.b >= cfg.bypass and ahead(h, w) and has(h.d, dev) then claimed = true break end
    end
    if not claimed then usable[#usable + 1] = dev end
  end
  return place(w.bytes, usable)
end

local function dispatch()
  if warming then return end  -- leases lost with the data are being put back
  local granted, count = {}, 0
  while true do
    local hs, accounts, vts = {}, {}, {}
    for _, w in ipairs(heads()) do
      local a = accounts[w.t]
      if not a then
        a = account(w.t)
        accounts[w.t], vts[w.t] = a, vt_at(a)
      end
      w.v = vts[w.t]
      -- Quota-blocked heads are neither admitted nor passed, and claim nothing.
      if fits_quota(a, w.bytes) then hs[#hs + 1] = w end
    end
    table.sort(hs, function(a, b)
      if a.v ~= b.v then return a.v < b.v end
      if a.p ~= b.p then return a.p > b.p end
      return a.s < b.s
    end)
    local chosen, dev = nil, nil
    for _, w in ipairs(hs) do
      dev = placement(w, hs)
      if dev then chosen = w break end
    end
    if not chosen then break end
    for _, h in ipairs(hs) do  -- the admitted one passes the heads ahead of it that could use its device
      if ahead(h, chosen) and has(h.d, dev) then
        h.b = h.b + 1
        redis.call('HSET', K_TICKET, h.id,
          cjson.encode({n = h.n, d = h.d, p = h.p, s = h.s, l = h.l, b = h.b, t = h.t}))
      end
    end
    drop_ticket(chosen.id, true)
    grant(chosen.id, chosen.bytes, dev, chosen.t)
    granted[chosen.id], count = dev, count + 1
  end
  if count > 0 then redis.call('PUBLISH', cfg.chan, cjson.encode(granted)) end
end

local function granted_device(id)
  local n, dev = lease_of(id)
  return dev
end

local function size_class(n)
  local c = 0
  while n >= 1 do n, c = math.floor(n / 2), c + 1 end
  return c
end

-- The shared state now, as redis/scripts.py's Beat reads it: bytes and leases held by device, waiters,
-- the counts, the drain rate's bytes and busy seconds, the boot id, and one row per tenant that
-- holds or waits, per configured one and for tenant 'also' (if given): name, held, leases,
-- waiting, bytes waiting, byte-seconds served up to now, virtual time, its lead (credit, low,
-- hcredit, high) and its admission rate now (0 while unknown). What Retry-After and the deadline
-- decision need; its cost grows with the lanes and tenants, never with the waiters.
local function snapshot(also)
  local rel = redis.call('HMGET', K_REL, 'bytes', 'seconds')
  local tenants, seen = {}, {}
  local function row(t)
    if seen[t] then return end
    seen[t] = true
    local a = account(t)
    local served = a.served
    if now > a.last then served = served + a.held * ((now - a.last) / 1000) end
    tenants[#tenants + 1] = {t, int(a.held), int(a.inflight), int(a.waiting), int(a.wbytes),
      string.format('%.17g', served), string.format('%.17g', vt_at(a)), string.format('%.17g', a.credit), a.low,
      string.format('%.17g', a.hcredit), a.high, string.format('%.17g', admission_rate(a))}
  end
  for _, t in ipairs(redis.call('SMEMBERS', K_TEN)) do row(t) end
  for t, _ in pairs(cfg.tenants) do row(t) end
  if also then row(also) end
  return {redis.call('HGETALL', K_RES), redis.call('HGETALL', K_INFL), redis.call('ZCARD', K_QUEUE),
          redis.call('HGETALL', K_COUNT), rel[1] or '0', rel[2] or '0', boot, tenants}
end
