-- Terminal transitions of a request: refund, notify its frontend, sample, release counters.
--!include pool_keys.lua
--!include validate.lua
--!include policy.lua
--!include bucket.lua
--!include msgpack.lua
--!include record.lua
--!include queue.lua

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

-- Give back what was reserved but not used. Each bucket (and the tenant's virtual counter)
-- gets at most what it was really charged for this request; the amounts given back are
-- recorded next to the charges (r_tenant <= c_tenant, ...).
local function refund_request(p, r, used, now)
  local unused = math.max(r.cost - used, 0)
  local given = {refund = unused}
  given.r_tenant = bucket_credit(bucket_get(P_BUCKET .. 'tenant:' .. r.tenant, r.t_rate, r.t_burst, now),
    math.min(unused, r.c_tenant))
  local c = p.class[r.class]
  given.r_class, given.r_ceil = 0, 0
  if c then
    if r.c_class > 0 then
      given.r_class = bucket_credit(bucket_get(P_BUCKET .. 'class:' .. r.class, c.rate, c.burst, now),
        math.min(unused, r.c_class))
    end
    if r.c_ceil > 0 then
      given.r_ceil = bucket_credit(bucket_get(P_BUCKET .. 'ceil:' .. r.class, c.ceil, c.ceil_burst, now),
        math.min(unused, r.c_ceil))
    end
  end
  given.r_vtc = 0
  if r.c_vtc > 0 then
    given.r_vtc = vtc_refund(r.class, r.tenant, math.min(unused / r.t_weight, r.c_vtc))
  end
  return given
end

-- Move a request to a terminal state: leave every index, refund, release counters, TTL.
local function finalize(p, r, state, reason, used, now)
  local key = P_REQUEST .. r.id
  if r.state == 'queued' then
    dequeue(p, r)
  elseif r.state == 'leased' then
    redis.call('ZREM', K_LEASES, r.id)
    if redis.call('HINCRBY', K_INFLIGHT, r.class, -1) <= 0 then redis.call('HDEL', K_INFLIGHT, r.class) end
  end
  redis.call('SREM', K_CANCELS, r.id)
  if redis.call('HINCRBY', K_TENANT_INFLIGHT, r.tenant, -1) <= 0 then
    redis.call('HDEL', K_TENANT_INFLIGHT, r.tenant)
  end
  local g = refund_request(p, r, used, now)
  -- refund: what the request did not use of its reservation (its reconciled charge is
  -- cost - refund); r_*: what each bucket and the tenant's counter really got back
  redis.call('HSET', key, 'state', state, 'reason', reason, 'finished_ms', now, 'refund', fmt(g.refund),
    'r_tenant', fmt(g.r_tenant), 'r_class', fmt(g.r_class), 'r_ceil', fmt(g.r_ceil), 'r_vtc', fmt(g.r_vtc))
  redis.call('EXPIRE', key, p.record_ttl_s)
  redis.call('EXPIRE', P_TOKENS .. r.id, p.record_ttl_s)
  redis.call('HINCRBY', K_STATS, r.class .. '.' .. state, 1)
  r.state = state
  return g
end

local function wake_workers()
  if redis.call('LPUSH', K_WAKE, '1') > 64 then redis.call('LTRIM', K_WAKE, 0, 63) end
end
