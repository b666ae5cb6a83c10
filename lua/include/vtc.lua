-- Virtual token counters (VTC, Sheng et al., OSDI'24): how a fair class orders its
-- tenants. A backlogged tenant's counter is its score in backlog:<class>; an idle one's is
-- kept in vtime:<class> (HASH tenant -> counter; field ':last' = the counter of the last
-- tenant to go idle). Counters are in weighted tokens divided by the tenant's weight.
--
-- A claim takes the backlogged tenant with the smallest counter and adds the request's
-- reserved cost to it; the request's end gives back what it did not use. The class's
-- virtual time is the smallest backlogged counter (or ':last' when none): a tenant that
-- becomes backlogged is lifted to it (include/queue.lua enqueue), so idle time banks no
-- credit, and a refund never takes a counter below it. Together these keep the counters of
-- backlogged tenants within one request's cost of each other, except by what a claim that
-- passed a tenant over (its request too large for that worker, or the tenant avoided by a
-- full worker's look-ahead) charged the tenant it served instead: service really received,
-- evened out by later picks (docs/scheduling.md; tests/test_scheduler_model.py checks it
-- after every step).
--!include pool_keys.lua
--!include validate.lua

-- The class's virtual time: the smallest backlogged counter, else the last one to go idle.
local function virtual_time(cls)
  local head = redis.call('ZRANGE', P_BACKLOG .. cls, 0, 0, 'WITHSCORES')
  if head[2] then return tonumber(head[2]) end
  return tonumber(redis.call('HGET', P_VTIME .. cls, ':last') or '0')
end

-- A tenant's counter, and whether it is backlogged.
local function vtc_get(cls, tenant)
  local s = redis.call('ZSCORE', P_BACKLOG .. cls, tenant)
  if s then return tonumber(s), true end
  return tonumber(redis.call('HGET', P_VTIME .. cls, tenant) or '0'), false
end

local function vtc_set(cls, tenant, value, backlogged)
  if backlogged then
    redis.call('ZADD', P_BACKLOG .. cls, value, tenant)
  else
    redis.call('HSET', P_VTIME .. cls, tenant, fmt(value))
  end
end

-- Charge a tenant's counter; returns the amount charged. One command for a backlogged tenant
-- (its score moved in place: ZADD XX INCR answers nil for a tenant that is not in the backlog).
local function vtc_charge(cls, tenant, amount)
  if not redis.call('ZADD', P_BACKLOG .. cls, 'XX', 'INCR', amount, tenant) then
    redis.call('HINCRBYFLOAT', P_VTIME .. cls, tenant, fmt(amount))
  end
  return amount
end

-- Give back up to `amount`, never below the class's virtual time; returns what was given.
local function vtc_refund(cls, tenant, amount)
  if amount <= 0 then return 0 end
  local v, backlogged = vtc_get(cls, tenant)
  local new = math.max(v - amount, math.min(v, virtual_time(cls)))
  vtc_set(cls, tenant, new, backlogged)
  return v - new
end
