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

-- Add one request's token batch to `groups` (a table kept across one call: per frontend,
-- the fields of its one entry, and the frontends in the order first met). `fence` and
-- `offset` are the record's strings, `count` an integral number (a concatenation writes its
-- plain digits). A request without a frontend (nil or '') is told nothing.
local function group_entry(groups, id, frontend, fence, offset, count, text)
  if not frontend or frontend == '' then return end
  local fields = groups[frontend]
  if not fields then
    fields = {'k', 'toks'}
    groups[frontend] = fields
    groups[#groups + 1] = frontend
  end
  fields[#fields + 1] = id
  fields[#fields + 1] = fence .. ' ' .. offset .. ' ' .. count .. ' ' .. text
end

-- Append each frontend's grouped entry to its reply stream: 'k' = 'toks', then per request
-- its id -> 'fence offset count text' (three integers and the text, one space apart: the
-- text may hold spaces, the integers cannot; limiter/frontend/replies.py replies_of).
-- One entry for a frontend's requests of a push, not one each: an entry costs ~10-14k
-- instructions (callgrind), of ~100k a request's share of a push, and the frontend reads one
-- entry, not n.
local function notify_grouped(groups)
  for _, frontend in ipairs(groups) do
    local stream = P_REPLY .. frontend
    redis.call('XADD', stream, 'MAXLEN', '~', REPLY_MAXLEN, '*', unpack(groups[frontend]))
    redis.call('EXPIRE', stream, REPLY_TTL_S)  -- as notify's
  end
end
