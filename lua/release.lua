-- release: a draining worker hands a request back before finishing it (graceful shutdown
-- past its drain timeout, or work it claimed but never started). Fenced like push_tokens.
-- The request goes back to its tenant's queue at its original place (tokens delivered so
-- far kept, so the next worker resumes the stream) with a new deadline of its own max wait,
-- and workers are woken. A planned hand-back does not use up one of the request's
-- max_attempts (the attempt count goes back; the fence token does not: the next claim gets
-- a new one, so this worker's stale writes stay refused). If its client is gone it is
-- finished as cancelled instead.
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; limiter/scripts.py lifecycle_keys).
-- ARGV[1] request_id  name
-- ARGV[2] worker_id   name
-- ARGV[3] fence       integer >= 1 (from claim)
-- ARGV[4] spent       optional '1': not a planned hand-back -- the model server broke on it --
--                     so the attempt counts, as when a worker dies; past max_attempts the
--                     request fails instead ('0', '' or absent: the attempt is given back)
--
-- Returns {'requeued'} | {'cancelled'} | {'failed'} (its class is no longer in the policy, or
-- a spent attempt was its last: finished as failed, its client told) | {'lost', reason}. Errors: 'BADARG ...', 'NOPOLICY ...'.

--!flags allow-oom
--!include pool_keys.lua
--!include validate.lua
--!include policy.lua
--!include lease.lua
--!include liveness.lua
--!include cancel.lua
--!include record.lua
--!include finish.lua
--!include requeue.lua

local function main()
  local request_id = arg_name(ARGV[1], 'request_id')
  local worker_id = arg_name(ARGV[2], 'worker_id')
  local fence = arg_int(ARGV[3], 'fence', 1, 1e15)
  local spent = arg_oneof(ARGV[4] or '', 'spent', {'', '0', '1'}) == '1'
  local p = load_policy(K_POLICY)
  local r = leased_request(request_id, worker_id, fence)
  if r == nil then return LEASE_LOST end
  local now = now_ms()
  if r.cancel == 1 or not frontend_alive(p, r.frontend, now, r.enq_ms) then
    cancel_orphan(p, r, now, 'its client went away while its worker was draining', not spent)
    return {'cancelled'}
  end
  if spent and r.attempts >= p.max_attempts then
    local why = 'the model server failed while serving it, on all ' .. r.attempts .. ' attempts'
    finish_by_redis(p, r, 'failed', why, used_cost(r), now,
      {code = exhausted_code(r), msg = why})
    return {'failed'}
  end
  if not requeue(p, r, now) then return {'failed'} end  -- its class left the policy
  if not spent then
    redis.call('HSET', P_REQUEST .. request_id, 'attempts', math.max(r.attempts - 1, 0))
  end
  redis.call('HINCRBY', K_STATS, r.class .. '.released', 1)
  return {'requeued'}
end

--!include main.lua
