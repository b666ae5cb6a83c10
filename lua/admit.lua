-- admit: charge the tenant bucket and the class (or borrowed pool) budget together, then
-- enqueue the request. One call, all or nothing. Idempotent per request id.
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; PoolKeys.lifecycle_keys()).
-- ARGV[1]  request_id          name, unguessable id chosen by the frontend
-- ARGV[2]  tenant              name
-- ARGV[3]  class               a class of the pool policy
-- ARGV[4]  input_tokens        integer >= 0 (prompt tokens)
-- ARGV[5]  max_tokens          integer >= 1 (output tokens reserved)
-- ARGV[6]  tenant_rate         weighted tokens/s > 0
-- ARGV[7]  tenant_burst        weighted tokens > 0
-- ARGV[8]  tenant_max_inflight integer >= 0, 0 = no cap on unfinished requests
-- ARGV[9]  max_wait_ms         integer >= 0, 0 = the class default; never above it
-- ARGV[10] frontend_id         name of the frontend whose reply stream gets the answer
-- ARGV[11] payload             opaque bytes (msgpack prompt + sampling params), <= 8 MiB
--
-- Cost = input_tokens x weight + max_tokens x out_weight. A bucket admits when it holds
-- min(cost, burst) tokens (a request larger than the burst needs a full bucket and leaves
-- debt), so `retry_after_ms` is always finite and honest.
-- Borrowing (HTB rate/ceil): when the class bucket lacks tokens the request may borrow
-- from the pool bucket, if the class's ceiling bucket allows it and the pool keeps a
-- reserve equal to the bursts of all higher classes (so higher classes borrow first).
-- The top class (no reserve) may borrow into the pool's debt, down to -pool_burst: every
-- admission charges the pool, so at overload, with each class at its rate, the pool sits
-- near empty and a burst of the top class would be turned away while lower classes use
-- their guarantees. Admitted anyway, it runs first (claim is strict priority) and lower
-- classes wait in their queues; the debt stops every class's borrowing until it is repaid.
--
-- Returns one of
--   {'queued', depth, cost, borrowed(0|1), deadline_ms}
--   {'duplicate', state}                      the id was admitted before; nothing charged
--   {'throttled', retry_after_ms, bucket}     bucket = tenant|class; -1 = class disabled
--   {'queue_full', depth}
--   {'tenant_busy', inflight}
-- Errors: 'BADARG <field>: ...', 'NOPOLICY ...'.

--!include validate.lua
--!include policy.lua
--!include bucket.lua
--!include pool_keys.lua

local function main()
  local request_id = arg_name(ARGV[1], 'request_id')
  local tenant = arg_name(ARGV[2], 'tenant')
  local cls = arg_name(ARGV[3], 'class')
  local input_tokens = arg_int(ARGV[4], 'input_tokens', 0, 10000000)
  local max_tokens = arg_int(ARGV[5], 'max_tokens', 1, 10000000)
  local tenant_rate = arg_num(ARGV[6], 'tenant_rate', 1e-9, 1e12)
  local tenant_burst = arg_num(ARGV[7], 'tenant_burst', 1e-9, 1e15)
  local tenant_max_inflight = arg_int(ARGV[8], 'tenant_max_inflight', 0, 1000000000)
  local max_wait_ms = arg_int(ARGV[9], 'max_wait_ms', 0, 86400000)
  local frontend_id = arg_name(ARGV[10], 'frontend_id')
  local payload = ARGV[11]
  if payload == nil or #payload > 8388608 then fail('BADARG', 'payload: missing or over 8 MiB') end
  local c = load_class_policy(K_POLICY, cls)

  local key = P_REQUEST .. request_id
  local state = redis.call('HGET', key, 'state')
  if state then return {'duplicate', state} end

  if tenant_max_inflight > 0 then
    local busy = tonumber(redis.call('HGET', K_TENANT_INFLIGHT, tenant) or '0')
    if busy >= tenant_max_inflight then return {'tenant_busy', busy} end
  end
  local queue = P_QUEUE .. cls
  local depth = redis.call('ZCARD', queue)
  if depth >= c.queue_cap then return {'queue_full', depth} end

  local now = now_ms()
  local cost = input_tokens * c.weight + max_tokens * c.out_weight

  local tkey = P_BUCKET .. 'tenant:' .. tenant
  local lt = bucket_level(tkey, tenant_rate, tenant_burst, now)
  if lt < math.min(cost, tenant_burst) then
    return {'throttled', bucket_wait_ms(lt, math.min(cost, tenant_burst), tenant_rate), 'tenant'}
  end

  local ckey, ceilkey = P_BUCKET .. 'class:' .. cls, P_BUCKET .. 'ceil:' .. cls
  local lc = bucket_level(ckey, c.rate, c.burst, now)
  local lceil = bucket_level(ceilkey, c.ceil, c.ceil_burst, now)
  local lp = bucket_level(K_POOL_BUCKET, c.capacity, c.pool_burst, now)
  local need_c = math.min(cost, c.burst)
  local borrowed = 0
  if c.rate > 0 and lc >= need_c then
    bucket_store(ckey, lc - cost, now, -math.huge, c.burst)
  else
    local reserve = c.reserve or 0
    if reserve == 0 then reserve = -c.pool_burst end  -- the top class may overdraw (header)
    local need_p = math.min(cost, math.max(c.pool_burst - math.max(reserve, 0), 0))
    local need_ceil = math.min(cost, c.ceil_burst)
    if c.ceil > c.rate and lceil >= need_ceil and lp - reserve >= need_p then
      borrowed = 1
    else
      local wait = bucket_wait_ms(lc, need_c, c.rate)
      if c.ceil > c.rate and c.capacity > 0 then
        local wb = math.max(bucket_wait_ms(lceil, need_ceil, c.ceil),
          bucket_wait_ms(lp, reserve + need_p, c.capacity))
        if wait < 0 or wb < wait then wait = wb end
      end
      return {'throttled', wait, 'class'}
    end
  end
  -- Every admission counts against the ceiling and the pool; debt is bounded by a burst.
  bucket_store(ceilkey, lceil - cost, now, -c.ceil_burst, c.ceil_burst)
  bucket_store(K_POOL_BUCKET, lp - cost, now, -c.pool_burst, c.pool_burst)
  -- Tenants come from the config, so their buckets are bounded in number: no TTL needed.
  bucket_store(tkey, lt - cost, now, -math.huge, tenant_burst)

  local wait = c.max_wait_ms
  if max_wait_ms > 0 and max_wait_ms < wait then wait = max_wait_ms end
  local deadline = now + wait
  local seq = redis.call('HINCRBY', K_STATS, 'seq', 1)
  redis.call('HSET', key, 'id', request_id, 'tenant', tenant, 'class', cls, 'state', 'queued',
    'frontend', frontend_id, 'attempts', 0, 'enq_ms', now, 'seq', seq,
    'deadline_ms', deadline, 'input_tokens', input_tokens, 'max_tokens', max_tokens,
    'w_in', fmt(c.weight), 'w_out', fmt(c.out_weight), 'cost', fmt(cost),
    'c_class', fmt(borrowed == 1 and 0 or cost), 'c_pool', fmt(cost),
    't_rate', fmt(tenant_rate), 't_burst', fmt(tenant_burst), 'payload', payload)
  -- A safety net only: every path to a terminal state sets the short record TTL.
  redis.call('EXPIRE', key, 86400)
  redis.call('ZADD', queue, seq, request_id)
  redis.call('ZADD', K_DEADLINES, deadline, request_id)
  redis.call('HINCRBY', K_TENANT_INFLIGHT, tenant, 1)
  redis.call('HINCRBY', K_STATS, cls .. '.admitted', 1)
  if borrowed == 1 then redis.call('HINCRBY', K_STATS, cls .. '.borrowed', 1) end
  if redis.call('LPUSH', K_WAKE, '1') > 64 then redis.call('LTRIM', K_WAKE, 0, 63) end
  return {'queued', depth + 1, fmt(cost), borrowed, deadline}
end

--!include main.lua
