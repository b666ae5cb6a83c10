-- release: a draining worker hands a request back before finishing it (graceful shutdown
-- past its drain timeout, or work it claimed but never started). Fenced like push_tokens:
-- only the lease holder at that attempt may release. The request goes back to the head
-- of its class queue (original order kept, tokens delivered so far kept, so the next
-- worker resumes the stream) and workers are woken. The attempt is given back: a planned
-- hand-back does not use up one of the request's max_attempts. If its client is gone it
-- is finished as cancelled instead.
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; PoolKeys.lifecycle_keys()).
-- ARGV[1] request_id  name
-- ARGV[2] worker_id   name
-- ARGV[3] attempt     integer >= 1 (from claim)
--
-- Returns {'requeued'} | {'cancelled'} | {'lost', reason}. Errors: 'BADARG ...', 'NOPOLICY ...'.

--!include validate.lua
--!include policy.lua
--!include bucket.lua
--!include pool_keys.lua
--!include msgpack.lua
--!include request.lua

local function main()
  local request_id = arg_name(ARGV[1], 'request_id')
  local worker_id = arg_name(ARGV[2], 'worker_id')
  local attempt = arg_int(ARGV[3], 'attempt', 1, 1000000)
  local p = load_policy(K_POLICY)
  local r = load_request(request_id)
  if r == nil or r.state ~= 'leased' or r.worker ~= worker_id or r.attempts ~= attempt then
    return {'lost', 'request is not leased to this worker at this attempt'}
  end
  local now = now_ms()
  if r.cancel == 1 or not frontend_alive(p, r.frontend, now) then
    finalize(p, r, 'cancelled', 'client went away', actual_cost(r, r.input_tokens, r.out_tokens or 0), now)
    notify_cancelled(r, 'its client went away while its worker was draining')
    add_sample(p, r, 'cancelled', now)
    return {'cancelled'}
  end
  requeue(p, r, now)
  redis.call('HSET', P_REQUEST .. request_id, 'attempts', attempt - 1)
  redis.call('HINCRBY', K_STATS, r.class .. '.released', 1)
  return {'requeued'}
end

--!include main.lua
