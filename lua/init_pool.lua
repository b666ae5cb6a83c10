-- init_pool: write a pool's policy from the configuration. Static fields (class order,
-- weights, caps, max waits, floors, lease and retry settings) are always overwritten;
-- the controller-owned fields (rate, burst, ceil, ceil_burst per class; capacity) are
-- only set where absent, unless mode is reset_rates. A removed class's fields are left in
-- place (its queued requests still drain, in the order its flag `fair` gave them). Last,
-- the packed copy every script reads (PACKED_FIELD, include/policy.lua) is rebuilt from
-- the fields.
--
-- A class whose `fair` flag changes has its backlog rescored in the same call (its scores
-- meant the other thing: virtual token counters in a fair class, the seq of each tenant's
-- oldest request in an arrival-order one), in bounded work: every backlogged tenant is set to
-- 0 by one command (ZUNIONSTORE ... WEIGHTS 0) and the idle tenants' counters (vtime) are
-- dropped. A class turned fair starts its counters there, all equal. A class turned to
-- arrival order then gives at most RESCORE_LIMIT tenants the seq of their oldest request;
-- any past that keep 0 and so go first (their requests are older than any admitted after
-- the switch) until each is next taken from.
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; limiter/scripts.py lifecycle_keys);
--       KEYS[1] is the policy HASH qos:{pool}:policy, written here.
-- ARGV[1] policy   JSON: {pool, capacity, lease_ms, max_attempts,
--                  frontend_ttl_ms, floor_half_life_ms, record_ttl_s, floor_quantum,
--                  ceil_ahead (output tokens a request is charged ahead at a binding
--                  ceiling, include/ceiling.lua),
--                  classes: [{name, rate, burst, ceil, ceil_burst, weight, out_weight,
--                  queue_cap, max_wait_ms, floor, fair (1: tenants by virtual token
--                  counter, 0: arrival order; default 1)}, ...] highest priority first}
--                  rates in weighted tokens/s, bursts in weighted tokens, times in ms
-- ARGV[2] mode     keep_rates | reset_rates
--
-- Returns the policy version. Errors: 'BADARG <field>: ...'.

--!include pool_keys.lua
--!include validate.lua
--!include policy.lua
--!include queue.lua

local RESCORE_LIMIT = 256

-- Rescore the backlog of a class whose fair flag changed to `fair` (see the header).
local function rescore(cls, fair)
  local backlog = P_BACKLOG .. cls
  redis.call('DEL', P_VTIME .. cls)
  if redis.call('EXISTS', backlog) == 0 then return end
  redis.call('ZUNIONSTORE', backlog, 1, backlog, 'WEIGHTS', 0)
  if fair then return end
  for _, tenant in ipairs(redis.call('ZRANGE', backlog, 0, RESCORE_LIMIT - 1)) do
    local head = redis.call('ZRANGE', tenant_queue(cls, tenant), 0, 0, 'WITHSCORES')
    if head[2] then redis.call('ZADD', backlog, head[2], tenant) end
  end
end

local function main()
  local ok, doc = pcall(cjson.decode, ARGV[1] or '')
  if not ok or type(doc) ~= 'table' then fail('BADARG', 'policy: not a JSON object') end
  local mode = arg_oneof(ARGV[2], 'mode', {'keep_rates', 'reset_rates'})
  local pool = arg_name(doc.pool, 'policy.pool')
  local static = {'pool', pool}
  local rates = {}
  local function put(t, f, v) t[#t + 1] = f; t[#t + 1] = fmt(v) end
  put(rates, 'capacity', arg_num(doc.capacity, 'policy.capacity', 0, 1e12))
  put(static, 'lease_ms', arg_int(doc.lease_ms, 'policy.lease_ms', 100, 3600000))
  put(static, 'max_attempts', arg_int(doc.max_attempts, 'policy.max_attempts', 1, 100))
  put(static, 'frontend_ttl_ms', arg_int(doc.frontend_ttl_ms, 'policy.frontend_ttl_ms', 100, 3600000))
  put(static, 'floor_half_life_ms', arg_int(doc.floor_half_life_ms, 'policy.floor_half_life_ms', 1, 86400000))
  put(static, 'record_ttl_s', arg_int(doc.record_ttl_s, 'policy.record_ttl_s', 1, 604800))
  put(static, 'floor_quantum', arg_num(doc.floor_quantum, 'policy.floor_quantum', 0, 1e12))
  put(static, 'ceil_ahead', arg_int(doc.ceil_ahead, 'policy.ceil_ahead', 0, 10000000))
  if type(doc.classes) ~= 'table' or #doc.classes < 1 or #doc.classes > 16 then
    fail('BADARG', 'policy.classes: 1 to 16 classes expected')
  end
  local names, fair, floors = {}, {}, 0
  for i, c in ipairs(doc.classes) do
    local f = 'policy.classes[' .. i .. ']'
    if type(c) ~= 'table' then fail('BADARG', f .. ': not an object') end
    local n = arg_class_name(c.name, f .. '.name')
    for _, seen in ipairs(names) do
      if seen == n then fail('BADARG', f .. '.name: duplicate class ' .. n) end
    end
    names[#names + 1] = n
    local rate = arg_num(c.rate, f .. '.rate', 0, 1e12)
    local ceil = arg_num(c.ceil, f .. '.ceil', 0, 1e12)
    if ceil < rate then fail('BADARG', f .. '.ceil: below rate') end
    put(rates, n .. '.rate', rate)
    put(rates, n .. '.burst', arg_num(c.burst, f .. '.burst', 0, 1e15))
    put(rates, n .. '.ceil', ceil)
    put(rates, n .. '.ceil_burst', arg_num(c.ceil_burst, f .. '.ceil_burst', 0, 1e15))
    put(static, n .. '.weight', arg_num(c.weight, f .. '.weight', 0, 1e6))
    put(static, n .. '.out_weight', arg_num(c.out_weight, f .. '.out_weight', 0, 1e6))
    put(static, n .. '.queue_cap', arg_int(c.queue_cap, f .. '.queue_cap', 0, 100000000))
    put(static, n .. '.max_wait_ms', arg_int(c.max_wait_ms, f .. '.max_wait_ms', 1, 86400000))
    fair[i] = c.fair == nil and 1 or arg_int(c.fair, f .. '.fair', 0, 1)
    put(static, n .. '.fair', fair[i])
    local floor = arg_num(c.floor, f .. '.floor', 0, 1)
    floors = floors + floor
    put(static, n .. '.floor', floor)
  end
  -- the config's own tolerance (limiter/config.py): 0.56 + 0.34 + 0.10 is 1.0000000000000002
  if floors > 1 + 1e-9 then fail('BADARG', 'policy.classes: floors add up to more than 1') end
  static[#static + 1] = 'classes'
  static[#static + 1] = table.concat(names, ',')

  local fair_fields = {}
  for i, n in ipairs(names) do fair_fields[i] = n .. '.fair' end
  local was = redis.call('HMGET', K_POLICY, unpack(fair_fields))  -- absent: fair (as policy.lua)
  redis.call('HSET', K_POLICY, unpack(static))
  for i, n in ipairs(names) do
    if (tonumber(was[i] or '1') ~= 0) ~= (fair[i] == 1) then rescore(n, fair[i] == 1) end
  end
  if mode == 'reset_rates' then
    redis.call('HSET', K_POLICY, unpack(rates))
  else
    for i = 1, #rates, 2 do redis.call('HSETNX', K_POLICY, rates[i], rates[i + 1]) end
  end
  redis.call('HSETNX', K_POLICY, 'version', 0)
  pack_policy(K_POLICY)  -- last: the packed copy is the fields as this call left them
  return tonumber(redis.call('HGET', K_POLICY, 'version'))
end

--!include main.lua
