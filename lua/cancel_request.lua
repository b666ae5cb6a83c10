-- cancel_request: a client went away (or its deadline passed before any worker took
-- the request). Removes the request wherever it is: a queued request is finished now
-- and refunded what it did not use (all of it unless an earlier attempt delivered tokens
-- before it was requeued: record.lua used_cost); a leased one is flagged so its worker stops it
-- between steps.
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
--!include pool_keys.lua
--!include validate.lua
--!include policy.lua
--!include record.lua
--!include lease.lua
--!include finish.lua
--!include expire.lua

local function main()
  local request_id = arg_name(ARGV[1], 'request_id')
  local tenant = arg_name(ARGV[2], 'tenant')
  local reason = arg_oneof(ARGV[3], 'reason', {'client_gone', 'expired', 'shutdown'})
  local p = load_policy(K_POLICY)
  local r = load_request(request_id)
  if r == nil or r.tenant ~= tenant then return {'not_found'} end
  local now = now_ms()
  if r.state == 'queued' then
    -- the frontend asked: it tells its client itself
    if reason == 'expired' then
      expire_queued(p, r, now, false)
      return {'expired'}
    end
    finish_by_redis(p, r, 'cancelled', reason, used_cost(r), now, nil)
    return {'cancelled'}
  elseif r.state == 'leased' then
    if reason == 'expired' then return {'running'} end
    flag_cancel(request_id)
    return {'cancelling'}
  end
  return {'final', r.state}
end

--!include main.lua
