-- What happens to a request when time runs out: its queue deadline passes, its frontend
-- stops heartbeating, or its worker's lease expires. Each helper finishes or requeues ONE
-- request; the sweeps take at most `limit` entries, so every call does bounded work.
--!include finish.lua
--!include liveness.lua

local function expire_queued(p, r, now)
  local waited = now - r.enq_ms
  finalize(p, r, 'expired', 'max queue wait passed after ' .. waited .. ' ms', 0, now)
  notify(r, {'k', 'err', 'code', 'expired', 'msg', 'request waited ' .. waited .. ' ms in the ' .. r.class .. ' queue, past its max wait'})
  add_sample(p, r, 'expired', now)
end

local function cancel_orphan(p, r, now, why)
  finalize(p, r, 'cancelled', 'client went away', actual_cost(r, r.input_tokens, r.out_tokens), now)
  notify_cancelled(r, why)
  add_sample(p, r, 'cancelled', now)
end

-- Put a leased request back in its tenant's queue, at its original place (seq), with a new
-- deadline of its own max wait (a client's shorter X-QoS-Max-Wait-Ms stays shorter).
local function requeue(p, r, now)
  redis.call('ZREM', K_LEASES, r.id)
  if redis.call('HINCRBY', K_INFLIGHT, r.class, -1) <= 0 then redis.call('HDEL', K_INFLIGHT, r.class) end
  r.deadline_ms = now + r.max_wait_ms
  r.state = 'queued'
  redis.call('HSET', P_REQUEST .. r.id, 'state', 'queued', 'worker', '', 'deadline_ms', r.deadline_ms)
  enqueue(p, r)
  keep_alive(p, r.id, r.deadline_ms, now)
  redis.call('HINCRBY', K_STATS, r.class .. '.requeued', 1)
  wake_workers()
end

-- Queued requests past their max wait: removed, refunded in full, their client told.
local function expire_overdue(p, now, limit)
  if limit <= 0 then return 0 end
  local ids = redis.call('ZRANGEBYSCORE', K_DEADLINES, '-inf', now, 'LIMIT', 0, limit)
  local expired = 0
  for _, id in ipairs(ids) do
    local r = load_request(id)
    if r and r.state == 'queued' then
      expire_queued(p, r, now)
      expired = expired + 1
    else
      redis.call('ZREM', K_DEADLINES, id)
    end
  end
  return expired
end

-- Leases past their deadline: the worker is presumed dead. Requeue, or fail after
-- max_attempts, or finish the cancellation the dead worker never acknowledged.
local function reap_leases(p, now, limit)
  local requeued, failed, cancelled = 0, 0, 0
  if limit <= 0 then return requeued, failed, cancelled end
  local ids = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'LIMIT', 0, limit)
  for _, id in ipairs(ids) do
    local r = load_request(id)
    if r == nil or r.state ~= 'leased' then
      redis.call('ZREM', K_LEASES, id)
    elseif r.cancel == 1 or not frontend_alive(p, r.frontend, now) then
      cancel_orphan(p, r, now, 'its lease expired and its client frontend went away')
      cancelled = cancelled + 1
    elseif r.attempts >= p.max_attempts then
      local why = 'worker lease expired on all ' .. r.attempts .. ' attempts'
      finalize(p, r, 'failed', why, actual_cost(r, r.input_tokens, r.out_tokens), now)
      notify(r, {'k', 'err', 'code', 'failed', 'msg', why})
      add_sample(p, r, 'failed', now)
      failed = failed + 1
    else
      requeue(p, r, now)
      requeued = requeued + 1
    end
  end
  return requeued, failed, cancelled
end
