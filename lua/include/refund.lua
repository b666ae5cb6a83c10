-- Refunds: what a finished request reserved but did not use goes back where it was charged.
--!include pool_keys.lua
--!include bucket.lua
--!include policy.lua
--!include vtc.lua

-- Give back what was reserved but not used. Each bucket (and the tenant's virtual counter)
-- gets at most what it was really charged for this request; the amounts given back are
-- recorded next to the charges (r_tenant <= c_tenant, ...).
local function refund_request(p, r, used, now)
  local unused = math.max(r.cost - used, 0)
  local given = {refund = unused}
  -- the tenant's quota as its bucket was last written under, not the one the request was
  -- admitted under: a quota changed since must not re-cap the bucket
  given.r_tenant = bucket_credit(bucket_get(P_BUCKET .. 'tenant:' .. r.tenant, r.t_rate, r.t_burst, now, true),
    math.min(unused, r.c_tenant))
  local c = p.class[r.class]
  given.r_class, given.r_ceil = 0, 0
  if c then
    if r.c_class > 0 then
      given.r_class = bucket_credit(bucket_get(P_BUCKET .. 'class:' .. r.class, c.rate, c.burst, now),
        math.min(unused, r.c_class))
    end
    if r.c_ceil > 0 then
      given.r_ceil = bucket_credit(bucket_get(P_BUCKET .. 'ceil:' .. r.class, c.ceil, c.ceil_burst, now),
        math.min(unused, r.c_ceil))
    end
  end
  given.r_vtc = 0
  -- a class that has turned to arrival order since the claim keeps no counters: its backlog
  -- scores are seqs, which a refund must not move
  if r.c_vtc > 0 and class_fair(p, r.class) then
    given.r_vtc = vtc_refund(r.class, r.tenant, math.min(unused / r.t_weight, r.c_vtc))
  end
  return given
end
