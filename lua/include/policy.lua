-- Reads the pool policy hash (written by init_pool and set_rates).
--
-- The hash holds one field per value (pool, classes, version, capacity, <class>.rate, ...):
-- what operators and the Python roles read. The same two scripts, after every write, also
-- store all of it in one field, PACKED_FIELD: a msgpack copy stamped with the policy version
-- it was built at. Every script reads that copy (one field, one C call to unpack) instead of
-- some forty fields (issue 17: the policy read was ~16 us of a script's Redis time, ~4 us
-- packed). A copy that is missing, or whose version is not the hash's (a set_rates of an
-- older release during a rolling deploy bumps the version but does not repack), is ignored
-- and the fields are read. An older release's init_pool (a role of the previous release
-- starting during a rolling deploy) rewrites the static fields without repacking or a new
-- version: with a configuration that changed them, the scripts keep the static values of
-- the last packing until a role of this release runs init_pool (every role does at start)
-- or the controller's next set_rates. A server without cmsgpack (the embedded fakeredis of
-- `qos up`) keeps no packed copy: there every script reads the fields.

--!include validate.lua

local POOL_NUMERIC = {'capacity', 'lease_ms', 'max_attempts', 'frontend_ttl_ms', 'floor_half_life_ms',
  'record_ttl_s', 'floor_quantum', 'ceil_ahead'}
local CLASS_FIELDS = {'rate', 'burst', 'ceil', 'ceil_burst', 'weight', 'out_weight',
  'queue_cap', 'max_wait_ms', 'floor', 'fair'}
local PACKED_FIELD = '~packed'  -- limiter/keys.py PACKED_POLICY_FIELD

local function split_classes(s)
  local out = {}
  for c in string.gmatch(s, '[^,]+') do out[#out + 1] = c end
  return out
end

-- The error of every script that finds no policy (init_pool never ran, or Redis lost it):
-- the roles map it to PolicyMissing and write the policy again.
local function fail_no_policy(policy_key)
  fail('NOPOLICY', 'pool policy ' .. policy_key .. ' is not initialised')
end

-- The policy from its fields: the pool table with .name, .version, .classes (ordered list,
-- highest priority first), .index[cls] (1 = highest), the numeric POOL_NUMERIC fields, and
-- .class[cls], a table of CLASS_FIELDS (.fair a boolean; absent, as in a policy from before
-- the field, = fair).
local function read_policy_fields(policy_key)
  local vals = redis.call('HMGET', policy_key, 'pool', 'classes', 'version', unpack(POOL_NUMERIC))
  if not vals[2] then fail_no_policy(policy_key) end
  local p = {name = vals[1], classes = split_classes(vals[2]), version = tonumber(vals[3]) or 0,
    index = {}, class = {}}
  for i, f in ipairs(POOL_NUMERIC) do p[f] = tonumber(vals[i + 3]) end
  local want = {}
  for i, c in ipairs(p.classes) do
    p.index[c] = i
    for _, f in ipairs(CLASS_FIELDS) do want[#want + 1] = c .. '.' .. f end
  end
  local cv = redis.call('HMGET', policy_key, unpack(want))
  local j = 1
  for _, c in ipairs(p.classes) do
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

-- Rebuild the packed copy from the fields. init_pool and set_rates call it after their
-- last write, so the copy is always the fields as the script left them.
local function pack_policy(policy_key)
  if not cmsgpack then return end
  redis.call('HSET', policy_key, PACKED_FIELD, cmsgpack.pack(read_policy_fields(policy_key)))
end

-- The whole policy (see read_policy_fields), with .key = policy_key: the packed copy where it
-- is current, else the fields.
local function load_policy(policy_key)
  local v = redis.call('HMGET', policy_key, PACKED_FIELD, 'version')
  local p
  if v[1] and cmsgpack then
    p = cmsgpack.unpack(v[1])
    if p.version ~= tonumber(v[2]) then p = nil end
  end
  p = p or read_policy_fields(policy_key)
  p.key = policy_key
  return p
end

-- A few pool fields only, for the scripts that need nothing else (push_tokens, renew_leases):
-- {key = policy_key, classes = 'P0,P1,...', <f> = number for f in names}, from one HMGET of
-- those fields (cheaper there than unpacking the whole policy).
local function load_pool_fields(policy_key, names)
  local vals = redis.call('HMGET', policy_key, 'classes', unpack(names))
  if not vals[1] then fail_no_policy(policy_key) end
  local p = {key = policy_key, classes = vals[1]}
  for i, f in ipairs(names) do p[f] = tonumber(vals[i + 1]) end
  return p
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
