-- Latency samples: the K_SAMPLES stream (msgpack in field d) the controller and the
-- operators' tools read.
--!include pool_keys.lua
--!include msgpack.lua

-- Append one msgpack-encoded sample (a worker's, or one made by add_sample).
local function append_sample(blob)
  redis.call('XADD', K_SAMPLES, 'MAXLEN', '~', SAMPLES_MAXLEN, '*', 'd', blob)
end

-- A sample for outcomes decided inside Redis (expired, cancelled, failed by lease loss,
-- refused by claim: a prompt no worker of the pool can hold).
local function add_sample(p, r, outcome, now)
  local s = {v = 1, pool = p.name, class = r.class, tenant = r.tenant, outcome = outcome,
    request_id = r.id, worker = r.worker or '', input_tokens = r.input_tokens,
    output_tokens = r.out_tokens or 0, e2e_ms = now - r.enq_ms, ts_ms = now}
  if r.claimed_ms then s.queue_wait_ms = r.claimed_ms - r.enq_ms else s.queue_wait_ms = now - r.enq_ms end
  if r.first_ms then s.ttft_ms = r.first_ms - r.enq_ms end
  local c = p.class[r.class]
  if outcome == 'expired' and not r.first_ms and c and c.max_wait_ms and r.max_wait_ms
      and r.max_wait_ms < c.max_wait_ms then
    -- Its client shortened its wait (X-QoS-Max-Wait-Ms): no miss of the class's own wait,
    -- only a bound on its first token, which the controller judges against the TTFT target.
    s.ttft_at_least_ms = now - r.enq_ms
  end
  append_sample(msgpack_map(s))
end
