-- release_leader: give up leadership on a clean shutdown, so a standby takes over now.
--
-- KEYS[1] leader   STRING qos:{pool}:leader
-- ARGV[1] owner          name (the lease owner, as acquire_leader took it)
-- ARGV[2] fence          integer >= 1
--
-- Returns 1 if this controller held the lease and released it, else 0. Errors: 'BADARG ...'.

--!include validate.lua

local K_LEADER = KEYS[1]

local function main()
  local controller_id = arg_name(ARGV[1], 'controller_id')
  local fence = arg_int(ARGV[2], 'fence', 1, 1e15)
  if redis.call('GET', K_LEADER) == controller_id .. ':' .. fence then
    redis.call('DEL', K_LEADER)
    return 1
  end
  return 0
end

--!include main.lua
