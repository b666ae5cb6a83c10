-- complete: a worker finishes a request (ok, failed or cancelled) with its true usage.
-- Delivers the last tokens, refunds the unused reservation (never more than was
-- charged, each bucket at most its own charge), sends the final message to the client's
-- frontend, appends the worker's latency sample, and gives the record a short TTL.
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; limiter/scripts.py lifecycle_keys).
-- ARGV[1]  request_id     name
-- ARGV[2]  worker_id      name
-- ARGV[3]  fence          integer >= 1 (from claim)
-- ARGV[4]  outcome        ok | failed | cancelled
-- ARGV[5]  usage_in       integer >= 0: prompt tokens the engine really processed
-- ARGV[6]  count          integer >= 0: tokens in this last batch (the model's tokens)
-- ARGV[7]  token_ids      n_ids x uint32 little-endian (resume data, as in push_tokens)
-- ARGV[8]  text           the last batch's text
-- ARGV[9]  finish_reason  stop | length | cancelled | error
-- ARGV[10] message        error message for outcome failed ('' otherwise)
-- ARGV[11] sample         msgpack latency sample ('' = none), appended to the samples stream
-- ARGV[12] n_ids          optional integer >= 0: ids in token_ids ('' or absent = count;
--                         see push_tokens)
-- ARGV[13] offset         optional integer >= 0: tokens the worker knows were delivered before
--                         this batch ('' or absent = not checked); a mismatch is an error, as
--                         in push_tokens: a push whose reply was lost may have landed, and its
--                         tokens must not be delivered twice
--
-- usage_out = tokens delivered before + count. Returns {'ok', refund} (the part of the
-- reservation it did not use; each bucket gets back at most what it was charged) or
-- {'lost', reason}. Errors: 'BADARG ...', 'NOPOLICY ...'.

--!flags allow-oom
--!include pool_keys.lua
--!include validate.lua
--!include policy.lua
--!include record.lua
--!include lease.lua
--!include tokens.lua
--!include finish.lua
--!include notify.lua
--!include samples.lua

-- The record fields a completion reads: the lease's, and what its refunds and reply need.
local COMPLETE_FIELDS = {'state', 'worker', 'fence', 'frontend', 'tenant', 'class', 'out_tokens',
  'max_tokens', 'first_ms', 'cancel', 'cost', 'w_in', 'w_out', 't_rate', 't_burst', 't_weight',
  'c_tenant', 'c_class', 'c_ceil', 'c_vtc'}

local function main()
  local request_id = arg_name(ARGV[1], 'request_id')
  local worker_id = arg_name(ARGV[2], 'worker_id')
  local fence = arg_int(ARGV[3], 'fence', 1, 1e15)
  local outcome = arg_oneof(ARGV[4], 'outcome', {'ok', 'failed', 'cancelled'})
  local usage_in = arg_int(ARGV[5], 'usage_in', 0, 10000000)
  local count = arg_int(ARGV[6], 'count', 0, 1000000)
  local token_ids, text = ARGV[7], ARGV[8]
  local n_ids = arg_token_batch(count, token_ids, text, ARGV[12])
  local finish_reason = arg_oneof(ARGV[9], 'finish_reason', {'stop', 'length', 'cancelled', 'error'})
  local message = ARGV[10]
  if message == nil or #message > 4096 then fail('BADARG', 'message: missing or over 4 KiB') end
  local sample = ARGV[11]
  if sample == nil or #sample > 65536 then fail('BADARG', 'sample: missing or over 64 KiB') end
  local expected = nil
  if ARGV[13] ~= nil and ARGV[13] ~= '' then expected = arg_int(ARGV[13], 'offset', 0, 10000000) end
  local p = load_policy(K_POLICY)
  local r = leased_request(request_id, worker_id, fence, COMPLETE_FIELDS)
  if r == nil then return LEASE_LOST end
  local offset = r.out_tokens or 0
  if expected ~= nil and expected ~= offset then
    fail('BADARG', 'offset: ' .. expected .. ' but ' .. offset .. ' tokens were delivered')
  end
  local usage_out = offset + count
  if usage_out > r.max_tokens then
    fail('BADARG', 'count: ' .. usage_out .. ' tokens exceed max_tokens ' .. r.max_tokens)
  end
  local now = now_ms()
  append_token_ids(request_id, token_ids, n_ids)
  -- the record's last fields go with finalize's own HSET (one write)
  local fields = {'usage_in', usage_in, 'usage_out', usage_out, 'finish_reason', finish_reason}
  if count > 0 then
    fields[7], fields[8] = 'out_tokens', usage_out
    if r.first_ms == nil then fields[9], fields[10] = 'first_ms', now end
  end
  r.out_tokens, r.wrote_ids = usage_out, n_ids > 0
  local state = ({ok = 'done', failed = 'failed', cancelled = 'cancelled'})[outcome]
  local reason = message ~= '' and message or finish_reason
  local given = finalize(p, r, state, reason, actual_cost(r, usage_in, usage_out), now, fields)
  if outcome == 'ok' then
    notify(r, {'k', 'done', 'a', fence, 'o', offset, 'n', count, 't', text,
      'fin', finish_reason, 'in', usage_in, 'out', usage_out})
  elseif outcome == 'failed' then
    notify(r, {'k', 'err', 'code', 'failed', 'msg', reason})
  else
    notify(r, {'k', 'err', 'code', 'cancelled',
      'msg', 'its worker stopped it: the client went away (or its frontend stopped heartbeating)'})
  end
  if sample ~= '' then append_sample(sample) end
  return {'ok', fmt(given.refund)}
end

--!include main.lua
