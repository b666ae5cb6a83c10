-- The wake list: idle workers block on it, so a request that becomes claimable wakes one.
--!include pool_keys.lua

-- Push a wake marker; the list is kept short (a marker is a hint, not a count).
local function wake_workers()
  if redis.call('LPUSH', K_WAKE, '1') > 64 then redis.call('LTRIM', K_WAKE, 0, 63) end
end
