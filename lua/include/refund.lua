-- Refunds: what a finished request reserved but did not use goes back where it was charged;
-- what it used beyond its reservation is charged there too.
--!include pool_keys.lua
--!include bucket.lua
--!include policy.lua
--!include vtc.lua
--!include validate.lua
--!include served.lua
--!include ceiling.lua

-- What a request used beyond its reservation (a model server counted more prompt than the
-- frontend did: text the frontend does not count, such as a message's reasoning, which a
-- chat template may render) is charged where the reservation was: its tenant's bucket, into
-- debt (its next requests wait for it), its class's and ceiling's buckets where they were
-- charged and the class is still in the policy (a class a deploy removed serves no one from
-- its buckets, and they get no refund either), and its tenant's counter in a fair class.
-- Left out, a tenant was charged its reservation for any prompt the model server read (a
-- review). What each took is added to the request's charges (c_tenant, ...; written by
-- finalize with `fields`), and `overrun` records the amount.
local function charge_overrun(p, r, over, now, fields)
  local tenant = bucket_get(P_BUCKET .. 'tenant:' .. r.tenant, r.t_rate, r.t_burst, now, true)
  r.c_tenant = r.c_tenant + bucket_debit(tenant, over)
  local c = p.class[r.class]
  if c and r.c_class > 0 then
    r.c_class = r.c_class + bucket_debit(bucket_get(P_BUCKET .. 'class:' .. r.class, c.rate, c.burst, now), over)
  end
  if c and r.c_ceil > 0 and r.ceil_out == nil then  -- (a marked request's: ceiling_settle)
    r.c_ceil = r.c_ceil + bucket_debit(ceiling_bucket(p, r.class, now), over)
  end
  if r.c_vtc > 0 and class_fair(p, r.class) then
    r.c_vtc = r.c_vtc + vtc_charge(r.class, r.tenant, over / r.t_weight)
  end
  for _, f in ipairs({'overrun', fmt(over), 'c_tenant', fmt(r.c_tenant), 'c_class', fmt(r.c_class),
                      'c_ceil', fmt(r.c_ceil), 'c_vtc', fmt(r.c_vtc)}) do
    fields[#fields + 1] = f
  end
end

-- Give back what was reserved but not used (or charge what was used beyond it:
-- charge_overrun, its record fields appended to `fields`). Each bucket (and the tenant's
-- virtual counter) gets at most what it was really charged for this request; the amounts
-- given back are recorded next to the charges (r_tenant <= c_tenant, ...). The served
-- ledger, charged the reservation at the first claim, is settled to what was used.
local function refund_request(p, r, used, now, fields)
  local unused = math.max(r.cost - used, 0)
  local given = {refund = unused}
  if used > r.cost then charge_overrun(p, r, used - r.cost, now, fields) end
  -- the tenant's quota as its bucket was last written under, not the one the request was
  -- admitted under: a quota changed since must not re-cap the bucket
  given.r_tenant = bucket_credit(bucket_get(P_BUCKET .. 'tenant:' .. r.tenant, r.t_rate, r.t_burst, now, true),
    math.min(unused, r.c_tenant))
  served_settle(p, r.class, used, r.cost, r.claimed_ms)
  local c = p.class[r.class]
  given.r_class, given.r_ceil = 0, 0
  if c then
    if r.c_class > 0 then
      given.r_class = bucket_credit(bucket_get(P_BUCKET .. 'class:' .. r.class, c.rate, c.burst, now),
        math.min(unused, r.c_class))
    end
    if r.ceil_out ~= nil then
      -- charged as it was served (include/ceiling.lua): settled to what it used
      given.r_ceil = ceiling_settle(p, r, used, now, fields)
    elseif r.c_ceil > 0 then
      -- charged its reservation at claim (a claim by an older release)
      given.r_ceil = bucket_credit(ceiling_bucket(p, r.class, now),
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
