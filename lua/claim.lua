-- claim: a worker takes up to N queued requests. This is where shares are decided, because
-- only here is the free capacity known (the worker says how much room it has).
--
-- Which class: the first of these tiers that has a candidate (docs/scheduling.md argues it):
--   1. starvation floors: a backlogged class whose decayed served cost is below its floor
--      (policy field floor, a share) x the decayed total by more than floor_quantum (the
--      largest shortfall first);
--   2. guarantees: the highest-priority backlogged class whose guarantee bucket (rate,
--      burst) holds credit, i.e. that was served less than its rate lately;
--   3. spare: the highest-priority backlogged class.
-- A class whose ceiling binds (ceil < capacity) and whose ceiling bucket is empty is not
-- dispatched at all: the ceiling is a hard limit the controller uses to cut interference.
-- Which tenant: the backlogged tenant of that class with the smallest virtual counter
-- (include/vtc.lua; in a class with fair = 0, the one whose oldest request is oldest);
-- which request: that tenant's oldest.
-- When that request needs more than the worker's free room, its class takes nothing more
-- from this worker in this call (room is gathered for it; other classes go on). One that
-- this worker can never hold is left to a bigger worker of the pool (live, or listed but
-- silent: a slow beat is no death), and fails at once with a clear error when there is none.
--
-- A request's first claim charges its reserved cost to its class's guarantee bucket (when
-- that bucket holds credit), to its ceiling bucket (when the ceiling binds), to its
-- tenant's counter and to the served ledger; what was charged is recorded in the request
-- (c_class, c_ceil, c_vtc) and the request's end refunds at most that. A re-claim (after a
-- requeue) charges nothing again. Each claim gets a fence token from a pool-wide counter:
-- tokens never repeat, so a stale worker's write can never pass for a current one.
--
-- Bounded work: at most 4 expired queue entries and 4 expired leases are swept first, at
-- most MAX_FINISH requests are finished per call, the pick loop runs at most
-- max_requests + MAX_SKIPS + MAX_FINISH times, and the live workers' KV rooms (one read per
-- worker) are read at most once.
--
-- KEYS: the lifecycle key list (include/pool_keys.lua; limiter/scripts.py lifecycle_keys).
-- ARGV[1] worker_id      name
-- ARGV[2] max_requests   integer 1..1024
-- ARGV[3] kv_room        integer >= 0: the worker's free KV room in tokens; a request
--                        needs input_tokens + max_tokens (at most kv_total). 0 = no limit.
-- ARGV[4] lease_ms       integer >= 0, 0 = the pool's lease_ms
-- ARGV[5] above_class    optional class name: only classes ranked strictly above it are
--                        claimed (a full worker's look-ahead for work that would preempt
--                        what it holds); '' or absent = every class. A class the policy
--                        does not know (a rolling deploy that adds or removes one) ranks
--                        above every class it knows: nothing is claimed (never a class
--                        lower than asked)
-- ARGV[6] kv_total       optional integer >= 0: the worker's whole KV room in tokens
--                        (0 or absent = unknown: nothing is judged too large for it)
-- ARGV[7] avoid_tenants  optional comma-separated tenant names (at most 16): tenants whose
--                        requests this claim skips, as if their head did not fit, in the
--                        class avoid_from and every class below it (a full worker's
--                        look-ahead for a tenant that holds none of its slots); '' = none
-- ARGV[8] avoid_from     the highest class avoid_tenants applies to; required with them. A
--                        class the policy does not know ranks above every class it knows:
--                        the tenants are avoided in every class
--
-- Returns {now_ms, backlog, {entry}, ...}; backlog = 1 when requests are still queued after
--   this call (they were announced again on the wake list), else 0 (and the wake list is
--   emptied: its markers announced work that is taken);
--   entry = {id, class, tenant, fence, payload, enq_ms,
--   input_tokens, max_tokens, frontend, out_tokens, generated_token_blob, claimed_ms,
--   first_ms (0 until a first token was delivered), attempt, by_floor (1: picked by its
--   class's starvation floor, tier 1)}; times are Redis server ms.
-- Errors: 'BADARG <field>: ...', 'NOPOLICY ...'.

--!include pool_keys.lua
--!include validate.lua
--!include policy.lua
--!include bucket.lua
--!include record.lua
--!include queue.lua
--!include vtc.lua
--!include liveness.lua
--!include served.lua
--!include ceiling.lua
--!include wake.lua
--!include finish.lua
--!include expire.lua
--!include cancel.lua
--!include janitor.lua

local MAX_FINISH = 16
local MAX_SKIPS = 16
local SWEEP = 4

-- ARGV avoid_tenants: comma-separated tenant names, at most 16. Returns {tenant = true} and
-- the number of entries (the claim looks that many tenants further down a backlog).
local function arg_tenant_set(list)
  local set, n, start = {}, 0, 1
  while true do
    local comma = string.find(list, ',', start, true)
    n = n + 1
    if n > 16 then fail('BADARG', 'avoid_tenants: at most 16 tenants') end
    set[arg_name(string.sub(list, start, (comma or 0) - 1), 'avoid_tenants')] = true
    if comma == nil then return set, n end
    start = comma + 1
  end
end

-- The record fields a claim reads of a queued request it hands out (its payload with them,
-- not in a second command); a request it finishes instead is read whole.
local CLAIM_FIELDS = {'state', 'tenant', 'class', 'frontend', 'attempts', 'enq_ms', 'deadline_ms',
  'claimed_ms', 'first_ms', 'input_tokens', 'max_tokens', 'cost', 't_weight', 'out_tokens', 'payload'}

-- {class = true} for the classes ranked strictly above `cls` or, with `from_it_down`, for
-- `cls` and every class below it. A `cls` the policy does not know (the caller's
-- configuration has a class the policy lacks, or lost one it has: a rolling deploy) has no
-- place in the order; it is taken as ranked above every known class, the placement under
-- which the claim takes least: nothing above it, every class at or below it.
local function class_range(p, cls, from_it_down)
  local rank = p.index[cls] or 0
  local out = {}
  for i, c in ipairs(p.classes) do
    if (i >= rank) == from_it_down then out[c] = true end
  end
  return out
end

local function main()
  local worker_id = arg_name(ARGV[1], 'worker_id')
  local max_requests = arg_int(ARGV[2], 'max_requests', 1, 1024)
  local kv_room = arg_int(ARGV[3], 'kv_room', 0, 1e12)
  local lease_ms = arg_int(ARGV[4], 'lease_ms', 0, 3600000)
  local above_class = ARGV[5] or ''
  if above_class ~= '' then above_class = arg_class_name(above_class, 'above_class') end
  local kv_total = arg_int(ARGV[6] or '0', 'kv_total', 0, 1e12)
  local avoid, navoid, avoid_from = {}, 0, nil
  if (ARGV[7] or '') ~= '' then
    avoid, navoid = arg_tenant_set(ARGV[7])
    avoid_from = arg_class_name(ARGV[8], 'avoid_from')
  end
  local p = load_policy(K_POLICY)
  if lease_ms == 0 then lease_ms = p.lease_ms end
  -- classes this claim may hand out: all, or those ranked above above_class
  local eligible = {}
  if above_class == '' then
    for _, cls in ipairs(p.classes) do eligible[cls] = true end
  else
    eligible = class_range(p, above_class, false)
  end
  -- the classes avoid_tenants applies to: avoid_from and every class below it
  local avoiding = avoid_from and class_range(p, avoid_from, true) or {}
  local now = now_ms()
  if kv_total > 0 then redis.call('HSET', K_WORKER_KV, worker_id, kv_total) end

  local expired = expire_overdue(p, now, SWEEP)
  local rq, fl, cn = reap_leases(p, now, SWEEP)
  local finishes = MAX_FINISH - expired - rq - fl - cn

  -- The served ledger decayed to now, as this call works on it: a request it finishes is
  -- settled in it (include/served.lua), and it is written whole at the end.
  local ledger = served_open_ledger(p, now)
  local served = ledger.served

  local q = queued_counts(p)
  -- a class's guarantee and ceiling buckets, read when first needed: a class with nothing
  -- queued (or not eligible) costs no read
  local guarantee, ceiling = {}, {}  -- class -> bucket; ceiling: false where it does not bind
  local function guarantee_of(cls)
    local g = guarantee[cls]
    if g == nil then
      local c = p.class[cls]
      g = bucket_get(P_BUCKET .. 'class:' .. cls, c.rate, c.burst, now)
      guarantee[cls] = g
    end
    return g
  end
  local function ceiling_of(cls)
    local h = ceiling[cls]
    if h == nil then
      h = ceiling_binds(p, p.class[cls]) and ceiling_bucket(p, cls, now)
      ceiling[cls] = h
    end
    return h
  end
  local skipped = {}   -- class -> {tenant = true}: tenants whose head does not fit this worker
  local nskipped = {}  -- class -> count
  for cls in pairs(avoiding) do  -- the avoided tenants are skipped in these classes
    skipped[cls] = {}
    for t in pairs(avoid) do skipped[cls][t] = true end
    nskipped[cls] = navoid
  end
  local closed = {}    -- class -> true: nothing more of it for this worker in this call
  -- the largest whole KV room of a worker of the pool: read once per call (it reads every
  -- worker's heartbeat), and only when a request does not fit this worker at all
  local largest = nil
  local function largest_kv()
    if largest == nil then largest = largest_worker_kv() end
    return largest
  end
  local function open(cls)
    if not (eligible[cls] and q.n[cls] > 0 and not closed[cls]) then return false end
    local h = ceiling_of(cls)
    return not h or h.level > 0
  end

  local quantum = p.floor_quantum or 0
  local out = {now, 0}  -- now_ms, backlog, then the entries
  local room = kv_room
  local skips = 0
  local loops = 0
  while #out - 2 < max_requests and loops < max_requests + MAX_SKIPS + MAX_FINISH do
    loops = loops + 1
    local pick, best = nil, 0
    for _, cls in ipairs(p.classes) do  -- 1. starvation floors
      local starvation_floor = open(cls) and p.class[cls].floor or 0
      if starvation_floor > 0 then
        local deficit = starvation_floor * ledger.total - served[cls]
        if deficit > quantum and deficit > best then pick, best = cls, deficit end
      end
    end
    local by_floor = pick ~= nil and 1 or 0  -- the worker keeps such a request's slot (docs/worker.md)
    if pick == nil then  -- 2. guarantees
      for _, cls in ipairs(p.classes) do
        if open(cls) and p.class[cls].rate > 0 and guarantee_of(cls).level > 0 then pick = cls break end
      end
    end
    if pick == nil then  -- 3. spare capacity, by priority
      for _, cls in ipairs(p.classes) do
        if open(cls) then pick = cls break end
      end
    end
    if pick == nil then break end

    -- the backlogged tenant with the smallest counter that was not skipped
    local n = nskipped[pick] or 0
    local cand = redis.call('ZRANGE', P_BACKLOG .. pick, 0, n)
    local tenant = nil
    for _, t in ipairs(cand) do
      if not (skipped[pick] and skipped[pick][t]) then tenant = t break end
    end
    local id = tenant and redis.call('ZRANGE', tenant_queue(pick, tenant), 0, 0)[1]
    if tenant == nil then
      closed[pick] = true
    elseif id == nil then
      -- a backlogged tenant without a queue (only after a partial failure): repair it
      local s = redis.call('ZSCORE', P_BACKLOG .. pick, tenant)
      redis.call('ZREM', P_BACKLOG .. pick, tenant)
      if p.class[pick].fair then redis.call('HSET', P_VTIME .. pick, tenant, s) end
    else
      local r = load_request(id, CLAIM_FIELDS)
      -- its max wait passed, or its client's frontend is gone: it ends here, not on a worker
      local ends = r ~= nil and r.state == 'queued'
        and (r.deadline_ms <= now or not frontend_alive(p, r.frontend, now, r.enq_ms))
      if r == nil or r.state ~= 'queued' then
        -- an index entry without a queued record (only after a partial failure): drop it
        redis.call('ZREM', tenant_queue(pick, tenant), id)
        redis.call('ZREM', K_DEADLINES, id)
        if r == nil then
          -- what the index says of it is given back: its class's queued count (its cost is
          -- unknown: an emptied class's is zeroed) and its tenant's unfinished count, whose
          -- slot a max_inflight cap would otherwise refuse for good
          q.n[pick] = q.n[pick] - 1
          if redis.call('HINCRBY', K_QUEUED, pick, -1) <= 0 then redis.call('HSET', K_QUEUED, pick, 0, pick .. '.cost', 0) end
          if redis.call('HINCRBY', K_TENANT_INFLIGHT, tenant, -1) <= 0 then redis.call('HDEL', K_TENANT_INFLIGHT, tenant) end
        end
      elseif ends and finishes <= 0 then
        -- its head needs a finish this call cannot afford: the class waits for the next call,
        -- the others go on (a break here handed out nothing while a dead frontend's requests
        -- headed a class, and idle workers backed off from work that was there)
        closed[pick] = true
      elseif ends then
        finishes = finishes - 1
        r = load_request(id)  -- the whole record: a finish gives back what was charged
        if r.deadline_ms <= now then
          expire_queued(p, r, now, true)
        else
          cancel_orphan(p, r, now, 'its client frontend stopped heartbeating before a worker took it')
        end
        q.n[pick] = q.n[pick] - 1
      else
        local need = r.input_tokens + r.max_tokens
        if kv_total > 0 and need > kv_total then need = kv_total end
        local never = kv_total > 0 and r.input_tokens + 1 > kv_total
        local refuse = never and largest_kv() < r.input_tokens + 1
        if refuse and finishes <= 0 then
          closed[pick] = true  -- as above: refused by a later call, the other classes go on
        elseif refuse then
          finishes = finishes - 1
          local why = 'prompt of ' .. r.input_tokens .. ' tokens does not fit any worker of the pool (largest KV '
            .. 'room: ' .. math.max(kv_total, largest_kv()) .. ' tokens)'
          -- No worker of the pool could ever hold it: refused (its client is told not to retry,
          -- its class's targets do not count it).
          local whole = load_request(id)
          finish_by_redis(p, whole, 'failed', why, used_cost(whole), now, {code = 'too_large', msg = why},
            'refused')
          q.n[pick] = q.n[pick] - 1
        elseif never then
          -- A bigger worker can hold it (a pool of mixed sizes): leave the tenant to it, even
          -- one silent for longer than a lease (restarting, or beating slower than a lease:
          -- judged dead, a live worker's request was failed). A dead one leaves the worker
          -- set within two of its heartbeat TTLs (the workers prune it), and then this fails.
          skipped[pick] = skipped[pick] or {}
          skipped[pick][tenant] = true
          nskipped[pick] = n + 1
          skips = skips + 1
          if skips >= MAX_SKIPS then break end
        elseif kv_room > 0 and need > room then
          -- the class's next request waits for room on this worker: nothing else of its class
          -- jumps ahead of it here (it would starve a large request and break the tenants'
          -- counter order), while other classes go on
          closed[pick] = true
        else
          room = room - need
          dequeue(p, r)
          q.n[pick] = q.n[pick] - 1
          local key = P_REQUEST .. id
          local attempt = r.attempts + 1
          local fence = redis.call('HINCRBY', K_STATS, 'lease_fence', 1)
          local fields = {'state', 'leased', 'worker', worker_id, 'attempts', attempt, 'fence', fence,
            'lease_ms', now + lease_ms}
          if r.claimed_ms == nil then
            -- the first claim: charge the reservation (what is charged is what may be refunded)
            local c = p.class[pick]
            local g, h = guarantee_of(pick), ceiling_of(pick)
            local c_class = g.level > 0 and bucket_debit(g, r.cost, nil) or 0
            local c_ceil = 0
            if h then
              -- a binding ceiling is charged as the request is served (include/ceiling.lua):
              -- its prompt and output charged ahead now, its output as it is delivered
              local w = redis.call('HMGET', key, 'w_in', 'w_out')
              local ceil_out
              c_ceil, ceil_out = ceiling_charge_claimed(p, h, r, tonumber(w[1]), tonumber(w[2]))
              fields[#fields + 1] = 'ceil_out'
              fields[#fields + 1] = ceil_out
            end
            local c_vtc = c.fair and vtc_charge(pick, tenant, r.cost / r.t_weight) or 0
            served[pick] = served[pick] + r.cost
            ledger.total = ledger.total + r.cost
            r.claimed_ms = now
            for _, f in ipairs({'claimed_ms', now, 'c_class', fmt(c_class), 'c_ceil', fmt(c_ceil),
                                'c_vtc', fmt(c_vtc)}) do fields[#fields + 1] = f end
          elseif ceiling_of(pick) then
            -- a re-claim under a binding ceiling of a request never charged to it (claimed while
            -- it did not bind, then requeued: handed back, its lease lost) is marked now, as a
            -- first claim would mark it: nothing delivered, its prompt and the output ahead (it
            -- is all served under the ceiling); else after the output it delivered (a late
            -- mark, include/ceiling.lua). Left to its first renewal, a request handed back
            -- unstarted before a cut had its whole prompt read under the ceiling, never charged.
            local v = redis.call('HMGET', key, 'c_ceil', 'ceil_out', 'w_in', 'w_out')
            if not v[2] and (tonumber(v[1]) or 0) == 0 then
              local c_ceil, ceil_out = ceiling_charge_claimed(p, ceiling_of(pick), r, tonumber(v[3]),
                tonumber(v[4]))
              for _, f in ipairs({'c_ceil', fmt(c_ceil), 'ceil_out', ceil_out}) do
                fields[#fields + 1] = f
              end
            end
          end
          redis.call('HSET', key, unpack(fields))
          keep_alive(p, id, now + lease_ms, now, r.out_tokens == 0)
          redis.call('ZADD', K_LEASES, now + lease_ms, id)
          redis.call('HINCRBY', K_INFLIGHT, pick, 1)
          redis.call('HINCRBY', K_STATS, pick .. '.claimed', 1)
          -- a retried request gets the tokens it delivered before; a first attempt has none
          local gen = r.out_tokens > 0 and redis.call('GET', P_TOKENS .. id) or ''
          out[#out + 1] = {id, pick, tenant, fence, r.payload, r.enq_ms, r.input_tokens, r.max_tokens,
            r.frontend, r.out_tokens, gen, r.claimed_ms, r.first_ms or 0, attempt, by_floor}
        end
      end
    end
  end

  if #out > 2 or ledger.dirty then
    -- An empty claim that settled nothing leaves the ledger as it was: decayed later from
    -- its own .ts, it is the same ledger (the decay is a factor per elapsed ms).
    served_write(p, ledger)
  end
  -- Work left queued is announced again (another worker may hold room for it), and the
  -- caller is told: an empty claim with nothing left queued only consumed a stale marker,
  -- while one that left a backlog (a misfit, a class held by its ceiling) must back off.
  for _, cls in ipairs(p.classes) do
    if q.n[cls] > 0 then out[2] = 1 break end
  end
  if out[2] == 1 then
    wake_workers()
  else
    -- Nothing is queued: every marker left announces work this call (or an earlier one)
    -- took. Dropped, they cannot send another worker to an empty claim.
    redis.call('DEL', K_WAKE)
  end
  return out
end

--!include main.lua
