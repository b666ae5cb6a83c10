-- push_tokens: a worker delivers generated tokens for one or more of its requests (every
-- request of a step that has tokens due, in one call: a shard runs one script at a time,
-- and each call costs a fixed ~40 us of Redis time and I/O however little it carries). Per
-- request, the tokens are appended to the request's record (so another worker can resume
-- the stream) and the text goes to the request's frontend reply stream. Fenced: only the
-- worker holding the lease with this fence token can write. A push does not extend the
-- leases: renew_leases does, for every request the worker holds (every lease_ms / 3), as it
-- must anyway for a request with nothing to push (a long prefill, an unstreamed answer);
-- moving a pushed request's lease too was a sorted-set ZADD and a record field a call
-- (-5.5 % of a 256-token streamed request's instructions, callgrind).
--
-- KEYS: the head of the lifecycle key list: its first 4 (policy, request, token and reply
--       prefixes; include/pool_keys.lua; limiter/scripts.py push_keys), or the whole list.
-- ARGV[1] worker_id   name
-- ARGV[2] lease_ms    integer >= 0, 0 = the pool's lease_ms: the worker's lease length, for
--                     the TTL of a token string this push creates (as claim's)
-- ARGV[3] n           integer in [1, 64]: requests in this call (bounded work per call)
-- ARGV[4] grouped     0|1: 1 = the requests' frontends read grouped entries (their payloads
--                     say so: limiter/prompt.py Payload.grouped_tokens), so each frontend
--                     gets ONE entry for all its requests of this call (include/notify.lua
--                     notify_grouped; an entry costs ~10-14k instructions, a push ~100k a
--                     request); 0 = one entry per request (notify), what a frontend of an
--                     older release reads. A call of one request gets an entry of its own.
-- then n groups of 7, one per request (distinct request ids):
--   request_id  name
--   fence       integer >= 1 (from claim)
--   offset      integer >= 0: tokens delivered before this batch (must match, see returns)
--   count       integer >= 1: tokens in this batch (the model's tokens: what out_tokens,
--               max_tokens and usage count)
--   token_ids   n_ids x uint32 little-endian: what a resuming worker primes itself with
--   text        the batch's decoded text (UTF-8, may be empty)
--   n_ids       integer >= 0: ids in token_ids ('' = count). The step engines send one id
--               per token; the openai engine, which cannot see the upstream's ids, counts
--               the upstream's tokens and stores the text's UTF-8 bytes as ids
--               (worker/upstream.py)
--
-- Returns one reply per request, in order:
--   'ok'                      delivered (a string, not a table: a table a request and its
--                             nested reply were ~1k instructions each). Whether its client
--                             cancelled is not said here: the worker asks the cancels set
--                             for all it holds, one SMISMEMBER every flush_ms, and
--                             renew_leases says it too (the flag, one more field of every
--                             request's HMGET, and the table reply: a push of 8 to 64
--                             requests -7 to -10 % without them, callgrind)
--   {'lost', reason}          not leased to this worker with this fence: nothing written
--   {'offset', delivered}     offset is not the tokens already delivered (an earlier push whose
--                             reply was lost did land): nothing written for it
--   {'max_tokens', max_tokens} offset + count is past the request's max_tokens (the worker
--                             counted more than the record allows): nothing written for it.
--                             A reply, not an error: it is one request's state, and the
--                             other requests of the call are delivered
-- Errors (nothing written for any request): 'BADARG ...' (an argument or a repeated
-- request id), 'NOPOLICY ...'.

--!include pool_keys.lua
--!include validate.lua
--!include policy.lua
--!include record.lua
--!include lease.lua
--!include tokens.lua
--!include notify.lua

local MAX_REQUESTS = 64
local HEADER = 4
local PER_REQUEST = 7

local function main()
  if #KEYS < 4 then fail('BADARG', 'KEYS: expected at least the 4 of the lifecycle list push_tokens uses, got '
    .. #KEYS) end
  local worker_id = arg_name(ARGV[1], 'worker_id')
  local lease_ms = arg_int(ARGV[2], 'lease_ms', 0, 3600000)
  local n = arg_int(ARGV[3], 'n', 1, MAX_REQUESTS)
  -- (a call of one request: an entry of its own, the same entry without a table to build)
  local grouped = arg_int(ARGV[4], 'grouped', 0, 1) == 1 and n > 1
  if #ARGV ~= HEADER + PER_REQUEST * n then
    fail('BADARG', 'argv: expected ' .. (HEADER + PER_REQUEST * n) .. ' arguments for ' .. n .. ' requests, got '
      .. #ARGV)
  end
  -- Every argument of every request is checked before the first write. Nothing is kept:
  -- the loop below reads the checked arguments again, cheaper than a table per request
  -- (~9k instructions each, callgrind).
  local seen = {}
  for i = 1, n do
    local a = HEADER + PER_REQUEST * (i - 1)
    local id = arg_name(ARGV[a + 1], 'request_id')
    if seen[id] then fail('BADARG', 'request_id: ' .. id .. ' twice in one push') end
    seen[id] = true
    arg_int(ARGV[a + 2], 'fence', 1, 1e15)
    arg_int(ARGV[a + 3], 'offset', 0, 10000000)
    arg_token_batch(arg_int(ARGV[a + 4], 'count', 1, 1000000), ARGV[a + 5], ARGV[a + 6], ARGV[a + 7])
  end
  local p = load_pool_fields(K_POLICY, {'lease_ms'})
  if lease_ms == 0 then lease_ms = p.lease_ms end
  local now = now_ms()
  -- Numbers go to Redis as strings made here: redis.call formats a number argument with
  -- '%.17g', the dearest part of an argument (callgrind: a tenth of a call).
  local fmt = string.format
  -- groups: per frontend, its entry's fields (notify_grouped), in the order first met
  local replies, expired, groups = {}, {}, {}
  -- Each request is read, checked and written in turn: a request refused (lost, offset,
  -- max_tokens) has nothing written, and a request's writes touch only its own keys (and
  -- its frontend's reply stream).
  for i = 1, n do
    local a = HEADER + PER_REQUEST * (i - 1)
    local id, offset_s = ARGV[a + 1], ARGV[a + 3]
    local held, out_s, max_tokens, started, frontend, fence_s = leased_for_write(id, worker_id,
      ARGV[a + 2])
    -- The offset is compared with out_tokens as strings first, as the fence is (include/
    -- lease.lua); the reply entry carries the stored strings: canonical, and once checked
    -- the same numbers as the arguments.
    local offset, count = held and 0 + out_s, 0 + ARGV[a + 4]
    if not held then
      replies[i] = LEASE_LOST
    elseif offset_s ~= out_s and 0 + offset_s ~= offset then
      replies[i] = {'offset', offset}
    elseif offset + count > max_tokens then
      replies[i] = {'max_tokens', max_tokens}
    else
      -- The record's TTL is not extended here (two commands of ~6 per request): claim and
      -- renew_leases (every lease_ms / 3) set it to the lease's end plus a week's grace, as
      -- they move the lease. Only the token string this push creates (an attempt's first
      -- ids) gets its TTL here.
      local token_ids = ARGV[a + 5]
      if #token_ids > 0 and redis.call('APPEND', P_TOKENS .. id, token_ids) == #token_ids then
        redis.call('PEXPIRE', P_TOKENS .. id, lease_ms + LIVE_RECORD_GRACE_MS)  -- as a claim's
      end
      -- offset is what was delivered: checked above
      local key, delivered = P_REQUEST .. id, fmt('%d', offset + count)
      if started then
        redis.call('HSET', key, 'out_tokens', delivered)
      else
        redis.call('HSET', key, 'out_tokens', delivered, 'first_ms', fmt('%d', now))
      end
      if grouped then
        group_entry(groups, id, frontend, fence_s, out_s, count, ARGV[a + 6])
      else
        notify(id, frontend, expired, 'k', 'tok', 'a', fence_s, 'o', out_s, 'n', fmt('%d', count),
          't', ARGV[a + 6])
      end
      replies[i] = 'ok'
    end
  end
  notify_grouped(groups)
  return replies
end

--!include main.lua
