-- The queues: one FIFO per (class, tenant), and per class the backlogged tenants in the
-- order claim serves them.
--
--   queue:<class>:<tenant>  ZSET id -> seq           the tenant's requests, oldest first
--   backlog:<class>         ZSET tenant -> score     tenants with a queued request
--   queued                  HASH <class> -> count, <class>.cost -> reserved cost queued,
--                                 <class>:<tenant> -> that tenant's reserved cost queued
--
-- A fair class (the default) scores its backlogged tenants by virtual token counter
-- (include/vtc.lua). A class with fair = 0 serves in arrival order whoever sent the
-- request: the score is the seq of the tenant's oldest queued request.
--!include pool_keys.lua
--!include validate.lua
--!include policy.lua
--!include vtc.lua

local function tenant_queue(cls, tenant)
  return P_QUEUE .. cls .. ':' .. tenant
end

-- Put a request in its tenant's queue (at its original place: seq orders the queue).
-- `q`: the queued counts as queued_counts(p, cls, tenant) read them in this call, when the
-- caller has them; the three counters are then written in one HSET instead of three
-- increments.
local function enqueue(p, r, q)
  local cls, tenant = r.class, r.tenant
  local backlog = P_BACKLOG .. cls
  redis.call('ZADD', tenant_queue(cls, tenant), r.seq, r.id)
  local score = redis.call('ZSCORE', backlog, tenant)
  if p.class[cls].fair then
    if not score then
      local own = tonumber(redis.call('HGET', P_VTIME .. cls, tenant) or '0')
      redis.call('ZADD', backlog, math.max(own, virtual_time(cls)), tenant)
    end
  elseif not score or r.seq < tonumber(score) then
    redis.call('ZADD', backlog, r.seq, tenant)  -- arrival order: the tenant's oldest request
  end
  redis.call('ZADD', K_DEADLINES, r.deadline_ms, r.id)
  if q then
    redis.call('HSET', K_QUEUED, cls, q.n[cls] + 1, cls .. '.cost', fmt(q.cost[cls] + r.cost),
      cls .. ':' .. tenant, fmt(q.tenant_cost + r.cost))
    return
  end
  redis.call('HINCRBY', K_QUEUED, cls, 1)
  redis.call('HINCRBYFLOAT', K_QUEUED, cls .. '.cost', fmt(r.cost))
  redis.call('HINCRBYFLOAT', K_QUEUED, cls .. ':' .. tenant, fmt(r.cost))
end

-- Take a request out of its tenant's queue; a tenant whose queue empties goes idle.
local function dequeue(p, r)
  local cls, tenant = r.class, r.tenant
  local q, backlog = tenant_queue(cls, tenant), P_BACKLOG .. cls
  redis.call('ZREM', q, r.id)
  redis.call('ZREM', K_DEADLINES, r.id)
  local fair = class_fair(p, cls)  -- also for a class a deploy removed (its queue still drains)
  local head = redis.call('ZRANGE', q, 0, 0, 'WITHSCORES')
  if head[2] == nil then
    local s = redis.call('ZSCORE', backlog, tenant)
    if s then
      redis.call('ZREM', backlog, tenant)
      if fair then
        redis.call('HSET', P_VTIME .. cls, tenant, s)
        if redis.call('EXISTS', backlog) == 0 then redis.call('HSET', P_VTIME .. cls, ':last', s) end
      end
    end
    redis.call('HDEL', K_QUEUED, cls .. ':' .. tenant)
  else
    if not fair then redis.call('ZADD', backlog, head[2], tenant) end
    redis.call('HINCRBYFLOAT', K_QUEUED, cls .. ':' .. tenant, fmt(-(r.cost or 0)))
  end
  if redis.call('HINCRBY', K_QUEUED, cls, -1) <= 0 then
    redis.call('HSET', K_QUEUED, cls, 0, cls .. '.cost', 0)  -- no float residue on an empty class
  else
    redis.call('HINCRBYFLOAT', K_QUEUED, cls .. '.cost', fmt(-(r.cost or 0)))
  end
end

-- Queued counts and costs per class: {n = {cls = count}, cost = {cls = cost}}, and, given a
-- class and tenant, .tenant_cost: that tenant's queued cost in that class (the same HMGET).
local function queued_counts(p, cls, tenant)
  local want = {}
  for _, c in ipairs(p.classes) do
    want[#want + 1] = c
    want[#want + 1] = c .. '.cost'
  end
  if tenant then want[#want + 1] = cls .. ':' .. tenant end
  local v = redis.call('HMGET', K_QUEUED, unpack(want))
  local out = {n = {}, cost = {}}
  for i, c in ipairs(p.classes) do
    out.n[c] = tonumber(v[2 * i - 1]) or 0
    out.cost[c] = math.max(tonumber(v[2 * i]) or 0, 0)
  end
  if tenant then out.tenant_cost = math.max(tonumber(v[#want]) or 0, 0) end
  return out
end
