-- The fixed KEYS list shared by every request-lifecycle script (limiter/keys.py,
-- PoolKeys.lifecycle_keys builds it in this order). All carry the pool's hash tag.
local K_POLICY = KEYS[1]          -- HASH pool policy
local K_POOL_BUCKET = KEYS[2]     -- HASH pool-level bucket (tokens, ts)
local K_DEADLINES = KEYS[3]       -- ZSET queued id -> deadline ms
local K_LEASES = KEYS[4]          -- ZSET leased id -> lease deadline ms
local K_CANCELS = KEYS[5]         -- SET leased ids whose client is gone
local K_SERVED = KEYS[6]          -- HASH class -> decayed served cost, ts
local K_WAKE = KEYS[7]            -- LIST wake markers for idle workers
local K_INFLIGHT = KEYS[8]        -- HASH class -> leased count
local K_TENANT_INFLIGHT = KEYS[9] -- HASH tenant -> unfinished count
local K_STATS = KEYS[10]          -- HASH counters <class>.<event>
local K_SAMPLES = KEYS[11]        -- STREAM latency samples (msgpack field d)
local K_FRONTENDS = KEYS[12]      -- ZSET frontend id -> last heartbeat ms
local P_REQUEST = KEYS[13]        -- prefix of HASH req:<id>
local P_TOKENS = KEYS[14]         -- prefix of STRING gen:<id> (uint32 LE token ids)
local P_BUCKET = KEYS[15]         -- prefix of HASH bucket:class:<c>, bucket:ceil:<c>, bucket:tenant:<t>
local P_QUEUE = KEYS[16]          -- prefix of ZSET queue:<class>
local P_REPLY = KEYS[17]          -- prefix of STREAM out:<frontend>
local K_OUTAGE = KEYS[18]         -- STRING ms the frontends lost Redis (set when they beat again)
local REPLY_MAXLEN = 100000
local SAMPLES_MAXLEN = 100000
local REPLY_TTL_S = 600
