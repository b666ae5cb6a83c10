-- A binding ceiling is charged as its class is served, not as it reserves. The ceiling is
-- the controller's hard limit on a class (claim.lua: a class whose ceiling bucket is empty is
-- not dispatched). Charged a request's whole reservation at its first claim, one request
-- that reserved a context (max_tokens 16,000) and used a few hundred tokens put the bucket
-- that deep in debt, and the class's other tenants waited until it ended (3.8 s against
-- 0.07 s on a stack: an adversarial-tenant review). Charged its prompt alone, a class started
-- as many requests as the bucket had prompts for, 40 at once where the reservation let 1
-- start, and ran at many times its ceiling until their output was charged (a review of that
-- first version). So a request is charged what it used so far plus output charged ahead, what
-- it may deliver before it is charged again: at its first claim under a binding ceiling, its
-- prompt and min(max_tokens, A) output tokens, A the pool's ceil_ahead (the record is
-- marked: ceil_out = the output tokens charged as delivered, 0); at each renewal of its lease
-- (renew_leases, every lease_ms / 3 of a running worker), the output delivered since, so that
-- it holds again its prompt, what it delivered and min(the rest of max_tokens, A); at its end,
-- what it used (into debt, or given back up to the burst: refund.lua). A request holds at most
-- its prompt and A output tokens of the ceiling beyond what it used, and over time the bucket
-- is charged exactly what the class used.
-- A request claimed while its ceiling did not bind (the controller cut it since) is marked at
-- its first renewal under the binding ceiling (ceiling_mark; requeued, at its re-claim under
-- it: claim.lua), ceil_out = '<n>@<m>', m the output tokens it had delivered then (record.lua
-- parse_ceil_out): what it used until then, its prompt and m tokens, is never charged -- the
-- ceiling did not hold the class then -- and from then on it holds and is charged the output
-- it delivers after the m-th token as above.
-- Left unmarked, it was never charged, and a cut ceiling held only its class's new requests
-- while its running ones (a long generation runs for minutes) went on past it.
--!include pool_keys.lua
--!include validate.lua
--!include bucket.lua
--!include policy.lua

local function ceiling_bucket(p, cls, now)
  local c = p.class[cls]
  return bucket_get(P_BUCKET .. 'ceil:' .. cls, c.ceil, c.ceil_burst, now)
end

-- A policy written by an older release has no ceil_ahead: the default of PoolConfig.
local DEFAULT_CEIL_AHEAD = 256

-- What a request holds of its ceiling with `out` output tokens charged as delivered: its
-- prompt, those tokens and the output charged ahead of the rest (weighted tokens); marked
-- late after its `from`-th token (nil: at its claim), the tokens after it and the output ahead.
local function ceiling_hold(p, input_tokens, w_in, max_tokens, w_out, out, from)
  local ahead = math.max(math.min(max_tokens - out, p.ceil_ahead or DEFAULT_CEIL_AHEAD), 0)
  if from then return (out - from + ahead) * w_out end
  return input_tokens * w_in + (out + ahead) * w_out
end

-- A record's ceil_out: `out` tokens charged as delivered, marked late after token `from`.
local function ceil_out_text(out, from)
  if from then return fmt(out) .. '@' .. fmt(from) end
  return fmt(out)
end

-- For claim: charge the claim's bucket `h` (written with its others) for request `r`
-- (input_tokens, max_tokens, out_tokens), never charged to its ceiling, of weights w_in and
-- w_out: with nothing delivered (a first claim, or a re-claim of a request handed back
-- unstarted) marked at its claim, its prompt and the output ahead; else marked late after its
-- output. Returns what it was charged and its ceil_out.
local function ceiling_charge_claimed(p, h, r, w_in, w_out)
  local from = r.out_tokens > 0 and r.out_tokens or nil
  local hold = ceiling_hold(p, r.input_tokens, w_in, r.max_tokens, w_out, r.out_tokens, from)
  return bucket_debit(h, hold, nil), ceil_out_text(r.out_tokens, from)
end

-- For renew_leases and requeue: charge request `id` (its record marked, `charged_out` output
-- tokens charged so far) the output it delivered since, and keep as much charged ahead.
-- `policy`: a function returning the pool's policy (read only when a charge may be due).
-- Returns the record fields to set (c_ceil, ceil_out) or nil when nothing is due: nothing
-- delivered since, or its class is gone from the policy (a deploy removed it: its buckets
-- serve no one).
local function ceiling_charge_delivered(policy, id, charged_out, from, now)
  local v = redis.call('HMGET', P_REQUEST .. id, 'out_tokens', 'class', 'c_ceil', 'input_tokens', 'w_in',
    'max_tokens', 'w_out')
  local out = tonumber(v[1]) or 0
  if out <= charged_out then return nil end
  local p = policy()
  if p.class[v[2]] == nil then return nil end
  local held = tonumber(v[3]) or 0
  -- (never below what it holds: a charge ahead a deploy lowered since is given back at the end)
  local due = ceiling_hold(p, tonumber(v[4]), tonumber(v[5]), tonumber(v[6]), tonumber(v[7]), out, from)
    - held
  local taken = bucket_debit(ceiling_bucket(p, v[2], now), due, nil)
  return {'c_ceil', fmt(held + taken), 'ceil_out', ceil_out_text(out, from)}
end

-- For renew_leases: mark request `id` of class `cls` (not marked), if its ceiling was never
-- charged (c_ceil 0: claimed while it did not bind; an older release's claim charged some its
-- reservation) and binds now, after the output it delivered so far: it is charged the output
-- ahead. Returns the record fields to set, or nil (nothing to mark: charged, the ceiling does
-- not bind, or the class is gone from the policy).
local function ceiling_mark(policy, id, cls, now)
  local v = redis.call('HMGET', P_REQUEST .. id, 'c_ceil', 'out_tokens', 'max_tokens', 'w_out')
  if (tonumber(v[1]) or 0) ~= 0 then return nil end
  local p = policy()
  local c = p.class[cls]
  if c == nil or not ceiling_binds(p, c) then return nil end
  local out = tonumber(v[2]) or 0
  -- (marked after its `out`-th token, it holds the output ahead alone: its prompt is not read)
  local due = ceiling_hold(p, 0, 0, tonumber(v[3]), tonumber(v[4]), out, out)
  local taken = bucket_debit(ceiling_bucket(p, cls, now), due, nil)
  return {'c_ceil', fmt(taken), 'ceil_out', ceil_out_text(out, out)}
end

-- At a marked request's end (refund.lua): what it used, less what the ceiling was charged, is
-- charged (into debt) or given back (at most what was charged). Returns what was given back;
-- a charge is added to r.c_ceil and to `fields` (the record's last write). Marked late, what
-- it used is the output it delivered after its mark: its prompt was read before, all of it,
-- whatever its engine counted (more, it was charged to the ceiling; fewer, or none for a
-- request stopped or handed back before its prefill, a base taken from its use let the
-- ceiling get back more than it was charged: a review of the late mark).
local function ceiling_settle(p, r, used, now, fields)
  local h = ceiling_bucket(p, r.class, now)
  if r.ceil_from then used = math.max(r.out_tokens - r.ceil_from, 0) * r.w_out end
  if used <= r.c_ceil then return bucket_credit(h, r.c_ceil - used) end
  r.c_ceil = r.c_ceil + bucket_debit(h, used - r.c_ceil, nil)
  fields[#fields + 1] = 'c_ceil'
  fields[#fields + 1] = fmt(r.c_ceil)
  return 0
end
