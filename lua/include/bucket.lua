-- Token buckets: a hash with fields tokens (may be negative: debt) and ts (ms).
-- A bucket that does not exist yet is full. Needs fmt() from validate.lua.

local function bucket_level(key, rate, burst, now)
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  if tokens == nil or ts == nil then return burst end
  local elapsed = now - ts
  if elapsed < 0 then elapsed = 0 end
  local level = tokens + rate * elapsed / 1000
  if level > burst then level = burst end
  return level
end

-- Milliseconds until a bucket at `level` holds `need` tokens, refilling at `rate`/s.
local function bucket_wait_ms(level, need, rate)
  if level >= need then return 0 end
  if rate <= 0 then return -1 end
  return math.ceil((need - level) * 1000 / rate)
end

-- Store a new level; it never sinks below `floor` (the debt bound) nor rises above `burst`.
local function bucket_store(key, level, now, floor, burst)
  if level < floor then level = floor end
  if level > burst then level = burst end
  redis.call('HSET', key, 'tokens', fmt(level), 'ts', fmt(now))
end

-- Give back `amount` tokens (a refund), never beyond the burst.
local function bucket_refund(key, amount, rate, burst, now)
  if amount <= 0 then return end
  local level = bucket_level(key, rate, burst, now)
  bucket_store(key, level + amount, now, -math.huge, burst)
end
