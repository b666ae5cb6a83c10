-- Orphans: a request whose client is gone for good (its frontend stopped heartbeating, or
-- a cancel was never acknowledged by a dead worker) is finished as cancelled.
--!include record.lua
--!include finish.lua

-- Finish `r` as cancelled, charged for what it used: nothing while it is queued (as a client's
-- own cancel of a queued request, or its expiry), its prompt and output once a worker holds
-- it. Its frontend is still told `why`: if it is alive after all (a late heartbeat), its
-- client gets a clear error at once instead of waiting for request_timeout_s; a dead
-- frontend's stream just expires.
local function cancel_orphan(p, r, now, why)
  local used = r.state == 'queued' and 0 or actual_cost(r, r.input_tokens, r.out_tokens)
  finish_by_redis(p, r, 'cancelled', 'client went away', used, now, {code = 'cancelled', msg = why})
end
