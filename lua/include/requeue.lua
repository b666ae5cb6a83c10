-- Requeue: a leased request goes back to its tenant's queue (its worker died, or drained).
--!include pool_keys.lua
--!include record.lua
--!include queue.lua
--!include lease.lua
--!include wake.lua
--!include finish.lua
--!include ceiling.lua

-- Put a leased request back in its tenant's queue, at its original place (seq), with a new
-- deadline of its own max wait (a client's shorter X-QoS-Max-Wait-Ms stays shorter).
-- Returns true; false when its class is no longer in the pool's policy (a deploy removed or
-- renamed it while the request ran): no claim serves that class, so the request fails now,
-- its client told why, instead of waiting out its max wait in a queue nobody reads.
local function requeue(p, r, now)
  if p.class[r.class] == nil then
    local why = 'its class ' .. r.class .. ' is no longer in the pool configuration'
    finish_by_redis(p, r, 'failed', why, used_cost(r), now,
      {code = 'failed', msg = why})
    return false
  end
  drop_lease(r)
  r.deadline_ms = now + r.max_wait_ms
  r.state = 'queued'
  local fields = {'state', 'queued', 'worker', '', 'deadline_ms', r.deadline_ms}
  if r.ceil_out ~= nil then
    -- the output its worker delivered since its last renewal is charged to its ceiling now,
    -- not at the next worker's first renewal (include/ceiling.lua): left uncharged meanwhile,
    -- its class could start requests its ceiling had no room for
    local charged = ceiling_charge_delivered(function() return p end, r.id, r.ceil_out, r.ceil_from, now)
    for _, f in ipairs(charged or {}) do
      fields[#fields + 1] = f
    end
  end
  redis.call('HSET', P_REQUEST .. r.id, unpack(fields))
  enqueue(p, r)
  keep_alive(p, r.id, r.deadline_ms, now, r.out_tokens == 0)
  redis.call('HINCRBY', K_STATS, r.class .. '.requeued', 1)
  wake_workers()
  return true
end
