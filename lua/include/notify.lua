-- Replies to a request's frontend: one entry per message on its reply stream out:<frontend>.
--!include pool_keys.lua

-- Append `fields` (with the request's id) to the stream of the frontend that holds the
-- request's client; a request without one (none recorded) is told nothing. `expired`
-- (optional, a table kept across calls of one script): the streams whose TTL this call
-- already set, so a batch of entries for one frontend sets it once.
local function notify(r, fields, expired)
  if r.frontend and r.frontend ~= '' then
    local stream = P_REPLY .. r.frontend
    redis.call('XADD', stream, 'MAXLEN', '~', REPLY_MAXLEN, '*', 'id', r.id, unpack(fields))
    -- A frontend killed for good leaves no stream behind once nobody writes to it.
    if not (expired and expired[stream]) then
      redis.call('EXPIRE', stream, REPLY_TTL_S)
      if expired then expired[stream] = true end
    end
  end
end
