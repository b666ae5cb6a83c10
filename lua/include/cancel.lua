-- Orphans: a request whose client is gone for good (its frontend stopped heartbeating, or
-- a cancel was never acknowledged by a dead worker) is finished as cancelled.
--!include record.lua
--!include finish.lua

-- Finish `r` as cancelled, charged for what it used (record.lua used_cost: nothing if no
-- worker ever took it, else its prompt and the tokens delivered). Its frontend is still told `why`: if it is alive after all (a late heartbeat), its
-- client gets a clear error at once instead of waiting for request_timeout_s; a dead
-- frontend's stream just expires.
local function cancel_orphan(p, r, now, why)
  finish_by_redis(p, r, 'cancelled', 'client went away', used_cost(r), now, {code = 'cancelled', msg = why})
end
