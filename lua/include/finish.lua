-- Terminal transitions: a request leaves every index and counter, is refunded, and its
-- record gets its final state and TTL.
--!include pool_keys.lua
--!include validate.lua
--!include queue.lua
--!include lease.lua
--!include refund.lua
--!include notify.lua
--!include samples.lua

-- Move a request to a terminal state: leave every index, refund, release counters, TTL.
-- The record keeps the state it ended from (`ended`: queued or leased), with what it was
-- charged: the ledger's rule reads both (record.lua used_cost). `fields`: more (field,
-- value, ...) of the record to set, in the same HSET (a later `ended` overrides).
local function finalize(p, r, state, reason, used, now, fields)
  local key = P_REQUEST .. r.id
  if r.state == 'queued' then
    dequeue(p, r)
  elseif r.state == 'leased' then
    drop_lease(r)
  end
  if r.cancel == 1 then redis.call('SREM', K_CANCELS, r.id) end  -- flag_cancel sets both
  if redis.call('HINCRBY', K_TENANT_INFLIGHT, r.tenant, -1) <= 0 then
    redis.call('HDEL', K_TENANT_INFLIGHT, r.tenant)
  end
  fields = fields or {}
  local g = refund_request(p, r, used, now, fields)
  -- refund: what the request did not use of its reservation, overrun (when it used more):
  -- what it was charged beyond it (its reconciled charge is cost - refund + overrun); r_*:
  -- what each bucket and the tenant's counter really got back
  redis.call('HSET', key, 'state', state, 'ended', r.state, 'reason', reason, 'finished_ms', now,
    'refund', fmt(g.refund),
    'r_tenant', fmt(g.r_tenant), 'r_class', fmt(g.r_class), 'r_ceil', fmt(g.r_ceil), 'r_vtc', fmt(g.r_vtc),
    unpack(fields))
  -- The prompt is no longer needed (no claim, no resume reads an ended request): kept for
  -- record_ttl_s it was memory no one was charged for (text the count does not cover, such
  -- as an earlier answer's thinking a step engine drops, stored for minutes by requests that
  -- ended at once), and every client's prompt readable in Redis that long.
  redis.call('HDEL', key, 'payload')
  redis.call('EXPIRE', key, p.record_ttl_s)
  -- a token string exists only once a token was delivered (or complete just wrote ids)
  if r.out_tokens > 0 or r.wrote_ids then redis.call('EXPIRE', P_TOKENS .. r.id, p.record_ttl_s) end
  redis.call('HINCRBY', K_STATS, r.class .. '.' .. state, 1)
  r.state = state
  return g
end

-- The code a request failed on its last attempt is told (its lease expired, or its worker
-- handed it back spent, on each): 'exhausted' once two or more attempts failed -- its client
-- is told not to send it again (a prompt that kills workers, resent by an SDK, is tried as
-- often again) -- and 'failed' after one alone (max_attempts 1), which a resend may mend.
local function exhausted_code(r)
  return r.attempts >= 2 and 'exhausted' or 'failed'
end

-- An end decided inside Redis (a max wait passed, a client went away, every attempt's
-- lease expired), not reported by a worker: finalize, then a latency sample with outcome =
-- `outcome`, or state when nil ('refused': a request failed for what it is, which no retry
-- mends -- not a violation of its class's latency targets). `notice` = {code = ..., msg =
-- ...} is sent to the request's frontend as an error, so its client learns at once; nil when
-- the frontend asked for this end itself.
local function finish_by_redis(p, r, state, reason, used, now, notice, outcome, fields)
  finalize(p, r, state, reason, used, now, fields)
  if notice then notify(r.id, r.frontend, nil, 'k', 'err', 'code', notice.code, 'msg', notice.msg) end
  add_sample(p, r, outcome or state, now)
end
