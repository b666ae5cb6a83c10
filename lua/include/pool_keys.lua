-- The fixed KEYS list shared by every request-lifecycle script. limiter/scripts.py
-- (lifecycle_keys) builds it in this order from limiter/keys.py. All carry the pool's hash
-- tag; per-entity keys are built below from the prefixes, so they carry it too.
local K_POLICY = KEYS[1]          -- HASH pool policy
local K_QUEUED = KEYS[2]          -- HASH <class> -> queued count, <class>.cost -> their reserved cost
local K_DEADLINES = KEYS[3]       -- ZSET queued id -> deadline ms
local K_LEASES = KEYS[4]          -- ZSET leased id -> lease deadline ms
local K_CANCELS = KEYS[5]         -- SET leased ids whose client is gone
local K_SERVED = KEYS[6]          -- HASH class -> decayed claimed cost, ts (floors, service rate)
local K_WAKE = KEYS[7]            -- LIST wake markers for idle workers
local K_INFLIGHT = KEYS[8]        -- HASH class -> leased count
local K_TENANT_INFLIGHT = KEYS[9] -- HASH tenant -> unfinished count
local K_STATS = KEYS[10]          -- HASH counters <class>.<event>, seq, lease_fence
local K_SAMPLES = KEYS[11]        -- STREAM latency samples (msgpack field d)
local K_FRONTENDS = KEYS[12]      -- ZSET frontend id -> last heartbeat ms
local K_OUTAGE = KEYS[13]         -- STRING ms the frontends lost Redis (set when they beat again)
local K_WORKERS = KEYS[14]        -- ZSET worker id -> last heartbeat ms
local K_WORKER_KV = KEYS[15]      -- HASH worker id -> its whole KV room in tokens (from claim)
local P_REQUEST = KEYS[16]        -- prefix of HASH req:<id>
local P_TOKENS = KEYS[17]         -- prefix of STRING gen:<id> (uint32 LE token ids)
local P_BUCKET = KEYS[18]         -- prefix of HASH bucket:tenant:<t>, bucket:class:<c>, bucket:ceil:<c>
local P_QUEUE = KEYS[19]          -- prefix of ZSET queue:<class>:<tenant> (id -> seq)
local P_BACKLOG = KEYS[20]        -- prefix of ZSET backlog:<class> (backlogged tenant -> virtual counter)
local P_VTIME = KEYS[21]          -- prefix of HASH vtime:<class> (tenant -> counter while idle)
local P_REPLY = KEYS[22]          -- prefix of STREAM out:<frontend>
local REPLY_MAXLEN = '100000'  -- a string: redis.call formats a number with '%.17g' at every use
local SAMPLES_MAXLEN = 100000
local REPLY_TTL_S = 600
