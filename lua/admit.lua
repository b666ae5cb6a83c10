-- admit: check requests against the hard limits, then queue each that passes. Idempotent
-- per request id. One call takes up to 64 requests (a frontend's admits of one event-loop
-- turn); they are admitted one after the other, each seeing the ones before it, exactly as
-- the same requests in separate calls, and every argument of every request is checked
-- before the first write.
--
-- Admission enforces limits, not shares (which class runs next is decided by claim, where
-- the free capacity is known). It refuses only when
--   * the tenant is at its in-flight cap (tenant_busy), or the class queue at its cap
--     (queue_full);
--   * the tenant's own quota bucket lacks tokens (throttled, bucket = tenant), or the class
--     is disabled (ceiling 0: throttled, bucket = class, retry_after_ms = -1);
--   * the request cannot start within its max wait (overloaded): the estimated wait, from
--     the work queued ahead of it and the service rate it can get, is longer than its max
--     wait. A request above its class's guaranteed rate is queued, not refused.
-- Only the tenant bucket is charged here (its debit is recorded in the request as c_tenant).
--
-- Wait estimate (ms) for tenant t in class c, the smaller of two ways it gets served:
--   by its guarantee:  (ahead_c + debt of c's guarantee bucket) / rate_c
--   by spare capacity: (ahead_c + queued work of every higher class)
--                      / (R - served rate of the higher classes - rates of backlogged lower ones)
--                      and, where c's ceiling binds, at least (ahead_c + ceiling debt) / ceil_c
-- ahead_c is the class's queued work in arrival order (fair = 0); in a fair class it is
-- t's own queued work scaled by t's share of the class, w_t / (w_t + other backlogged
-- tenants), and never more than the whole class queue: a flooding tenant's backlog does
-- not make a light tenant wait (or be refused).
-- R = max(capacity, the pool's measured claim rate); served rates come from the decayed
-- ledger claim keeps (include/served.lua).
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; limiter/scripts.py lifecycle_keys).
-- ARGV: n groups of the 12 arguments below, n in 1..64, request k's at ARGV[12 (k - 1) + i];
-- a call of one request may leave out its tenant_weight (1).
-- ARGV[1]  request_id          name, unguessable id chosen by the frontend
-- ARGV[2]  tenant              name
-- ARGV[3]  class               a class of the pool policy
-- ARGV[4]  input_tokens        integer >= 0 (prompt tokens)
-- ARGV[5]  max_tokens          integer >= 1 (output tokens reserved)
-- ARGV[6]  tenant_rate         weighted tokens/s in [1e-9, 1e12]
-- ARGV[7]  tenant_burst        weighted tokens in [1e-9, 1e15]
-- ARGV[8]  tenant_max_inflight integer >= 0, 0 = no cap on unfinished requests
-- ARGV[9]  max_wait_ms         integer >= 0, 0 = the class default; never above it
-- ARGV[10] frontend_id         name of the frontend whose reply stream gets the answer
-- ARGV[11] payload             opaque bytes (msgpack prompt + sampling params), <= 8 MiB
--                              (limiter/scripts.py MAX_PAYLOAD_BYTES)
-- ARGV[12] tenant_weight       number in (0, 1e6]: the tenant's share of its class (VTC)
--
-- Cost = input_tokens x weight + max_tokens x out_weight. The tenant bucket admits when it
-- holds min(cost, burst) tokens (a request larger than the burst needs a full bucket and
-- leaves debt), so `retry_after_ms` is always finite and honest.
--
-- Returns, for a call of one request, its reply; for n > 1, {reply_1, ..., reply_n}. A reply
-- is one of
--   {'queued', depth, cost, est_wait_ms, deadline_ms}
--   {'duplicate', state}                      the id was admitted before; nothing charged
--   {'throttled', retry_after_ms, bucket}     bucket = tenant|class; -1 = class disabled;
--                                             at most 1e15 (a wait of over 31,000 years)
--   {'overloaded', retry_after_ms, est_wait_ms, max_wait_ms}  it could not start in time
--                                             (-1, -1: the class gets no capacity now)
--   {'queue_full', depth}
--   {'tenant_busy', inflight}
-- Errors: 'BADARG <field>: ...' (an argument of any request: nothing is admitted),
-- 'NOPOLICY ...'.

--!include pool_keys.lua
--!include validate.lua
--!include policy.lua
--!include bucket.lua
--!include record.lua
--!include queue.lua
--!include served.lua
--!include wake.lua

local LN2 = math.log(2)

local function wait_estimate_ms(p, cls, tenant, weight, q, now)
  local c = p.class[cls]
  local rank = p.index[cls]
  -- the class's work ahead of this request: all of it in arrival order; in a fair class
  -- only the tenant's own queued work, drained at its share w / (w + others' weights) of the
  -- class (every other backlogged tenant counted at weight 1)
  local own = q.cost[cls]
  if c.fair then
    local mine = q.tenant_cost
    local others = redis.call('ZCARD', P_BACKLOG .. cls)
    if mine > 0 then others = others - 1 end
    own = math.min(own, mine * (weight + others) / weight)
  end
  local served, ts = read_served(now)
  local to_rate = 0.5 ^ (math.max(now - ts, 0) / p.floor_half_life_ms) * LN2 / (p.floor_half_life_ms / 1000)
  local measured, total = {}, 0
  for _, j in ipairs(p.classes) do
    measured[j] = (served[j] or 0) * to_rate
    total = total + measured[j]
  end
  local spare, ahead = math.max(p.capacity, total), own
  for i, j in ipairs(p.classes) do
    if i < rank then
      spare = spare - measured[j]
      ahead = ahead + q.cost[j]
    elseif i > rank and q.n[j] > 0 then
      spare = spare - p.class[j].rate
    end
  end
  local est = math.huge
  -- (the subtraction's rounding leaves ~1e-12 where nothing is spare: no spare capacity,
  -- not a sliver of it that admitted a class with no rate, or waited an int64 overflow)
  if spare > 1e-9 * math.max(p.capacity, total) then est = ahead / spare end
  if c.rate > 0 then
    local g = bucket_get(P_BUCKET .. 'class:' .. cls, c.rate, c.burst, now)
    est = math.min(est, (own + math.max(-g.level, 0)) / c.rate)
  end
  -- after the guarantee: a claim serves no class whose ceiling bucket is not above 0, whatever
  -- its guarantee holds (the other order let a class deep in ceiling debt admit what expired)
  if ceiling_binds(p, c) then
    local h = bucket_get(P_BUCKET .. 'ceil:' .. cls, c.ceil, c.ceil_burst, now)
    est = math.max(est, (own + math.max(-h.level, 0)) / c.ceil)
  end
  return est * 1000
end

local ITEM = 12     -- arguments per request
local MAX_ITEMS = 64  -- requests per call (limiter/scripts.py ADMIT_LIMIT)

-- Request k's arguments, checked (BADARG before any write).
local function read_request(k)
  local a = ITEM * (k - 1)
  local r = {
    id = arg_name(ARGV[a + 1], 'request_id'),
    tenant = arg_name(ARGV[a + 2], 'tenant'),
    cls = arg_name(ARGV[a + 3], 'class'),
    input_tokens = arg_int(ARGV[a + 4], 'input_tokens', 0, 10000000),
    max_tokens = arg_int(ARGV[a + 5], 'max_tokens', 1, 10000000),
    rate = arg_num(ARGV[a + 6], 'tenant_rate', 1e-9, 1e12),
    burst = arg_num(ARGV[a + 7], 'tenant_burst', 1e-9, 1e15),
    max_inflight = arg_int(ARGV[a + 8], 'tenant_max_inflight', 0, 1000000000),
    max_wait_ms = arg_int(ARGV[a + 9], 'max_wait_ms', 0, 86400000),
    frontend = arg_name(ARGV[a + 10], 'frontend_id'),
    payload = ARGV[a + 11],
    weight = arg_num(ARGV[a + 12] or '1', 'tenant_weight', 1e-6, 1e6),
  }
  if r.payload == nil or #r.payload > 8388608 then fail('BADARG', 'payload: missing or over 8 MiB') end
  return r
end

-- Admit one checked request. Returns its reply.
local function admit_one(p, r, now)
  local c = r.c
  local key = P_REQUEST .. r.id
  local state = redis.call('HGET', key, 'state')
  if state then return {'duplicate', state} end

  if r.max_inflight > 0 then
    local busy = tonumber(redis.call('HGET', K_TENANT_INFLIGHT, r.tenant) or '0')
    if busy >= r.max_inflight then return {'tenant_busy', busy} end
  end
  local q = queued_counts(p, r.cls, r.tenant)
  local depth = q.n[r.cls]
  if depth >= c.queue_cap then return {'queue_full', depth} end
  if c.ceil <= 0 then return {'throttled', -1, 'class'} end

  local cost = r.input_tokens * c.weight + r.max_tokens * c.out_weight
  local tb = bucket_get(P_BUCKET .. 'tenant:' .. r.tenant, r.rate, r.burst, now)
  if tb.level < math.min(cost, r.burst) then
    return {'throttled', bucket_wait_ms(tb.level, math.min(cost, r.burst), r.rate), 'tenant'}
  end
  local wait = c.max_wait_ms
  if r.max_wait_ms > 0 and r.max_wait_ms < wait then wait = r.max_wait_ms end
  local est = wait_estimate_ms(p, r.cls, r.tenant, r.weight, q, now)
  if est > wait then
    if est >= MAX_WAIT_MS then return {'overloaded', -1, -1, wait} end  -- (an int64 reply)
    return {'overloaded', math.ceil(est - wait), math.ceil(est), wait}
  end

  -- Every check passed: from here on, writes. Tenants come from the config, so their
  -- buckets are bounded in number and need no TTL.
  local charged = bucket_debit(tb, cost, nil)
  local deadline = now + wait
  local seq = redis.call('HINCRBY', K_STATS, 'seq', 1)
  redis.call('HSET', key, 'id', r.id, 'tenant', r.tenant, 'class', r.cls, 'state', 'queued',
    'frontend', r.frontend, 'attempts', 0, 'fence', 0, 'enq_ms', now, 'seq', seq,
    'deadline_ms', deadline, 'max_wait_ms', wait, 'input_tokens', r.input_tokens,
    'max_tokens', r.max_tokens, 'w_in', fmt(c.weight), 'w_out', fmt(c.out_weight), 'cost', fmt(cost),
    't_rate', fmt(r.rate), 't_burst', fmt(r.burst), 't_weight', fmt(r.weight),
    'c_tenant', fmt(charged), 'payload', r.payload)
  keep_alive(p, r.id, deadline, now, true)
  enqueue(p, {id = r.id, class = r.cls, tenant = r.tenant, seq = seq, deadline_ms = deadline,
    cost = cost}, q)
  redis.call('HINCRBY', K_TENANT_INFLIGHT, r.tenant, 1)
  redis.call('HINCRBY', K_STATS, r.cls .. '.admitted', 1)
  return {'queued', depth + 1, fmt(cost), math.ceil(est), deadline}
end

local function main()
  local n = arg_items(ITEM, MAX_ITEMS)
  local requests = {}
  for k = 1, n do requests[k] = read_request(k) end
  local p = load_policy(K_POLICY)
  for _, r in ipairs(requests) do r.c = policy_class(p, r.cls) end
  local now = now_ms()
  local out, queued = {}, 0
  for k = 1, n do
    out[k] = admit_one(p, requests[k], now)
    if out[k][1] == 'queued' then queued = queued + 1 end
  end
  if queued > 0 then wake_workers(queued) end  -- a marker each, as separate calls push
  if n == 1 then return out[1] end
  return out
end

--!include main.lua
