-- Token buckets: a hash with fields tokens (may be negative: debt), ts (ms) and a ledger
-- (start, refilled, debited, refunded) such that, always,
--     tokens = start + refilled - debited + refunded,   refunded <= debited
-- where refilled is what time added (net of the cap at burst), debited what charges really
-- took (after any debt limit) and refunded what refunds really gave back (after the cap).
-- A bucket that does not exist yet is full (start = burst). It also keeps the rate and burst
-- it was last written under: a refund uses them, not those its request was admitted under
-- (a tenant whose quota was raised since was cut back to the old burst by every refund).
-- A ts ahead of now (Redis' clock stepped back) is rebased on the first read: else nothing
-- refilled a bucket that was only read (a refused admit, an empty claim) for the whole step.
--
-- Every bucket a call touches goes through one cache, so two uses in the same call (a
-- refund inside claim's janitor, then a charge) see each other; the cache is written back
-- once, when main() ends (main.lua runs AT_EXIT, after an error too), or when a use asks for
-- the bucket with another rate or burst (then read again).
--!include validate.lua

local BUCKETS = {}

local function bucket_write(b)
  if b.dirty then  -- a bucket only read is not written: its refill is recomputed next time
    local f = {'tokens', fmt(b.level), 'ts', fmt(b.now), 'refilled', fmt(b.refilled),
      'debited', fmt(b.debited), 'refunded', fmt(b.refunded), 'rate', fmt(b.rate), 'burst', fmt(b.burst)}
    if b.fresh then f[#f + 1] = 'start'; f[#f + 1] = fmt(b.start) end
    redis.call('HSET', b.key, unpack(f))
  end
end

-- `stored`: use the rate and burst the bucket was last written under (those of this call if
-- it used the bucket already), `rate` and `burst` only for a bucket that has none (a refund:
-- the quota may have changed since its request was admitted).
local function bucket_get(key, rate, burst, now, stored)
  local b = BUCKETS[key]
  if b and (stored or (b.rate == rate and b.burst == burst)) then return b end
  if b then
    -- Used again in this call with another rate or burst (two requests of one tenant
    -- admitted in one call under two configurations): written back now and read again, as a
    -- call of its own would find it at this same time.
    bucket_write(b)
  end
  local v = redis.call('HMGET', key, 'tokens', 'ts', 'start', 'refilled', 'debited', 'refunded', 'rate', 'burst')
  if stored then rate, burst = tonumber(v[7]) or rate, tonumber(v[8]) or burst end
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  b = {key = key, rate = rate, burst = burst, now = now, dirty = false}
  if tokens == nil or ts == nil then
    b.fresh, b.start, b.level, b.refilled, b.debited, b.refunded = true, burst, burst, 0, 0, 0
  else
    b.start = tonumber(v[3]) or tokens
    b.refilled, b.debited, b.refunded = tonumber(v[4]) or 0, tonumber(v[5]) or 0, tonumber(v[6]) or 0
    local level = tokens + rate * math.max(now - ts, 0) / 1000
    -- the cap; a level above a burst that was lowered since comes down to it too
    if level > burst then level = burst end
    b.refilled = b.refilled + (level - tokens)
    b.level = level
    if now < ts then b.dirty = true end  -- the clock stepped back: written at now, ts rebased
  end
  BUCKETS[key] = b
  return b
end

-- Take `amount`; the level never sinks below `debt_limit` (the lowest level the bucket may
-- reach, e.g. -burst; nil: debt without bound). Returns what was really taken, which is
-- what the caller must record as charged.
local function bucket_debit(b, amount, debt_limit)
  if amount <= 0 then return 0 end
  local new = b.level - amount
  if debt_limit ~= nil and new < debt_limit then new = math.min(b.level, debt_limit) end
  local taken = b.level - new
  b.level, b.debited, b.dirty = new, b.debited + taken, true
  return taken
end

-- Give back up to `amount` (a refund), never beyond the burst. Returns what was given back.
local function bucket_credit(b, amount)
  if amount <= 0 then return 0 end
  local new = math.min(b.level + amount, math.max(b.burst, b.level))
  local given = new - b.level
  b.level, b.refunded, b.dirty = new, b.refunded + given, true
  return given
end

-- Milliseconds until a bucket at `level` holds `need` tokens, refilling at `rate`/s; -1 never.
-- At most MAX_WAIT_MS (over 31,000 years): a script's number reply is an int64, and a longer
-- wait (a tiny rate, deep debt) came back as -2^63, which reads as -1.
local MAX_WAIT_MS = 1e15
local function bucket_wait_ms(level, need, rate)
  if level >= need then return 0 end
  if rate <= 0 then return -1 end
  return math.min(math.ceil((need - level) * 1000 / rate), MAX_WAIT_MS)
end

local function bucket_flush()
  for _, b in pairs(BUCKETS) do bucket_write(b) end
  BUCKETS = {}
end
AT_EXIT[#AT_EXIT + 1] = bucket_flush
