-- Expiry: a queued request whose max wait passed before any worker took it.
--!include record.lua
--!include finish.lua

-- Finish `r` (queued) as expired, refunded what it did not use (record.lua used_cost: all
-- of it unless an earlier attempt delivered tokens before it was requeued). `tell`: send
-- its frontend the error (false when the frontend itself reported the expiry:
-- cancel_request's reason expired).
local function expire_queued(p, r, now, tell)
  local waited = now - r.enq_ms
  local notice = nil
  if tell then
    notice = {code = 'expired', msg = 'request waited ' .. waited .. ' ms in the ' .. r.class .. ' queue, past its max wait'}
  end
  finish_by_redis(p, r, 'expired', 'max queue wait passed after ' .. waited .. ' ms', used_cost(r), now,
    notice)
end
