-- Request records: HASH req:<id>, and the STRING gen:<id> of its generated token ids: how
-- they are read, how long they live, what a request's usage costs.
--!include pool_keys.lua

local REQ_FIELDS = {'id', 'tenant', 'class', 'state', 'frontend', 'attempts', 'fence', 'worker',
  'lease_ms', 'enq_ms', 'seq', 'deadline_ms', 'max_wait_ms', 'claimed_ms', 'first_ms',
  'input_tokens', 'max_tokens', 'w_in', 'w_out', 'cost', 't_rate', 't_burst', 't_weight',
  'c_tenant', 'c_class', 'c_ceil', 'c_vtc', 'out_tokens', 'cancel', 'ceil_out'}
local REQ_NUMERIC = {attempts = true, fence = true, lease_ms = true, enq_ms = true, seq = true,
  deadline_ms = true, max_wait_ms = true, claimed_ms = true, first_ms = true, input_tokens = true,
  max_tokens = true, w_in = true, w_out = true, cost = true, t_rate = true, t_burst = true,
  t_weight = true, c_tenant = true, c_class = true, c_ceil = true, c_vtc = true,
  out_tokens = true, cancel = true}

-- What a worker's fenced calls read of a record, each only what it uses (a field fewer is
-- ~2.2k instructions of an HMGET a request, callgrind), in the order include/lease.lua reads
-- them: the lease check's three (state, worker, fence) first.
-- push_tokens: not first_ms -- the first push writes it with out_tokens, and nothing else
-- writes out_tokens before the request ends, so out_tokens present means first_ms present
-- (the model test checks it on every queued and leased record); not cancel -- the worker
-- asks the cancels set for everything it holds (limiter/scripts.py Pushed).
local PUSH_FIELDS = {'state', 'worker', 'fence', 'frontend', 'out_tokens', 'max_tokens'}
-- renew_leases: whether to tell the worker to stop (cancel, or a frontend gone), and whether
-- its class's ceiling is charged as it is served, or binds now (include/ceiling.lua).
local RENEW_FIELDS = {'state', 'worker', 'fence', 'frontend', 'cancel', 'enq_ms', 'ceil_out', 'class'}

-- A record's ceil_out (include/ceiling.lua): '<n>' for a request its claim marked, n the output
-- tokens its ceiling was charged as delivered; '<n>@<m>' for one a renewal marked late, after
-- its m-th output token (what it used until then never charged). Returns n and m (m nil: its
-- claim marked it; both nil: no mark). An older release reads '<n>@<m>' as no mark (tonumber
-- gives nil) and charges the request nothing more: read as '<n>', its renewals, requeue and
-- end charged all it had used before the mark at once (a review of the late mark).
local function parse_ceil_out(raw)
  if not raw then return nil, nil end
  local n = tonumber(raw)
  if n then return n, nil end
  local charged, from = string.match(raw, '^(%d+)@(%d+)$')
  return tonumber(charged), tonumber(from)
end

-- The record of request `id` (nil when there is none): the fields `fields` (default: all of
-- REQ_FIELDS; must include state), numbers as numbers; an absent counter reads as 0; ceil_out
-- parsed (parse_ceil_out: r.ceil_out, r.ceil_from).
local function load_request(id, fields)
  fields = fields or REQ_FIELDS
  local v = redis.call('HMGET', P_REQUEST .. id, unpack(fields))
  local r = {}
  for i, f in ipairs(fields) do
    local x = v[i]
    if x and REQ_NUMERIC[f] then x = tonumber(x) end
    if x == false then x = nil end
    r[f] = x
  end
  if r.state == nil then return nil end
  r.id = id
  r.attempts = r.attempts or 0
  r.fence = r.fence or 0
  r.out_tokens = r.out_tokens or 0
  r.cancel = r.cancel or 0
  r.worker = r.worker or ''
  r.t_weight = r.t_weight or 1
  r.c_tenant, r.c_class, r.c_ceil, r.c_vtc = r.c_tenant or 0, r.c_class or 0, r.c_ceil or 0, r.c_vtc or 0
  r.ceil_out, r.ceil_from = parse_ceil_out(r.ceil_out)
  return r
end

-- An unfinished request's record (and token string) lives until `until_ms`, the latest time
-- its request can still be waiting for (its queue deadline, or its lease's end), plus a
-- week: long enough for a janitor to finish it, never forever. Not plus record_ttl_s (how
-- long a *finished* record is kept, 300 s by default): when every frontend, worker and
-- controller was down for longer than that, the records of the requests still queued or
-- leased expired before any janitor ran, and it could only drop their index entries --
-- their tenants' in-flight counts and the queued costs were never given back (a tenant
-- with a max_inflight cap was refused as busy for good). A push moves a lease on without
-- this (push_tokens.lua): the margin is then a week less the time since the last claim or
-- renewal, which a worker holding the lease makes every lease_ms / 3.
-- `no_tokens`: the request has delivered no token yet (out_tokens = 0), so it has no token
-- string (push_tokens writes the string and out_tokens together, and gives a string it
-- creates a TTL of its own): one command less for admit and a first claim.
local LIVE_RECORD_GRACE_MS = 7 * 86400 * 1000
local function keep_alive(p, id, until_ms, now, no_tokens)
  local ttl = math.max(until_ms - now, 0) + LIVE_RECORD_GRACE_MS
  redis.call('PEXPIRE', P_REQUEST .. id, ttl)
  if not no_tokens then redis.call('PEXPIRE', P_TOKENS .. id, ttl) end
end

-- Weighted cost of what a request really used.
local function actual_cost(r, in_tokens, out_tokens)
  return in_tokens * r.w_in + out_tokens * r.w_out
end

-- What an end that no worker reported (an expiry, a cancel, a refusal, a lease given up)
-- charges a request: its prompt and the tokens delivered so far while a worker holds it,
-- or once an attempt delivered tokens (a request requeued after serving some, then
-- cancelled or expired, was refunded as if nothing had been used: its client's tokens were
-- free to its tenant); nothing while it is queued with nothing delivered (never taken, or
-- handed back unstarted by a draining worker: that attempt is given back).
local function used_cost(r)
  if r.state == 'leased' or r.out_tokens > 0 then return actual_cost(r, r.input_tokens, r.out_tokens) end
  return 0
end
