-- Replies to a request's frontend: one entry per message on its reply stream out:<frontend>.
--!include pool_keys.lua

-- Append an entry (the request's `id`, then the field, value, ... pairs given after
-- `expired`) to the stream of `frontend`, the one that holds the request's client; a
-- request without one (nil or '') is told nothing. `expired` (optional, a table kept across
-- calls of one script): the streams whose TTL this call already set, so a batch of entries
-- for one frontend sets it once. The pairs come as arguments, not a table: a table built
-- for each entry was a few percent of a push (callgrind).
local function notify(id, frontend, expired, ...)
  if frontend and frontend ~= '' then
    local stream = P_REPLY .. frontend
    redis.call('XADD', stream, 'MAXLEN', '~', REPLY_MAXLEN, '*', 'id', id, ...)
    -- A frontend killed for good leaves no stream behind once nobody writes to it.
    if not (expired and expired[stream]) then
      redis.call('EXPIRE', stream, REPLY_TTL_S)
      if expired then expired[stream] = true end
    end
  end
end
