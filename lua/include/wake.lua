-- The wake list: idle workers block on it, so a request that becomes claimable wakes one.
--!include pool_keys.lua

-- Push `n` wake markers (default 1), one per request made claimable, so that as many idle
-- workers wake as a call of one request each would wake; the list is kept short (a marker
-- is a hint, not a count).
local function wake_workers(n)
  local markers = {}
  for i = 1, math.min(n or 1, 64) do markers[i] = '1' end
  if redis.call('LPUSH', K_WAKE, unpack(markers)) > 64 then redis.call('LTRIM', K_WAKE, 0, 63) end
end
