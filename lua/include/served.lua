-- The served ledger (K_SERVED): per class, the reserved cost claim handed out, decayed with
-- the pool's floor_half_life_ms, and .ts, the time it was decayed to (a field no class can
-- have: class names have no dots). A ledger S with half-life h stands for a service rate
-- S ln2 / h.
--!include pool_keys.lua

-- The ledger as stored: {class = cost}, and the ms it was decayed to (`now` when empty).
local function read_served(now)
  local sv = redis.call('HGETALL', K_SERVED)
  local served, ts = {}, now
  for i = 1, #sv, 2 do
    if sv[i] == '.ts' then ts = tonumber(sv[i + 1]) else served[sv[i]] = tonumber(sv[i + 1]) end
  end
  return served, ts
end
