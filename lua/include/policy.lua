-- Reads the pool policy hash (written by init_pool and set_rates).
--!include validate.lua

local POOL_NUMERIC = {'capacity', 'lease_ms', 'max_attempts', 'frontend_ttl_ms', 'floor_half_life_ms',
  'record_ttl_s', 'floor_quantum'}
local CLASS_FIELDS = {'rate', 'burst', 'ceil', 'ceil_burst', 'weight', 'out_weight',
  'queue_cap', 'max_wait_ms', 'floor', 'fair'}

local function split_classes(s)
  local out = {}
  for c in string.gmatch(s, '[^,]+') do out[#out + 1] = c end
  return out
end

-- Fill p.class[cls] (a table of CLASS_FIELDS) for each of `names` that is a class of the
-- pool (one HMGET); other names are left out, as absent from the policy.
local function load_classes(p, names)
  local want, got = {}, {}
  for _, c in ipairs(names) do
    if p.index[c] and not rawget(p.class, c) then
      got[#got + 1] = c
      for _, f in ipairs(CLASS_FIELDS) do want[#want + 1] = c .. '.' .. f end
    end
  end
  if #got == 0 then return p end
  local cv = redis.call('HMGET', p.key, unpack(want))
  local j = 1
  for _, c in ipairs(got) do
    local t = {}
    for _, f in ipairs(CLASS_FIELDS) do
      t[f] = tonumber(cv[j])
      j = j + 1
    end
    t.fair = t.fair ~= 0  -- absent (a policy from before the field) = fair
    p.class[c] = t
  end
  return p
end

-- The pool-level fields only (one HMGET): the pool table with .name, .classes (ordered
-- list, highest priority first), .index[cls] (1 = highest), an empty .class, and the
-- numeric fields `numeric` (default: all of POOL_NUMERIC; a hot script names the few it
-- uses, as every field read costs Redis time). A class's fields are read the first time
-- p.class[cls] is looked at (one HMGET for that class), or beforehand, several classes in
-- one HMGET, with load_classes.
local function load_pool(policy_key, numeric)
  local vals = redis.call('HMGET', policy_key, 'pool', 'classes', unpack(numeric or POOL_NUMERIC))
  if not vals[2] then
    fail('NOPOLICY', 'pool policy ' .. policy_key .. ' is not initialised')
  end
  local p = {key = policy_key, name = vals[1], classes = split_classes(vals[2]), index = {}, class = {}}
  for i, f in ipairs(numeric or POOL_NUMERIC) do p[f] = tonumber(vals[i + 2]) end
  for i, c in ipairs(p.classes) do p.index[c] = i end
  setmetatable(p.class, {__index = function(t, c) return rawget(load_classes(p, {c}).class, c) end})
  return p
end

-- The whole policy: the pool and every class.
local function load_policy(policy_key)
  local p = load_pool(policy_key)
  return load_classes(p, p.classes)
end

local function policy_class(p, cls)
  local c = p.class[cls]
  if c == nil then
    fail('BADARG', 'class: unknown class ' .. tostring(cls) .. ' (pool has ' .. table.concat(p.classes, ',') .. ')')
  end
  return c
end

-- Whether a class's tenants are ordered by virtual token counter (fair) or by their oldest
-- request's seq (arrival order). A class a deploy removed from the policy still has queued
-- requests that expire or are cancelled, and its backlog must keep the order it had:
-- init_pool leaves a removed class's fields in place, so its flag is read from there.
local function class_fair(p, cls)
  local c = p.class[cls]
  if c then return c.fair end
  return tonumber(redis.call('HGET', p.key, cls .. '.fair') or '1') ~= 0
end

-- A class's ceiling binds only below the pool's capacity: a ceiling at (or above) capacity
-- means "every idle slot", so an estimate of capacity that runs low never idles a GPU.
local function ceiling_binds(p, c)
  return c.ceil < p.capacity
end
