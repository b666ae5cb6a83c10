-- Reads the pool policy hash (written by init_pool and set_rates).
-- Needs fail() from validate.lua.

local POOL_FIELDS = {'pool', 'classes', 'capacity', 'pool_burst', 'lease_ms', 'max_attempts',
  'frontend_ttl_ms', 'floor_half_life_ms', 'record_ttl_s', 'floor_quantum'}
local CLASS_FIELDS = {'rate', 'burst', 'ceil', 'ceil_burst', 'weight', 'out_weight',
  'queue_cap', 'max_wait_ms', 'floor'}

local function split_classes(s)
  local out = {}
  for c in string.gmatch(s, '[^,]+') do out[#out + 1] = c end
  return out
end

-- Returns pool table with .classes (ordered list), .index[cls] and .class[cls] tables.
local function load_policy(policy_key)
  local vals = redis.call('HMGET', policy_key, unpack(POOL_FIELDS))
  if not vals[2] then
    fail('NOPOLICY', 'pool policy ' .. policy_key .. ' is not initialised')
  end
  local p = {name = vals[1], classes = split_classes(vals[2]), index = {}, class = {}}
  for i = 3, #POOL_FIELDS do p[POOL_FIELDS[i]] = tonumber(vals[i]) end
  local want = {}
  for _, c in ipairs(p.classes) do
    for _, f in ipairs(CLASS_FIELDS) do want[#want + 1] = c .. '.' .. f end
  end
  local cv = redis.call('HMGET', policy_key, unpack(want))
  local j = 1
  for i, c in ipairs(p.classes) do
    p.index[c] = i
    local t = {}
    for _, f in ipairs(CLASS_FIELDS) do
      t[f] = tonumber(cv[j])
      j = j + 1
    end
    p.class[c] = t
  end
  return p
end

-- The admission hot path reads only what one class needs: one HMGET instead of the
-- whole policy. `reserve` (the bursts of all higher classes) is precomputed on write.
local ADMIT_FIELDS = {'rate', 'burst', 'ceil', 'ceil_burst', 'weight', 'out_weight', 'queue_cap',
  'max_wait_ms', 'reserve'}

local function load_class_policy(policy_key, cls)
  local want = {'capacity', 'pool_burst'}
  for _, f in ipairs(ADMIT_FIELDS) do want[#want + 1] = cls .. '.' .. f end
  local v = redis.call('HMGET', policy_key, unpack(want))
  if not v[1] then fail('NOPOLICY', 'pool policy ' .. policy_key .. ' is not initialised') end
  if not v[3] then fail('BADARG', 'class: unknown class ' .. cls) end
  local c = {capacity = tonumber(v[1]), pool_burst = tonumber(v[2])}
  for i, f in ipairs(ADMIT_FIELDS) do c[f] = tonumber(v[i + 2]) end
  return c
end

-- Write <class>.reserve = sum of the bursts of all higher classes (after bursts change).
local function store_reserves(policy_key, classes)
  local bursts = redis.call('HMGET', policy_key, unpack((function()
    local t = {}
    for i, c in ipairs(classes) do t[i] = c .. '.burst' end
    return t
  end)()))
  local acc, fields = 0, {}
  for i, c in ipairs(classes) do
    fields[#fields + 1] = c .. '.reserve'
    fields[#fields + 1] = fmt(acc)
    acc = acc + (tonumber(bursts[i]) or 0)
  end
  redis.call('HSET', policy_key, unpack(fields))
end

local function policy_class(p, cls)
  local c = p.class[cls]
  if c == nil then
    fail('BADARG', 'class: unknown class ' .. tostring(cls) .. ' (pool has ' .. table.concat(p.classes, ',') .. ')')
  end
  return c
end
