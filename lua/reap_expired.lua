-- reap_expired: the janitor. Expires queued requests past their max wait (refund in
-- full, client told) and requeues requests whose worker lease expired (the worker is
-- presumed dead): back to the head of their class with the attempt count kept; past
-- max_attempts they fail with a clear reason; if their client is gone they are cancelled.
-- Claim does the same before choosing; this script lets workers and the controller run
-- it when nobody claims (e.g. no worker is alive).
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; PoolKeys.lifecycle_keys()).
-- ARGV[1] limit   integer 1..10000: at most this many of each kind per call
--
-- Returns {expired, requeued, failed, cancelled}. Errors: 'BADARG ...', 'NOPOLICY ...'.

--!include validate.lua
--!include policy.lua
--!include bucket.lua
--!include pool_keys.lua
--!include msgpack.lua
--!include request.lua

local function main()
  local limit = arg_int(ARGV[1], 'limit', 1, 10000)
  local p = load_policy(K_POLICY)
  local now = now_ms()
  local expired = expire_overdue(p, now, limit)
  local requeued, failed, cancelled = reap_leases(p, now, limit)
  return {expired, requeued, failed, cancelled}
end

--!include main.lua
