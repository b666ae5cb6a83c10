-- Replies to a request's frontend: one entry per message on its reply stream out:<frontend>.
--!include pool_keys.lua

-- Append `fields` (with the request's id) to the stream of the frontend that holds the
-- request's client; a request without one (none recorded) is told nothing.
local function notify(r, fields)
  if r.frontend and r.frontend ~= '' then
    local stream = P_REPLY .. r.frontend
    redis.call('XADD', stream, 'MAXLEN', '~', REPLY_MAXLEN, '*', 'id', r.id, unpack(fields))
    -- A frontend killed for good leaves no stream behind once nobody writes to it.
    redis.call('EXPIRE', stream, REPLY_TTL_S)
  end
end
