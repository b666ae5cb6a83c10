-- Reads the pool policy hash (written by init_pool and set_rates).
--!include validate.lua

local POOL_FIELDS = {'pool', 'classes', 'capacity', 'lease_ms', 'max_attempts', 'frontend_ttl_ms',
  'floor_half_life_ms', 'record_ttl_s', 'floor_quantum'}
local CLASS_FIELDS = {'rate', 'burst', 'ceil', 'ceil_burst', 'weight', 'out_weight',
  'queue_cap', 'max_wait_ms', 'floor', 'fair'}

local function split_classes(s)
  local out = {}
  for c in string.gmatch(s, '[^,]+') do out[#out + 1] = c end
  return out
end

-- Returns the pool table with .classes (ordered list, highest priority first), .index[cls]
-- (1 = highest) and .class[cls] tables.
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
    t.fair = t.fair ~= 0  -- absent (a policy from before the field) = fair
    p.class[c] = t
  end
  return p
end

local function policy_class(p, cls)
  local c = p.class[cls]
  if c == nil then
    fail('BADARG', 'class: unknown class ' .. tostring(cls) .. ' (pool has ' .. table.concat(p.classes, ',') .. ')')
  end
  return c
end

-- A class's ceiling binds only below the pool's capacity: a ceiling at (or above) capacity
-- means "every idle slot", so an estimate of capacity that runs low never idles a GPU.
local function ceiling_binds(p, c)
  return c.ceil < p.capacity
end
