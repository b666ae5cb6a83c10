-- claim: a worker takes up to N queued requests, highest class first, FIFO within a
-- class, with starvation floors; each claimed request gets a lease owned by the worker.
-- Before choosing it expires overdue queued requests and requeues expired leases, so
-- nothing past its max wait is ever handed out.
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; PoolKeys.lifecycle_keys()).
-- ARGV[1] worker_id      name
-- ARGV[2] max_requests   integer 1..1024
-- ARGV[3] token_budget   integer >= 0: the worker's free KV room in tokens; a request
--                        needs input_tokens + max_tokens. 0 = no token limit.
-- ARGV[4] lease_ms       integer >= 0, 0 = the pool's lease_ms
-- ARGV[5] above_class    optional class name: only classes ranked strictly above it are
--                        claimed (a full worker's look-ahead for work that would preempt
--                        what it holds); '' or absent = every class
--
-- Floors: served cost per class decays with half-life floor_half_life_ms; a backlogged
-- class whose served cost is below floor x the decayed total by more than floor_quantum
-- is served first (largest deficit first), otherwise the highest backlogged class is.
--
-- Returns {now_ms, {entry}, ...}; entry = {id, class, tenant, attempt, payload, enq_ms,
--   input_tokens, max_tokens, frontend, out_tokens, generated_token_blob, claimed_ms,
--   first_ms (0 until a first token was delivered)}; times are Redis server ms.
-- Errors: 'BADARG <field>: ...', 'NOPOLICY ...'.

--!include validate.lua
--!include policy.lua
--!include bucket.lua
--!include pool_keys.lua
--!include msgpack.lua
--!include request.lua

local function main()
  local worker_id = arg_name(ARGV[1], 'worker_id')
  local max_requests = arg_int(ARGV[2], 'max_requests', 1, 1024)
  local token_budget = arg_int(ARGV[3], 'token_budget', 0, 1e12)
  local lease_ms = arg_int(ARGV[4], 'lease_ms', 0, 3600000)
  local above_class = ARGV[5] or ''
  if above_class ~= '' then above_class = arg_name(above_class, 'above_class') end
  local p = load_policy(K_POLICY)
  if lease_ms == 0 then lease_ms = p.lease_ms end
  -- classes this claim may hand out: all, or those ranked above above_class
  local eligible = {}
  if above_class == '' then
    for _, cls in ipairs(p.classes) do eligible[cls] = true end
  else
    local known = false
    for _, cls in ipairs(p.classes) do
      if cls == above_class then known = true break end
      eligible[cls] = true
    end
    if not known then fail('BADARG', 'above_class: unknown class ' .. above_class) end
  end
  local now = now_ms()

  expire_overdue(p, now, 100)
  reap_leases(p, now, 100)

  -- Decay the served ledger to now.
  local sv = redis.call('HGETALL', K_SERVED)
  local served, ts = {}, now
  for i = 1, #sv, 2 do
    if sv[i] == 'ts' then ts = tonumber(sv[i + 1]) else served[sv[i]] = tonumber(sv[i + 1]) end
  end
  local decay = 0.5 ^ (math.max(now - ts, 0) / p.floor_half_life_ms)
  local total = 0
  for _, cls in ipairs(p.classes) do
    served[cls] = (served[cls] or 0) * decay
    total = total + served[cls]
  end

  local backlog = {}
  for _, cls in ipairs(p.classes) do backlog[cls] = redis.call('ZCARD', P_QUEUE .. cls) end

  -- A class must be short by more than one quantum before its floor overrides priority,
  -- so light traffic sees strict priority and floors act only on a real backlog.
  local quantum = p.floor_quantum or 0
  local out = {now}
  local budget = token_budget
  local guard = 0
  while #out - 1 < max_requests and guard < 10000 do
    guard = guard + 1
    local pick, best = nil, 0
    for _, cls in ipairs(p.classes) do
      local floor = p.class[cls].floor or 0
      if eligible[cls] and backlog[cls] > 0 and floor > 0 then
        local deficit = floor * total - served[cls]
        if deficit > quantum and deficit > best then pick, best = cls, deficit end
      end
    end
    if pick == nil then
      for _, cls in ipairs(p.classes) do
        if eligible[cls] and backlog[cls] > 0 then pick = cls break end
      end
    end
    if pick == nil then break end

    local id = redis.call('ZRANGE', P_QUEUE .. pick, 0, 0)[1]
    local r = load_request(id)
    if r == nil or r.state ~= 'queued' then
      redis.call('ZREM', P_QUEUE .. pick, id)
      redis.call('ZREM', K_DEADLINES, id)
      backlog[pick] = backlog[pick] - 1
    elseif r.deadline_ms <= now then
      local waited = now - r.enq_ms
      finalize(p, r, 'expired', 'max queue wait passed after ' .. waited .. ' ms', 0, now)
      notify(r, {'k', 'err', 'code', 'expired', 'msg', 'request waited ' .. waited .. ' ms in the ' .. pick .. ' queue, past its max wait'})
      add_sample(p, r, 'expired', now)
      backlog[pick] = backlog[pick] - 1
    elseif not frontend_alive(p, r.frontend, now) then
      finalize(p, r, 'cancelled', 'client frontend went away', 0, now)
      notify_cancelled(r, 'its client frontend stopped heartbeating before a worker took it')
      add_sample(p, r, 'cancelled', now)
      backlog[pick] = backlog[pick] - 1
    else
      local need = r.input_tokens + r.max_tokens
      if token_budget > 0 and need > budget then break end
      budget = budget - need
      redis.call('ZREM', P_QUEUE .. pick, id)
      redis.call('ZREM', K_DEADLINES, id)
      backlog[pick] = backlog[pick] - 1
      local attempt = r.attempts + 1
      local key = P_REQUEST .. id
      redis.call('HSET', key, 'state', 'leased', 'worker', worker_id, 'attempts', attempt,
        'lease_ms', now + lease_ms)
      if r.claimed_ms == nil then
        redis.call('HSET', key, 'claimed_ms', now)
        r.claimed_ms = now
      end
      redis.call('ZADD', K_LEASES, now + lease_ms, id)
      redis.call('HINCRBY', K_INFLIGHT, pick, 1)
      redis.call('HINCRBY', K_STATS, pick .. '.claimed', 1)
      served[pick] = served[pick] + r.cost
      total = total + r.cost
      local payload = redis.call('HGET', key, 'payload')
      local gen = redis.call('GET', P_TOKENS .. id) or ''
      out[#out + 1] = {id, pick, r.tenant, attempt, payload, r.enq_ms, r.input_tokens,
        r.max_tokens, r.frontend, r.out_tokens or 0, gen, r.claimed_ms, r.first_ms or 0}
    end
  end

  local fields = {'ts', now}
  for _, cls in ipairs(p.classes) do
    fields[#fields + 1] = cls
    fields[#fields + 1] = fmt(served[cls])
  end
  redis.call('HSET', K_SERVED, unpack(fields))
  for _, cls in ipairs(p.classes) do
    if backlog[cls] > 0 then wake_workers() break end
  end
  return out
end

--!include main.lua
