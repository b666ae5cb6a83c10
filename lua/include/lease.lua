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

-- For push_tokens, at every push: whether request `id` is leased to this worker with the
-- fence token `fence` (a checked integer argument, as a string), then (when it is) its
-- out_tokens (a string, as stored: '0' when none), max_tokens, started (whether a first
-- token was delivered: out_tokens is set, which the first push writes with first_ms),
-- frontend (nil: none) and the fence as stored. One HMGET and no table (the generic record
-- loader's loop over the fields, and a table per request, were as dear as the HMGET
-- itself: callgrind). The fence is compared as a string first, as push_tokens compares
-- out_tokens: the same digits are the same number, and a string-to-number conversion is two
-- of libc's strtod. The stored strings are canonical (written from numbers), so a caller can
-- pass them on to a reply without formatting them. (The lease check is written out here and
-- in leased_for_renewal: as a function of its own it cost a push ~0.7 %, callgrind.)
local function leased_for_write(id, worker_id, fence)
  local v = redis.call('HMGET', P_REQUEST .. id, unpack(PUSH_FIELDS))
  if v[1] ~= 'leased' or v[2] ~= worker_id then return false end
  if v[3] ~= fence and tonumber(v[3]) ~= tonumber(fence) then return false end
  return true, v[5] or '0', tonumber(v[6]), v[5] ~= false, v[4] or nil, v[3]
end

-- For renew_leases: whether request `id` is leased to this worker with the fence token
-- `fence` (as leased_for_write checks it), then (when it is) its cancel flag (0|1),
-- frontend (nil: none), admission time (enq_ms: liveness.lua frontend_alive), class, the
-- output tokens its ceiling was charged (nil: its ceiling is not charged; include/ceiling.lua)
-- and where a renewal marked it late, after which output token (record.lua parse_ceil_out).
-- One HMGET.
local function leased_for_renewal(id, worker_id, fence)
  local v = redis.call('HMGET', P_REQUEST .. id, unpack(RENEW_FIELDS))
  if v[1] ~= 'leased' or v[2] ~= worker_id then return false end
  if v[3] ~= fence and tonumber(v[3]) ~= tonumber(fence) then return false end
  return true, v[5] == '1' and 1 or 0, v[4] or nil, tonumber(v[6]), v[8], parse_ceil_out(v[7])
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

-- Ask the worker holding the lease to stop the request (its client is gone): the worker
-- finds it in the cancels set (one SMISMEMBER over what it holds, every flush_ms), and
-- renew_leases reports it in its stop list.
local function flag_cancel(id)
  redis.call('HSET', P_REQUEST .. id, 'cancel', 1)
  redis.call('SADD', K_CANCELS, id)
end
