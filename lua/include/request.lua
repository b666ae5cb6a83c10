-- Request records and their terminal transitions, shared by the lifecycle scripts.
-- Needs validate.lua, policy.lua, bucket.lua, pool_keys.lua and msgpack.lua.

local REQ_FIELDS = {'id', 'tenant', 'class', 'state', 'frontend', 'attempts', 'worker',
  'lease_ms', 'enq_ms', 'seq', 'deadline_ms', 'claimed_ms', 'first_ms', 'input_tokens',
  'max_tokens', 'w_in', 'w_out', 'cost', 'c_class', 'c_pool', 't_rate', 't_burst',
  'out_tokens', 'cancel'}
local REQ_NUMERIC = {attempts = true, lease_ms = true, enq_ms = true, seq = true,
  deadline_ms = true, claimed_ms = true, first_ms = true, input_tokens = true,
  max_tokens = true, w_in = true, w_out = true, cost = true, c_class = true, c_pool = true,
  t_rate = true, t_burst = true, out_tokens = true, cancel = true}

local function load_request(id)
  local v = redis.call('HMGET', P_REQUEST .. id, unpack(REQ_FIELDS))
  if not v[4] then return nil end
  local r = {}
  for i, f in ipairs(REQ_FIELDS) do
    local x = v[i]
    if x and REQ_NUMERIC[f] then x = tonumber(x) end
    if x == false then x = nil end
    r[f] = x
  end
  r.id = id
  r.attempts = r.attempts or 0
  r.out_tokens = r.out_tokens or 0
  r.cancel = r.cancel or 0
  r.worker = r.worker or ''
  return r
end

-- Weighted cost of what a request really used.
local function actual_cost(r, in_tokens, out_tokens)
  return in_tokens * r.w_in + out_tokens * r.w_out
end

-- Give back what was charged but not used; each bucket gets at most what it was charged.
local function refund_request(p, r, used, now)
  local refund = r.cost - used
  if refund <= 0 then return 0 end
  bucket_refund(P_BUCKET .. 'tenant:' .. r.tenant, refund, r.t_rate, r.t_burst, now)
  local c = p.class[r.class]
  if c then
    bucket_refund(P_BUCKET .. 'class:' .. r.class, math.min(refund, r.c_class or 0), c.rate, c.burst, now)
    bucket_refund(P_BUCKET .. 'ceil:' .. r.class, refund, c.ceil, c.ceil_burst, now)
  end
  bucket_refund(K_POOL_BUCKET, math.min(refund, r.c_pool or 0), p.capacity, p.pool_burst, now)
  return refund
end

local function notify(r, fields)
  if r.frontend and r.frontend ~= '' then
    local stream = P_REPLY .. r.frontend
    redis.call('XADD', stream, 'MAXLEN', '~', REPLY_MAXLEN, '*', 'id', r.id, unpack(fields))
    -- A frontend killed for good leaves no stream behind once nobody writes to it.
    redis.call('EXPIRE', stream, REPLY_TTL_S)
  end
end

-- A request cancelled without its frontend asking (the frontend was taken for dead) still
-- tells that frontend why: if it is alive after all (a late heartbeat), its client gets a
-- clear error at once instead of waiting for request_timeout_s. A dead frontend's stream
-- just expires.
local function notify_cancelled(r, why)
  notify(r, {'k', 'err', 'code', 'cancelled', 'msg', why})
end

-- A sample for outcomes decided inside Redis (expired, cancelled, failed by lease loss).
local function add_sample(p, r, outcome, now)
  local s = {v = 1, pool = p.name, class = r.class, tenant = r.tenant, outcome = outcome,
    request_id = r.id, worker = r.worker or '', input_tokens = r.input_tokens,
    output_tokens = r.out_tokens or 0, e2e_ms = now - r.enq_ms, ts_ms = now}
  if r.claimed_ms then s.queue_wait_ms = r.claimed_ms - r.enq_ms else s.queue_wait_ms = now - r.enq_ms end
  if r.first_ms then s.ttft_ms = r.first_ms - r.enq_ms end
  redis.call('XADD', K_SAMPLES, 'MAXLEN', '~', SAMPLES_MAXLEN, '*', 'd', msgpack_map(s))
end

-- Move a request to a terminal state: leave every index, refund, release counters, TTL.
local function finalize(p, r, state, reason, used, now)
  local key = P_REQUEST .. r.id
  if r.state == 'queued' then
    redis.call('ZREM', P_QUEUE .. r.class, r.id)
    redis.call('ZREM', K_DEADLINES, r.id)
  elseif r.state == 'leased' then
    redis.call('ZREM', K_LEASES, r.id)
    if redis.call('HINCRBY', K_INFLIGHT, r.class, -1) <= 0 then redis.call('HDEL', K_INFLIGHT, r.class) end
  end
  redis.call('SREM', K_CANCELS, r.id)
  if redis.call('HINCRBY', K_TENANT_INFLIGHT, r.tenant, -1) <= 0 then
    redis.call('HDEL', K_TENANT_INFLIGHT, r.tenant)
  end
  local refunded = refund_request(p, r, used, now)
  redis.call('HSET', key, 'state', state, 'reason', reason, 'finished_ms', now, 'refund', fmt(refunded))
  redis.call('EXPIRE', key, p.record_ttl_s)
  redis.call('EXPIRE', P_TOKENS .. r.id, p.record_ttl_s)
  redis.call('HINCRBY', K_STATS, r.class .. '.' .. state, 1)
  r.state = state
  return refunded
end

local function wake_workers()
  if redis.call('LPUSH', K_WAKE, '1') > 64 then redis.call('LTRIM', K_WAKE, 0, 63) end
end

-- Put a leased request back at the head of its class (it keeps its original sequence).
local function requeue(p, r, now)
  local c = p.class[r.class]
  local wait = (c and c.max_wait_ms) or 60000
  redis.call('ZREM', K_LEASES, r.id)
  if redis.call('HINCRBY', K_INFLIGHT, r.class, -1) <= 0 then redis.call('HDEL', K_INFLIGHT, r.class) end
  redis.call('ZADD', P_QUEUE .. r.class, r.seq, r.id)
  redis.call('ZADD', K_DEADLINES, now + wait, r.id)
  redis.call('HSET', P_REQUEST .. r.id, 'state', 'queued', 'worker', '', 'deadline_ms', now + wait)
  redis.call('HINCRBY', K_STATS, r.class .. '.requeued', 1)
  wake_workers()
end

-- A frontend is alive when it beat within frontend_ttl_ms. After a Redis outage every
-- heartbeat is as old as the outage, and the workers and frontends come back in any order;
-- a frontend still holding its clients must not be taken for dead meanwhile:
-- * while NO frontend has beaten within the TTL (Redis, or the frontends' network, was more
--   likely down than every frontend dead at once), a frontend that was alive when the last
--   beat landed counts as alive;
-- * the first frontend to beat again records when the frontends lost Redis (K_OUTAGE, for two
--   TTLs): until it expires, a frontend that was alive then counts as alive, so one that
--   reconnects a moment later than another is not cancelled for it.
local function frontend_alive(p, frontend, now)
  local seen = tonumber(redis.call('ZSCORE', K_FRONTENDS, frontend))
  if seen == nil then return false end
  local ttl = p.frontend_ttl_ms
  if seen >= now - ttl then return true end
  local lost = tonumber(redis.call('GET', K_OUTAGE))
  if lost ~= nil and seen >= lost - ttl then return true end
  local newest = tonumber(redis.call('ZRANGE', K_FRONTENDS, -1, -1, 'WITHSCORES')[2])
  return newest < now - ttl and seen >= newest - ttl
end

-- Queued requests past their max wait: removed, refunded in full, their client told.
local function expire_overdue(p, now, limit)
  local ids = redis.call('ZRANGEBYSCORE', K_DEADLINES, '-inf', now, 'LIMIT', 0, limit)
  local expired = 0
  for _, id in ipairs(ids) do
    local r = load_request(id)
    if r and r.state == 'queued' then
      local waited = now - r.enq_ms
      finalize(p, r, 'expired', 'max queue wait passed after ' .. waited .. ' ms', 0, now)
      notify(r, {'k', 'err', 'code', 'expired', 'msg', 'request waited ' .. waited .. ' ms in the ' .. r.class .. ' queue, past its max wait'})
      add_sample(p, r, 'expired', now)
      expired = expired + 1
    else
      redis.call('ZREM', K_DEADLINES, id)
    end
  end
  return expired
end

-- Leases past their deadline: the worker is presumed dead. Requeue, or fail after
-- max_attempts, or finish the cancellation the dead worker never acknowledged.
local function reap_leases(p, now, limit)
  local ids = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'LIMIT', 0, limit)
  local requeued, failed, cancelled = 0, 0, 0
  for _, id in ipairs(ids) do
    local r = load_request(id)
    if r == nil or r.state ~= 'leased' then
      redis.call('ZREM', K_LEASES, id)
    elseif r.cancel == 1 or not frontend_alive(p, r.frontend, now) then
      finalize(p, r, 'cancelled', 'client went away', actual_cost(r, r.input_tokens, r.out_tokens or 0), now)
      notify_cancelled(r, 'its lease expired and its client frontend went away')
      add_sample(p, r, 'cancelled', now)
      cancelled = cancelled + 1
    elseif r.attempts >= p.max_attempts then
      local why = 'worker lease expired on all ' .. r.attempts .. ' attempts'
      finalize(p, r, 'failed', why, actual_cost(r, r.input_tokens, r.out_tokens or 0), now)
      notify(r, {'k', 'err', 'code', 'failed', 'msg', why})
      add_sample(p, r, 'failed', now)
      failed = failed + 1
    else
      requeue(p, r, now)
      requeued = requeued + 1
    end
  end
  return requeued, failed, cancelled
end
