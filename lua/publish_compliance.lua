-- publish_compliance: the leader's report for `qos status` and `qos top`, written whole with
-- its expiry in one call. Written by a plain pipeline (HSET, HDEL, PEXPIRE), a controller
-- that died or lost Redis between the HSET and the PEXPIRE left a hash with no expiry: a dead
-- fleet's figures read as current for good. One key only, on purpose: while a reshard moves
-- the pool's slot a call that touches one key follows ASK to wherever it is, where one of
-- several keys split between the two nodes is refused (TRYAGAIN) until the move ends, and
-- the leader's report went on through a move (tests/test_controller_cluster.py). Not fenced
-- for that reason: only the leader's tick publishes, and a deposed leader's one late report
-- is the figures of a tick a lease ago, gone at its expiry.
--
-- KEYS[1] compliance  HASH qos:{pool}:compliance (limiter/keys.py PoolKeys.compliance)
-- ARGV[1] ttl_ms      integer in [1000, 86400000]: the hash expires unless rewritten by then
-- ARGV[2..] field, value pairs, each field at most once:
--   <class>               compliance in [0, 1] (a class name: letters, digits, _ and -)
--   .capacity             weighted tokens/s in [0, 1e15]
--   .capacity_source      name (where the estimate came from)
--   .capacity_confidence  in [0, 1]
--   .capacity_workers     integer in [0, 1e9]
--   .updated_ms           integer in [0, 1e15] (Redis ms of the tick)
--   .controller           name (the controller's id)
--
-- The hash is replaced: a class without a figure now (no samples, no target) is absent.
-- Returns the number of fields written. Errors: 'BADARG ...' (nothing written).

--!include validate.lua

local K_COMPLIANCE = KEYS[1]

local FIELDS = {
  ['.capacity'] = function(v, f) return fmt(arg_num(v, f, 0, 1e15)) end,
  ['.capacity_source'] = function(v, f) return arg_name(v, f) end,
  ['.capacity_confidence'] = function(v, f) return fmt(arg_num(v, f, 0, 1)) end,
  ['.capacity_workers'] = function(v, f) return fmt(arg_int(v, f, 0, 1e9)) end,
  ['.updated_ms'] = function(v, f) return fmt(arg_int(v, f, 0, 1e15)) end,
  ['.controller'] = function(v, f) return arg_name(v, f) end,
}

local function main()
  local ttl_ms = arg_int(ARGV[1], 'ttl_ms', 1000, 86400000)
  if #ARGV < 3 or (#ARGV - 1) % 2 ~= 0 then fail('BADARG', 'fields: expected field/value pairs') end
  local writes, seen = {}, {}
  for i = 2, #ARGV, 2 do
    local f = ARGV[i]
    if seen[f] then fail('BADARG', 'field: given twice: ' .. tostring(f)) end
    seen[f] = true
    local check = FIELDS[f]
    local value
    if check ~= nil then
      value = check(ARGV[i + 1], f)
    else
      arg_class_name(f, 'field')
      value = fmt(arg_num(ARGV[i + 1], f, 0, 1))
    end
    writes[#writes + 1] = f
    writes[#writes + 1] = value
  end
  redis.call('DEL', K_COMPLIANCE)
  redis.call('HSET', K_COMPLIANCE, unpack(writes))
  redis.call('PEXPIRE', K_COMPLIANCE, ttl_ms)
  return #writes / 2
end

--!include main.lua
