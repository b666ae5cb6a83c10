-- The janitor's sweeps: queued requests past their deadline, leases past theirs. Each
-- takes at most `limit` entries, so every call does bounded work.
--!include pool_keys.lua
--!include record.lua
--!include liveness.lua
--!include finish.lua
--!include expire.lua
--!include cancel.lua
--!include requeue.lua

-- Queued requests past their max wait: removed, refunded what they did not use, their
-- client told. Returns how many expired, and how many index entries it read (stale ones
-- included: at `limit`, there may be more to sweep).
local function expire_overdue(p, now, limit)
  if limit <= 0 then return 0, 0 end
  local ids = redis.call('ZRANGEBYSCORE', K_DEADLINES, '-inf', now, 'LIMIT', 0, limit)
  local expired = 0
  for _, id in ipairs(ids) do
    local r = load_request(id)
    if r and r.state == 'queued' then
      expire_queued(p, r, now, true)
      expired = expired + 1
    else
      redis.call('ZREM', K_DEADLINES, id)
    end
  end
  return expired, #ids
end

-- Leases past their deadline: the worker is presumed dead. Requeue, or fail after
-- max_attempts, or finish the cancellation the dead worker never acknowledged. Returns the
-- three counts, and how many index entries it read (as expire_overdue).
local function reap_leases(p, now, limit)
  local requeued, failed, cancelled = 0, 0, 0
  if limit <= 0 then return requeued, failed, cancelled, 0 end
  local ids = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'LIMIT', 0, limit)
  for _, id in ipairs(ids) do
    local r = load_request(id)
    if r == nil or r.state ~= 'leased' then
      redis.call('ZREM', K_LEASES, id)
    elseif r.cancel == 1 or not frontend_alive(p, r.frontend, now, r.enq_ms) then
      cancel_orphan(p, r, now, 'its lease expired and its client frontend went away')
      cancelled = cancelled + 1
    elseif r.attempts >= p.max_attempts then
      local why = 'worker lease expired on all ' .. r.attempts .. ' attempts'
      finish_by_redis(p, r, 'failed', why, used_cost(r), now,
        {code = exhausted_code(r), msg = why})
      failed = failed + 1
    elseif requeue(p, r, now) then
      requeued = requeued + 1
    else  -- its class left the policy
      failed = failed + 1
    end
  end
  return requeued, failed, cancelled, #ids
end
