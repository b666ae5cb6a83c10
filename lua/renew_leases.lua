-- renew_leases: extend a worker's leases, and tell it which requests to stop.
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; limiter/scripts.py lifecycle_keys).
-- ARGV[1]  worker_id   name
-- ARGV[2]  lease_ms    integer >= 0, 0 = the pool's lease_ms
-- ARGV[3..] entries    "<request_id>:<fence>" for each request the worker runs (at most 4096)
--
-- A request is extended when it is leased to this worker with that fence. It is "lost"
-- when not (the lease expired and it was requeued or finished): the worker must drop it
-- without writing. It is "stop" when its client went away (cancelled, or its frontend
-- stopped heartbeating): the worker should finish it with outcome cancelled. A request whose
-- class's ceiling is charged as it is served is charged the output it delivered since the
-- last renewal; one never charged is marked, and charged from then on, where its class's
-- ceiling binds now (include/ceiling.lua).
-- Returns {{lost_id, ...}, {stop_id, ...}}. Errors: 'BADARG ...', 'NOPOLICY ...'.

--!include pool_keys.lua
--!include validate.lua
--!include policy.lua
--!include lease.lua
--!include liveness.lua
--!include ceiling.lua

local function main()
  local worker_id = arg_name(ARGV[1], 'worker_id')
  local lease_ms = arg_int(ARGV[2], 'lease_ms', 0, 3600000)
  if #ARGV - 2 > 4096 then fail('BADARG', 'entries: at most 4096 per call') end
  local entries = {}
  for i = 3, #ARGV do
    local id, fence = string.match(ARGV[i], '^([%w_%.%-]+):(%d+)$')
    if id == nil or #id > 64 then fail('BADARG', 'entries: expected <request_id>:<fence>, got ' .. ARGV[i]) end
    entries[#entries + 1] = {id, fence}
  end
  local p = load_pool_fields(K_POLICY, {'lease_ms', 'record_ttl_s', 'frontend_ttl_ms', 'capacity'})
  if lease_ms == 0 then lease_ms = p.lease_ms end
  local now = now_ms()
  local lost, stop = {}, {}
  local policy = nil  -- the whole policy, read when a ceiling charge may be due
  local function whole_policy()
    policy = policy or load_policy(K_POLICY)
    return policy
  end
  -- whether a class's ceiling binds now, from one HMGET of every class's ceiling at the first
  -- request never charged (a class gone from the policy: no): a request of a class whose ceiling
  -- does not bind costs the renewal nothing more (callgrind, 64 held, another class's ceiling
  -- binding: +14 % when each such request's record was read again to find its class)
  local binds = nil
  local function ceiling_binds_now(cls)
    if binds == nil then
      binds = {}
      local names, fields = {}, {}
      for c in string.gmatch(p.classes, '[^,]+') do
        names[#names + 1] = c
        fields[#fields + 1] = c .. '.ceil'
      end
      for i, ceil in ipairs(redis.call('HMGET', K_POLICY, unpack(fields))) do
        binds[names[i]] = (tonumber(ceil) or math.huge) < p.capacity
      end
    end
    return binds[cls] == true
  end
  for _, e in ipairs(entries) do
    local id = e[1]
    local held, cancel, frontend, admitted_ms, cls, ceil_out, ceil_from =
      leased_for_renewal(id, worker_id, e[2])
    if not held then
      lost[#lost + 1] = id
    else
      local charged
      if ceil_out then
        charged = ceiling_charge_delivered(whole_policy, id, ceil_out, ceil_from, now)
      elseif ceiling_binds_now(cls) then
        charged = ceiling_mark(whole_policy, id, cls, now)
      end
      extend_lease(p, id, now + lease_ms, now, charged)
      if cancel ~= 1 and not frontend_alive(p, frontend, now, admitted_ms) then
        flag_cancel(id)
        cancel = 1
      end
      if cancel == 1 then stop[#stop + 1] = id end
    end
  end
  return {lost, stop}
end

--!include main.lua
