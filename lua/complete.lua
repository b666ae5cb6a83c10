-- complete: a worker finishes requests (ok, failed, refused or cancelled) with their true usage. One
-- call takes up to 64 (a worker's completions of one step: limiter/script_batcher.py merges
-- the calls of one event-loop turn); each is finished as the same request in a call of its
-- own would be, one after the other, and every argument and every request's offset and
-- token count is checked before the first write.
-- Per request: delivers the last tokens, refunds the unused reservation (never more than
-- was charged, each bucket at most its own charge) or charges what it used beyond it where
-- the reservation was charged (include/refund.lua), sends the final message to the client's
-- frontend, appends the worker's latency sample, and gives the record a short TTL.
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; limiter/scripts.py lifecycle_keys).
-- ARGV: n groups of the 13 arguments below, n in 1..64, request k's at ARGV[13 (k - 1) + i],
-- the request ids distinct; a call of one request may leave out its n_ids and offset.
-- ARGV[1]  request_id     name
-- ARGV[2]  worker_id      name
-- ARGV[3]  fence          integer >= 1 (from claim)
-- ARGV[4]  outcome        ok | failed | refused | cancelled (refused: failed for what the
--                         request is, e.g. a model server's 400 -- a retry fails the same way:
--                         the record says failed, its frontend hears code 'refused')
-- ARGV[5]  usage_in       integer >= 0: prompt tokens the engine really processed
-- ARGV[6]  count          integer >= 0: tokens in this last batch (the model's tokens)
-- ARGV[7]  token_ids      n_ids x uint32 little-endian (resume data, as in push_tokens)
-- ARGV[8]  text           the last batch's text
-- ARGV[9]  finish_reason  stop | length | tool_calls | cancelled | error (tool_calls: a model
--                         server's answer that called tools)
-- ARGV[10] message        error message for outcome failed or refused ('' otherwise)
-- ARGV[11] sample         msgpack latency sample ('' = none), appended to the samples stream
-- ARGV[12] n_ids          integer >= 0: ids in token_ids ('' or absent = count; see
--                         push_tokens)
-- ARGV[13] offset         integer >= 0: tokens the worker knows were delivered before this
--                         batch ('' or absent = not checked); a mismatch is an error, as in
--                         push_tokens: a push whose reply was lost may have landed, and its
--                         tokens must not be delivered twice
--
-- usage_out = tokens delivered before + count. A request's reply is {'ok', refund} (the part
-- of the reservation it did not use; each bucket gets back at most what it was charged) or
-- {'lost', reason}. Returns, for a call of one request, its reply; for n > 1, {reply_1, ...,
-- reply_n}. Errors (nothing written for any request): 'BADARG ...' (an argument, a repeated
-- request id, an offset that does not match, tokens past max_tokens), 'NOPOLICY ...'.

--!flags allow-oom
--!include pool_keys.lua
--!include validate.lua
--!include policy.lua
--!include record.lua
--!include lease.lua
--!include tokens.lua
--!include served.lua
--!include finish.lua
--!include notify.lua
--!include samples.lua

-- The record fields a completion reads: the lease's, and what its refunds and reply need.
local COMPLETE_FIELDS = {'state', 'worker', 'fence', 'frontend', 'tenant', 'class', 'out_tokens',
  'max_tokens', 'first_ms', 'claimed_ms', 'cancel', 'cost', 'w_in', 'w_out', 't_rate', 't_burst', 't_weight',
  'c_tenant', 'c_class', 'c_ceil', 'c_vtc', 'ceil_out'}

local ITEM = 13  -- arguments per request
local MAX_ITEMS = 64  -- requests per call (limiter/scripts.py COMPLETE_LIMIT)

-- Request k's arguments, checked.
local function read_completion(k)
  local a = ITEM * (k - 1)
  local c = {}
  c.request_id = arg_name(ARGV[a + 1], 'request_id')
  c.worker_id = arg_name(ARGV[a + 2], 'worker_id')
  c.fence = arg_int(ARGV[a + 3], 'fence', 1, 1e15)
  c.outcome = arg_oneof(ARGV[a + 4], 'outcome', {'ok', 'failed', 'refused', 'cancelled'})
  c.usage_in = arg_int(ARGV[a + 5], 'usage_in', 0, 10000000)
  c.count = arg_int(ARGV[a + 6], 'count', 0, 1000000)
  c.token_ids, c.text = ARGV[a + 7], ARGV[a + 8]
  c.n_ids = arg_token_batch(c.count, c.token_ids, c.text, ARGV[a + 12])
  c.finish_reason = arg_oneof(ARGV[a + 9], 'finish_reason', {'stop', 'length', 'tool_calls', 'cancelled',
                                                                'error'})
  c.message = ARGV[a + 10]
  if c.message == nil or #c.message > 4096 then fail('BADARG', 'message: missing or over 4 KiB') end
  c.sample = ARGV[a + 11]
  if c.sample == nil or #c.sample > 65536 then fail('BADARG', 'sample: missing or over 64 KiB') end
  local offset = ARGV[a + 13]
  if offset ~= nil and offset ~= '' then c.expected = arg_int(offset, 'offset', 0, 10000000) end
  return c
end

-- The request's record while this worker holds its lease (nil: lost), its tokens checked
-- against what it delivered and may deliver. Reads only: every request of a call passes
-- this before the first is finished.
local function leased_completion(c)
  local r = leased_request(c.request_id, c.worker_id, c.fence, COMPLETE_FIELDS)
  if r == nil then return nil end
  local offset = r.out_tokens or 0
  if c.expected ~= nil and c.expected ~= offset then
    fail('BADARG', 'offset: ' .. c.expected .. ' but ' .. offset .. ' tokens were delivered')
  end
  if offset + c.count > r.max_tokens then
    fail('BADARG', 'count: ' .. offset + c.count .. ' tokens exceed max_tokens ' .. r.max_tokens)
  end
  return r
end

-- `expired`: the reply streams whose TTL this call set already (include/notify.lua).
local function complete_one(p, c, r, now, expired)
  if r == nil then return LEASE_LOST end
  local offset, count = r.out_tokens, c.count
  local usage_out = offset + count
  append_token_ids(c.request_id, c.token_ids, c.n_ids)
  -- the record's last fields go with finalize's own HSET (one write)
  local fields = {'usage_in', c.usage_in, 'usage_out', usage_out, 'finish_reason', c.finish_reason}
  if count > 0 then
    fields[7], fields[8] = 'out_tokens', usage_out
    if r.first_ms == nil then fields[9], fields[10] = 'first_ms', now end
  end
  r.out_tokens, r.wrote_ids = usage_out, c.n_ids > 0
  local state = ({ok = 'done', failed = 'failed', refused = 'failed', cancelled = 'cancelled'})[c.outcome]
  local reason = c.message ~= '' and c.message or c.finish_reason
  local given = finalize(p, r, state, reason, actual_cost(r, c.usage_in, usage_out), now, fields)
  if c.outcome == 'ok' then
    notify(r.id, r.frontend, expired, 'k', 'done', 'a', c.fence, 'o', offset, 'n', count, 't', c.text,
      'fin', c.finish_reason, 'in', c.usage_in, 'out', usage_out)
  elseif c.outcome ~= 'cancelled' then  -- failed or refused
    notify(r.id, r.frontend, expired, 'k', 'err', 'code', c.outcome, 'msg', reason)
  else
    notify(r.id, r.frontend, expired, 'k', 'err', 'code', 'cancelled',
      'msg', 'its worker stopped it: the client went away (or its frontend stopped heartbeating)')
  end
  if c.sample ~= '' then append_sample(c.sample) end
  return {'ok', fmt(given.refund)}
end

local function main()
  local n = arg_items(ITEM, MAX_ITEMS)
  local calls, seen = {}, {}
  for k = 1, n do
    calls[k] = read_completion(k)
    local id = calls[k].request_id
    -- a request's second completion in one call would be checked against its state before
    -- the first: refused, as push_tokens refuses a repeated id
    if seen[id] then fail('BADARG', 'request_id: ' .. id .. ' twice in one call') end
    seen[id] = true
  end
  local p = load_policy(K_POLICY)
  local records = {}
  for k = 1, n do records[k] = leased_completion(calls[k]) or false end
  local now = now_ms()
  local out, expired = {}, {}
  -- every settlement of the served ledger this call makes, in one read and one write
  local ledger = served_open_ledger(p, nil)
  for k = 1, n do out[k] = complete_one(p, calls[k], records[k] or nil, now, expired) end
  if ledger and ledger.dirty then served_write(p, ledger) end
  if n == 1 then return out[1] end
  return out
end

--!include main.lua
