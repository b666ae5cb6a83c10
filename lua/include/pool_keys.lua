-- The fixed KEYS list shared by every request-lifecycle script. limiter/scripts.py
-- (lifecycle_keys) builds it in this order from limiter/keys.py. All carry the pool's hash
-- tag; per-entity keys are built below from the prefixes, so they carry it too.
-- The four a push uses come first: push_tokens is passed only those (limiter/scripts.py
-- PUSH_KEYS), since every key a call carries costs it ~1k instructions (callgrind: 18 keys
-- were ~19k of a push's ~740k for 8 requests, and of ~230k for one). In a script passed the
-- head of the list only, the names of the keys after it are nil.
local K_POLICY = KEYS[1]          -- HASH pool policy
local P_REQUEST = KEYS[2]         -- prefix of HASH req:<id>
local P_TOKENS = KEYS[3]          -- prefix of STRING gen:<id> (uint32 LE token ids)
local P_REPLY = KEYS[4]           -- prefix of STREAM out:<frontend>
local K_QUEUED = KEYS[5]          -- HASH <class> -> queued count, <class>.cost -> their reserved cost
local K_DEADLINES = KEYS[6]       -- ZSET queued id -> deadline ms
local K_LEASES = KEYS[7]          -- ZSET leased id -> lease deadline ms
local K_CANCELS = KEYS[8]         -- SET leased ids whose client is gone
local K_SERVED = KEYS[9]          -- HASH class -> decayed claimed cost, ts (floors, service rate)
local K_WAKE = KEYS[10]           -- LIST wake markers for idle workers
local K_INFLIGHT = KEYS[11]       -- HASH class -> leased count
local K_TENANT_INFLIGHT = KEYS[12] -- HASH tenant -> unfinished count
local K_STATS = KEYS[13]          -- HASH counters <class>.<event>, seq, lease_fence
local K_SAMPLES = KEYS[14]        -- STREAM latency samples (msgpack field d)
local K_FRONTENDS = KEYS[15]      -- ZSET frontend id -> last heartbeat ms
local K_OUTAGE = KEYS[16]         -- STRING ms the frontends lost Redis (set when they beat again)
local K_WORKERS = KEYS[17]        -- ZSET worker id -> last heartbeat ms
local K_WORKER_KV = KEYS[18]      -- HASH worker id -> its whole KV room in tokens (from claim)
local P_BUCKET = KEYS[19]         -- prefix of HASH bucket:tenant:<t>, bucket:class:<c>, bucket:ceil:<c>
local P_QUEUE = KEYS[20]          -- prefix of ZSET queue:<class>:<tenant> (id -> seq)
local P_BACKLOG = KEYS[21]        -- prefix of ZSET backlog:<class> (backlogged tenant -> virtual counter)
local P_VTIME = KEYS[22]          -- prefix of HASH vtime:<class> (tenant -> counter while idle)
local REPLY_MAXLEN = '100000'  -- a string: redis.call formats a number with '%.17g' at every use
local SAMPLES_MAXLEN = 100000
local REPLY_TTL_S = 600
