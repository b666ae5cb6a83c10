-- A binding ceiling is charged as its class is served, not as it reserves. The ceiling is
-- the controller's hard limit on a class (claim.lua: a class whose ceiling bucket is empty is
-- not dispatched); charged a request's whole reservation at its first claim, one request
-- that reserved a context (max_tokens 16,000) and used a few hundred tokens put the bucket
-- that deep in debt, and the class's other tenants waited until it ended (3.8 s against
-- 0.07 s on a stack: an adversarial-tenant review). So a request's first claim under a
-- binding ceiling charges its prompt (input_tokens x w_in) and marks its record
-- (ceil_out = the output tokens charged so far: 0); each renewal of its lease charges the
-- output delivered since (renew_leases, every lease_ms / 3 of a running worker); its end
-- settles the charge to what it used (refund.lua). The bucket lags the output by at most a
-- renewal period; over time it is charged exactly what the class used.
--!include pool_keys.lua
--!include validate.lua
--!include bucket.lua

local function ceiling_bucket(p, cls, now)
  local c = p.class[cls]
  return bucket_get(P_BUCKET .. 'ceil:' .. cls, c.ceil, c.ceil_burst, now)
end

-- For renew_leases: charge request `id` (its record marked, `charged_out` output tokens
-- charged so far) the output it delivered since. `policy`: a function returning the pool's
-- policy (read only when a charge is due). Returns the record fields to set (c_ceil,
-- ceil_out) or nil when nothing is due: nothing delivered since, or its class is gone from
-- the policy (a deploy removed it: its buckets serve no one).
local function ceiling_charge_delivered(policy, id, charged_out, now)
  local v = redis.call('HMGET', P_REQUEST .. id, 'out_tokens', 'class', 'w_out', 'c_ceil')
  local out = tonumber(v[1]) or 0
  if out <= charged_out then return nil end
  local p = policy()
  if p.class[v[2]] == nil then return nil end
  local taken = bucket_debit(ceiling_bucket(p, v[2], now), (out - charged_out) * tonumber(v[3]), nil)
  return {'c_ceil', fmt((tonumber(v[4]) or 0) + taken), 'ceil_out', fmt(out)}
end

-- At a marked request's end (refund.lua): what it used, less what the ceiling was charged,
-- is charged (into debt) or given back (at most what was charged). Returns what was given
-- back; a charge is added to r.c_ceil and to `fields` (the record's last write).
local function ceiling_settle(p, r, used, now, fields)
  local h = ceiling_bucket(p, r.class, now)
  if used <= r.c_ceil then return bucket_credit(h, r.c_ceil - used) end
  r.c_ceil = r.c_ceil + bucket_debit(h, used - r.c_ceil, nil)
  fields[#fields + 1] = 'c_ceil'
  fields[#fields + 1] = fmt(r.c_ceil)
  return 0
end
