-- Every script starts here. KEYS: the twelve keys (redis/lua.py); ARGV: the ledger's config (JSON),
-- the boot id the caller last saw ('' if none), then the script's own arguments (ARG).
local K_EXP, K_LEASE, K_TICKET, K_QUEUE, K_RES, K_INFL, K_COUNT, K_REL, K_BOOT, K_LANES, K_TEN, K_HOLDER =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12]
local cfg = cjson.decode(ARGV[1])
local ARG = {}
for i = 3, #ARGV do ARG[i - 2] = ARGV[i] end
