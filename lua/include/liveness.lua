-- Is a frontend (or a worker) alive? Read from the heartbeat ZSETs.
--!include pool_keys.lua

-- A frontend is alive when it beat within frontend_ttl_ms. After a Redis outage every
-- heartbeat is as old as the outage, and the workers and frontends come back in any order;
-- a frontend still holding its clients must not be taken for dead meanwhile:
-- * while NO frontend has beaten within the TTL (Redis, or the frontends' network, was more
--   likely down than every frontend dead at once), a frontend that was alive when the last
--   beat landed counts as alive;
-- * the first frontend to beat again records when the frontends lost Redis (K_OUTAGE, for two
--   TTLs): until it expires, a frontend that was alive then counts as alive, so one that
--   reconnects a moment later than another is not cancelled for it. So does a frontend's
--   first beat ever that finds no frontend beaten within the TTL (it may have started during
--   the outage): the newest beat is when they lost Redis.
-- `admitted_ms`: when the request in question was admitted (its enq_ms). A frontend with no
-- entry at all is dead (pruned long silent, or it left) -- unless that admit was within the
-- TTL: Redis lost its data (a restart without persistence, a flush, a failover to a replica
-- that never saw it) and another role (the controller, another frontend) wrote the policy
-- again first, so this frontend's admit met no NOPOLICY and did not beat before it; its entry
-- was missing until its next beat (up to heartbeat_s) and claim cancelled what it admitted
-- meanwhile as an orphan. An admit is the frontend's proof of life then.
local function frontend_alive(p, frontend, now, admitted_ms)
  local seen = tonumber(redis.call('ZSCORE', K_FRONTENDS, frontend))
  if seen == nil then return admitted_ms ~= nil and admitted_ms >= now - p.frontend_ttl_ms end
  local ttl = p.frontend_ttl_ms
  if seen >= now - ttl then return true end
  local lost = tonumber(redis.call('GET', K_OUTAGE))
  if lost ~= nil and seen >= lost - ttl then return true end
  local newest = tonumber(redis.call('ZRANGE', K_FRONTENDS, -1, -1, 'WITHSCORES')[2])
  return newest < now - ttl and seen >= newest - ttl
end

-- The largest whole KV room (tokens) among the workers in the heartbeat set, beaten within a
-- lease or not (a silent one may be restarting, or beat slower than a lease; a dead one is
-- pruned from the set); entries of workers that left the set are dropped on the way.
-- O(workers of the pool): claim calls it at most once per call, and only for a request that
-- does not fit the claiming worker at all.
local function largest_worker_kv()
  local kv = redis.call('HGETALL', K_WORKER_KV)
  local largest = 0
  for i = 1, #kv, 2 do
    if redis.call('ZSCORE', K_WORKERS, kv[i]) == false then
      redis.call('HDEL', K_WORKER_KV, kv[i])
    else
      largest = math.max(largest, tonumber(kv[i + 1]) or 0)
    end
  end
  return largest
end
