-- The served ledger (K_SERVED): per class, the reserved cost claim handed out, settled to
-- what each request really used when it ends (served_settle), decayed with the pool's
-- floor_half_life_ms, and .ts, the time it was decayed to (a field no class can have: class
-- names have no dots). A ledger S with half-life h stands for a service rate S ln2 / h.
-- A class a deploy removed keeps its entry, decayed and settled like the others: written
-- for the policy's classes alone, it stood still while .ts moved on, and a class restored
-- later came back with its service of the day it left, decayed only from then on.
--!include pool_keys.lua
--!include validate.lua

-- The ledger as stored: {class = cost}, and the ms it was decayed to (`now` when it has none).
local function read_served(now)
  local sv = redis.call('HGETALL', K_SERVED)
  local served, ts = {}, now
  for i = 1, #sv, 2 do
    if sv[i] == '.ts' then ts = tonumber(sv[i + 1]) else served[sv[i]] = tonumber(sv[i + 1]) end
  end
  return served, ts
end

-- The ledger a call works on (served_open_ledger), when the script running keeps one: {served
-- = {class = cost}, total = their sum, now = the ms they are decayed to, dirty = settled
-- since read}. A claim keeps the ledger in this table and writes it whole at its end, so a
-- request it finishes meanwhile (an expiry, an orphan) is settled here, not in Redis (where
-- the claim's own write would undo it); a completion of several requests settles them all
-- here and writes once (settled one by one, a read and a write each, a merged call of 8
-- ran 9.9 % more instructions; in one read and one write, 3.7 %).
local served_open = nil

-- Open the ledger for this call (read once; served_write at the end): decayed to `now` (a
-- claim, which charges it), or with `now` nil as stored, settled from its own time (a
-- completion: the same ledger whatever the moment, as separate calls leave it); nil when
-- there is none to settle (lost with a Redis restart).
local function served_open_ledger(p, now)
  local served, ts = read_served(now)
  if now == nil then
    if ts == nil then return nil end
    now = ts
  end
  local decay = 0.5 ^ (math.max(now - ts, 0) / p.floor_half_life_ms)
  for cls, v in pairs(served) do served[cls] = v * decay end  -- a removed class's too
  local total = 0  -- (the floors compare the policy's classes only)
  for _, cls in ipairs(p.classes) do
    served[cls] = served[cls] or 0
    total = total + served[cls]
  end
  served_open = {served = served, total = total, now = now, dirty = false}
  return served_open
end

-- A removed class's entry decayed below this (weighted tokens) is dropped: a class renamed by
-- a deploy leaves nothing behind for good (from a million tokens, ~50 half-lives).
local SERVED_GONE = 1e-9

-- Write the open ledger whole (every class it holds), with the time it is decayed to.
local function served_write(p, ledger)
  local fields, gone = {'.ts', ledger.now}, {}
  for cls, v in pairs(ledger.served) do
    if p.class[cls] == nil and v < SERVED_GONE then
      gone[#gone + 1] = cls
    else
      fields[#fields + 1] = cls
      fields[#fields + 1] = fmt(v)
    end
  end
  redis.call('HSET', K_SERVED, unpack(fields))
  if #gone > 0 then redis.call('HDEL', K_SERVED, unpack(gone)) end
end

-- Settle a finished request's entry in the ledger: its first claim charged its reservation
-- (`cost`, at `claimed_ms`), and it used `used`; the difference is applied as the charge
-- has decayed since (never below 0). Left at the reservation, a tenant's request that
-- reserved a context and stopped (or was cancelled) after a token counted as that much
-- service to its class: a few such requests a half-life lifted a class above its starvation
-- floor (and inflated the served rates admission subtracts from the spare capacity), while
-- the class's other tenants were served nothing (found by an adversarial review).
local function served_settle(p, cls, used, cost, claimed_ms)
  if claimed_ms == nil or used == cost then return end
  local h = p.floor_half_life_ms
  local o = served_open
  if o then
    local old = o.served[cls] or 0
    local new = math.max(old + (used - cost) * 0.5 ^ (math.max(o.now - claimed_ms, 0) / h), 0)
    o.served[cls], o.dirty = new, true
    if p.class[cls] then o.total = o.total + new - old end
    return
  end
  local v = redis.call('HMGET', K_SERVED, cls, '.ts')
  local ts = tonumber(v[2])
  if ts == nil then return end  -- no ledger (lost with a Redis restart): nothing to settle
  local amount = (used - cost) * 0.5 ^ (math.max(ts - claimed_ms, 0) / h)
  redis.call('HSET', K_SERVED, cls, fmt(math.max((tonumber(v[1]) or 0) + amount, 0)))
end
