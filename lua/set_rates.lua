-- set_rates: the controller's write of new rates, applied atomically, versioned, and
-- recorded in the decision history stream. Fenced: only the current leader, holding
-- the fencing token it was given, may write. Last, the packed copy every script reads
-- (PACKED_FIELD, include/policy.lua) is rebuilt from the fields.
--
-- KEYS[1] policy      HASH qos:{pool}:policy
-- KEYS[2] leader      STRING qos:{pool}:leader = "<owner>:<fence>" (owner: the controller id
--                     and a per-process suffix, limiter/controller/leader.py)
-- KEYS[3] decisions   STREAM qos:{pool}:decisions
-- ARGV[1] owner          name (the lease owner, as acquire_leader took it)
-- ARGV[2] fence          integer >= 1
-- ARGV[3] decision       JSON text describing the inputs and reasons (<= 64 KiB)
-- ARGV[4..] field, value pairs: <class>.rate|burst|ceil|ceil_burst, or capacity; values
--            are numbers >= 0 (weighted tokens/s, weighted tokens)
--
-- Returns the new policy version. Errors: 'STALE ...' (not the leader with this fence),
-- 'BADARG ...', 'NOPOLICY ...'.

--!include validate.lua
--!include policy.lua

local K_POLICY = KEYS[1]
local K_LEADER = KEYS[2]
local K_DECISIONS = KEYS[3]

local function main()
  local controller_id = arg_name(ARGV[1], 'controller_id')
  local fence = arg_int(ARGV[2], 'fence', 1, 1e15)
  local decision = ARGV[3]
  if decision == nil or #decision > 65536 then fail('BADARG', 'decision: missing or over 64 KiB') end
  if #ARGV < 5 or (#ARGV - 3) % 2 ~= 0 then fail('BADARG', 'fields: expected field/value pairs') end
  local p = load_policy(K_POLICY)
  local writes = {}
  for i = 4, #ARGV, 2 do
    local f = ARGV[i]
    local cls, what = string.match(f, '^([%w_%.%-]+)%.(%a[%a_]*)$')
    local okf = f == 'capacity'
    if cls and p.class[cls] and (what == 'rate' or what == 'burst' or what == 'ceil' or what == 'ceil_burst') then
      okf = true
    end
    if not okf then fail('BADARG', 'field: not a rate field: ' .. tostring(f)) end
    writes[#writes + 1] = f
    writes[#writes + 1] = fmt(arg_num(ARGV[i + 1], f, 0, 1e15))
  end
  local holder = redis.call('GET', K_LEADER)
  if holder ~= controller_id .. ':' .. fence then
    fail('STALE', 'controller ' .. controller_id .. ' with fence ' .. fence .. ' is not the leader (leader: ' .. tostring(holder) .. ')')
  end
  local now = now_ms()
  redis.call('HSET', K_POLICY, unpack(writes))
  -- A ceiling below the rate would make borrowing meaningless; keep ceil >= rate.
  for _, cls in ipairs(p.classes) do
    local v = redis.call('HMGET', K_POLICY, cls .. '.rate', cls .. '.ceil')
    if tonumber(v[2]) < tonumber(v[1]) then redis.call('HSET', K_POLICY, cls .. '.ceil', v[1]) end
  end
  local version = redis.call('HINCRBY', K_POLICY, 'version', 1)
  redis.call('HSET', K_POLICY, 'updated_ms', now, 'fence', fence)
  pack_policy(K_POLICY)  -- last: the packed copy is the fields as this call left them
  redis.call('XADD', K_DECISIONS, 'MAXLEN', '~', 10000, '*', 'version', version, 'fence', fence,
    'controller', controller_id, 'd', decision)
  return version
end

--!include main.lua
