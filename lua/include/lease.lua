-- Leases: a worker's hold on a request. The lease's end is in the K_LEASES index and the
-- record (lease_ms); its fence token fences every write of the worker; a flag tells the
-- worker to stop between steps.
--!include pool_keys.lua
--!include record.lua

-- What a fenced call of a worker answers when that worker no longer holds the lease.
local LEASE_LOST = {'lost', 'request is not leased to this worker with this fence'}

-- The request `id` when it is leased to this worker with this fence token, else nil: a
-- worker whose lease was taken over (or handed back) cannot write. `fields`: as load_request.
local function leased_request(id, worker_id, fence, fields)
  local r = load_request(id, fields)
  if r ~= nil and r.state == 'leased' and r.worker == worker_id and r.fence == fence then return r end
  return nil
end

-- leased_request(id, worker_id, fence, LEASE_FIELDS) for the calls a worker makes at every
-- push (push_tokens) and renewal (renew_leases): the same table for a request so leased (id
-- and LEASE_FIELDS, numbers as numbers, absent counters 0), else nil. One HMGET and no
-- generic decoding: load_request's loop over the fields and its defaults for fields not
-- asked for were ~2 us a request, a sixth of a request's share of a push.
local function leased_for_write(id, worker_id, fence)
  local v = redis.call('HMGET', P_REQUEST .. id, unpack(LEASE_FIELDS))
  if v[1] ~= 'leased' or v[2] ~= worker_id or tonumber(v[3]) ~= fence then return nil end
  return {id = id, state = 'leased', worker = worker_id, fence = fence, frontend = v[4] or nil,
    out_tokens = tonumber(v[5]) or 0, max_tokens = tonumber(v[6]), first_ms = tonumber(v[7]),
    cancel = tonumber(v[8]) or 0}
end

-- Extend a lease to `until_ms`; the record lives at least that long. `fields`: more
-- (field, value, ...) of the record to set with it, in the same HSET.
local function extend_lease(p, id, until_ms, now, fields)
  redis.call('ZADD', K_LEASES, until_ms, id)
  redis.call('HSET', P_REQUEST .. id, 'lease_ms', until_ms, unpack(fields or {}))
  keep_alive(p, id, until_ms, now)
end

-- The request leaves the lease index and its class's in-flight count.
local function drop_lease(r)
  redis.call('ZREM', K_LEASES, r.id)
  if redis.call('HINCRBY', K_INFLIGHT, r.class, -1) <= 0 then redis.call('HDEL', K_INFLIGHT, r.class) end
end

-- Ask the worker holding the lease to stop the request (its client is gone): renew_leases
-- reports it in its stop list, push_tokens answers cancel = 1.
local function flag_cancel(id)
  redis.call('HSET', P_REQUEST .. id, 'cancel', 1)
  redis.call('SADD', K_CANCELS, id)
end
