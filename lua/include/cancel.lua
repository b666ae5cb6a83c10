-- Orphans: a request whose client is gone for good (its frontend stopped heartbeating, or
-- a cancel was never acknowledged by a dead worker) is finished as cancelled.
--!include record.lua
--!include finish.lua

-- Finish `r` as cancelled, charged for what it used (record.lua used_cost). Its frontend is
-- still told `why`: if it is alive after all (a late heartbeat), its client gets a clear
-- error at once instead of waiting for request_timeout_s; a dead frontend's stream just
-- expires. `handed_back`: a draining worker gives the attempt back (release.lua, not
-- spent): with nothing delivered the request ends as a queued one would, charged nothing.
local function cancel_orphan(p, r, now, why, handed_back)
  local used, fields = used_cost(r), nil
  if handed_back and r.out_tokens == 0 then used, fields = 0, {'ended', 'queued'} end
  finish_by_redis(p, r, 'cancelled', 'client went away', used, now, {code = 'cancelled', msg = why}, nil,
    fields)
end
