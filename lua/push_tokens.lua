-- push_tokens: a worker delivers a batch of generated tokens for one request. The tokens
-- are appended to the request's record (so another worker can resume the stream) and
-- the text goes to the request's frontend reply stream. Fenced: only the worker holding
-- the lease with this fence token can write. Also extends the lease.
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; limiter/scripts.py lifecycle_keys).
-- ARGV[1] request_id  name
-- ARGV[2] worker_id   name
-- ARGV[3] fence       integer >= 1 (from claim)
-- ARGV[4] offset      integer >= 0: tokens delivered before this batch (must match)
-- ARGV[5] count       integer >= 1: tokens in this batch (the model's tokens: what out_tokens,
--                     max_tokens and usage count)
-- ARGV[6] token_ids   n_ids x uint32 little-endian: what a resuming worker primes itself with
-- ARGV[7] text        the batch's decoded text (UTF-8, may be empty)
-- ARGV[8] lease_ms    integer >= 0, 0 = the pool's lease_ms
-- ARGV[9] n_ids       optional integer >= 0: ids in token_ids ('' or absent = count). The
--                     step engines send one id per token; the openai engine, which cannot
--                     see the upstream's ids, counts the upstream's tokens and stores the
--                     text's UTF-8 bytes as ids (worker/upstream.py)
--
-- Returns {'ok', cancel(0|1)} or {'lost', reason}. Errors: 'BADARG ...', 'NOPOLICY ...'.

--!include pool_keys.lua
--!include validate.lua
--!include policy.lua
--!include record.lua
--!include lease.lua
--!include tokens.lua
--!include notify.lua

local function main()
  local request_id = arg_name(ARGV[1], 'request_id')
  local worker_id = arg_name(ARGV[2], 'worker_id')
  local fence = arg_int(ARGV[3], 'fence', 1, 1e15)
  local offset = arg_int(ARGV[4], 'offset', 0, 10000000)
  local count = arg_int(ARGV[5], 'count', 1, 1000000)
  local token_ids, text = ARGV[6], ARGV[7]
  local n_ids = arg_token_batch(count, token_ids, text, ARGV[9])
  local lease_ms = arg_int(ARGV[8], 'lease_ms', 0, 3600000)
  local p = load_pool(K_POLICY, {'lease_ms', 'record_ttl_s'})
  if lease_ms == 0 then lease_ms = p.lease_ms end
  local r = leased_request(request_id, worker_id, fence, LEASE_FIELDS)
  if r == nil then return LEASE_LOST end
  if offset ~= r.out_tokens then
    fail('BADARG', 'offset: ' .. offset .. ' but ' .. r.out_tokens .. ' tokens were delivered')
  end
  if offset + count > r.max_tokens then
    fail('BADARG', 'count: ' .. (offset + count) .. ' tokens exceed max_tokens ' .. r.max_tokens)
  end
  local now = now_ms()
  append_token_ids(request_id, token_ids, n_ids)
  local fields = {'out_tokens', offset + count}  -- offset is what was delivered: checked above
  if r.first_ms == nil then fields[3], fields[4] = 'first_ms', now end
  extend_lease(p, request_id, now + lease_ms, now, fields)
  notify(r, {'k', 'tok', 'a', fence, 'o', offset, 'n', count, 't', text})
  return {'ok', r.cancel}
end

--!include main.lua
