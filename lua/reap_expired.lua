-- reap_expired: the janitor. Expires queued requests past their max wait (refund in
-- full, client told) and requeues requests whose worker lease expired (the worker is
-- presumed dead): back to their tenant's queue with the attempt count kept; past
-- max_attempts they fail with a clear reason; if their client is gone they are cancelled.
-- Claim does the same before choosing; workers, the controller and the frontends run this
-- script so that it happens when nobody claims (e.g. no worker is alive).
--
-- Bounded work: at most `limit` (<= 16) entries of each kind per call; the caller calls
-- again while `more` says a kind's sweep read `limit` entries, leaving Redis free for others
-- in between. Stale entries (their request finished or gone) count: a sweep of 16 of them
-- ended nothing, and a caller that judged by the counts stopped with due entries behind.
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; limiter/scripts.py lifecycle_keys).
-- ARGV[1] limit   integer 1..16: at most this many of each kind per call
--
-- Returns {expired, requeued, failed, cancelled, more} (more: 1 when a sweep read `limit`
-- entries, else 0). Errors: 'BADARG ...', 'NOPOLICY ...'.

--!flags allow-oom
--!include pool_keys.lua
--!include validate.lua
--!include policy.lua
--!include janitor.lua

local function main()
  local limit = arg_int(ARGV[1], 'limit', 1, 16)
  local p = load_policy(K_POLICY)
  local now = now_ms()
  local expired, overdue = expire_overdue(p, now, limit)
  local requeued, failed, cancelled, lapsed = reap_leases(p, now, limit)
  local more = (overdue >= limit or lapsed >= limit) and 1 or 0
  return {expired, requeued, failed, cancelled, more}
end

--!include main.lua
