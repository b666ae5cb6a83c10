-- acquire_leader: take or keep the pool's controller leadership (a lease with fencing).
--
-- KEYS[1] leader   STRING qos:{pool}:leader = "<owner>:<fence>", PX lease (owner: the
--                 controller id and a per-process suffix, limiter/controller/leader.py)
-- KEYS[2] fence    STRING qos:{pool}:fence, a counter: each new leadership gets the next
-- ARGV[1] owner          name: the lease owner (controller id + a per-process suffix)
-- ARGV[2] ttl_ms         integer 100..600000: the lease length
--
-- Returns {fence, 1} when this controller leads with its lease renewed, {fence, 2} when it
-- took the lease anew (a new leadership, even if its fence repeats an earlier one: a Redis
-- that lost its data restarts the counter), or {0, holder} when another controller holds
-- the lease. Errors: 'BADARG ...'.

--!include validate.lua

local K_LEADER = KEYS[1]
local K_FENCE = KEYS[2]

local function main()
  local controller_id = arg_name(ARGV[1], 'controller_id')
  local ttl_ms = arg_int(ARGV[2], 'ttl_ms', 100, 600000)
  local holder = redis.call('GET', K_LEADER)
  if holder then
    local who, fence = string.match(holder, '^(.*):(%d+)$')
    if who == controller_id then
      redis.call('PEXPIRE', K_LEADER, ttl_ms)
      return {tonumber(fence), 1}
    end
    return {0, holder}
  end
  local fence = redis.call('INCR', K_FENCE)
  redis.call('SET', K_LEADER, controller_id .. ':' .. fence, 'PX', ttl_ms)
  return {fence, 2}
end

--!include main.lua
