-- Requeue: a leased request goes back to its tenant's queue (its worker died, or drained).
--!include pool_keys.lua
--!include record.lua
--!include queue.lua
--!include lease.lua
--!include wake.lua

-- Put a leased request back in its tenant's queue, at its original place (seq), with a new
-- deadline of its own max wait (a client's shorter X-QoS-Max-Wait-Ms stays shorter).
local function requeue(p, r, now)
  drop_lease(r)
  r.deadline_ms = now + r.max_wait_ms
  r.state = 'queued'
  redis.call('HSET', P_REQUEST .. r.id, 'state', 'queued', 'worker', '', 'deadline_ms', r.deadline_ms)
  enqueue(p, r)
  keep_alive(p, r.id, r.deadline_ms, now)
  redis.call('HINCRBY', K_STATS, r.class .. '.requeued', 1)
  wake_workers()
end
