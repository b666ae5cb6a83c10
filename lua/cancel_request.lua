-- cancel_request: a client went away (or its deadline passed before any worker took
-- the request). Removes the request wherever it is: a queued request is finished now
-- and refunded in full; a leased one is flagged so its worker stops it between steps.
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; limiter/scripts.py lifecycle_keys).
-- ARGV[1] request_id  name
-- ARGV[2] tenant      name: must own the request (a tenant cannot cancel another's)
-- ARGV[3] reason      client_gone | expired | shutdown
--
-- 'expired' only acts on a queued request (a claimed one is running in time).
-- Returns {'cancelled'} | {'expired'} | {'cancelling'} | {'running'} | {'final', state}
-- | {'not_found'}. Errors: 'BADARG ...', 'NOPOLICY ...'.

--!flags allow-oom
--!include validate.lua
--!include policy.lua
--!include record.lua
--!include finish.lua

local function main()
  local request_id = arg_name(ARGV[1], 'request_id')
  local tenant = arg_name(ARGV[2], 'tenant')
  local reason = arg_oneof(ARGV[3], 'reason', {'client_gone', 'expired', 'shutdown'})
  local p = load_policy(K_POLICY)
  local r = load_request(request_id)
  if r == nil or r.tenant ~= tenant then return {'not_found'} end
  local now = now_ms()
  if r.state == 'queued' then
    if reason == 'expired' then
      local waited = now - r.enq_ms
      finalize(p, r, 'expired', 'max queue wait passed after ' .. waited .. ' ms', 0, now)
      add_sample(p, r, 'expired', now)
      return {'expired'}
    end
    finalize(p, r, 'cancelled', reason, 0, now)
    add_sample(p, r, 'cancelled', now)
    return {'cancelled'}
  elseif r.state == 'leased' then
    if reason == 'expired' then return {'running'} end
    redis.call('HSET', P_REQUEST .. request_id, 'cancel', 1)
    redis.call('SADD', K_CANCELS, request_id)
    return {'cancelling'}
  end
  return {'final', r.state}
end

--!include main.lua
