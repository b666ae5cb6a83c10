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
  -- whether any class's ceiling binds now, read (one HMGET) at the first request never charged:
  -- where none does, such requests cost the renewal nothing more (callgrind, 64 held: reading
  -- each one's class and the whole policy was +9 %)
  local any_binds = nil
  local function a_ceiling_binds()
    if any_binds == nil then
      local names = {}
      for c in string.gmatch(p.classes, '[^,]+') do names[#names + 1] = c .. '.ceil' end
      any_binds = false
      for _, ceil in ipairs(redis.call('HMGET', K_POLICY, unpack(names))) do
        if (tonumber(ceil) or math.huge) < p.capacity then any_binds = true end
      end
    end
    return any_binds
  end
  for _, e in ipairs(entries) do
    local id = e[1]
    local held, cancel, frontend, admitted_ms, ceil_out, ceil_from = leased_for_renewal(id, worker_id, e[2])
    if not held then
      lost[#lost + 1] = id
    else
      local charged
      if ceil_out then
        charged = ceiling_charge_delivered(whole_policy, id, ceil_out, ceil_from, now)
      elseif a_ceiling_binds() then
        charged = ceiling_mark(whole_policy, id, now)
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
