"""Seeded bugs: break the Lua on purpose, one bug at a time, and check that the tests catch
each one: the model test (tests/test_scheduler_model.py), and the scripts' own tests (claim,
admit, leases, layout). A test that cannot fail proves nothing.

    python -m tests.seeded_bugs            # every bug (about a minute each)
    python -m tests.seeded_bugs refund_x3  # some of them

Each bug is a text replacement in one file of ``lua/``; the file is restored afterwards
whatever happens. Exit status 0 only when every seeded bug made the test fail. Not part of
the default test run (it runs the model test and the script tests once per bug).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LUA = Path(__file__).resolve().parent.parent / "lua"
TEST = "tests/test_scheduler_model.py"
UNIT_TESTS = ("tests/test_claim.py", "tests/test_ceiling_settle.py", "tests/test_admit.py",
              "tests/test_leases.py",
              "tests/test_lua_layout.py", "tests/test_push_tokens.py", "tests/test_init_pool.py",
              "tests/test_policy_packed.py", "tests/test_admit_merged.py",
              "tests/test_complete_merged.py", "tests/test_lua_validate.py",
              "tests/test_publish_compliance.py")


@dataclass(frozen=True)
class Bug:
    name: str
    what: str
    path: str
    old: str
    new: str
    also: tuple[tuple[str, str, str], ...] = ()  # more (path, old, new) edits of the same bug


BUGS = (
    Bug("refund_x3", "every refund gives back 3x what it should",
        "include/refund.lua", "math.min(unused, r.c_tenant))", "3 * math.min(unused, r.c_tenant))"),
    Bug("clamped_debit_nominal_record", "the tenant debit is clamped at -burst but the full cost is "
        "recorded as charged (so refunds can exceed what was taken)",
        "admit.lua", "local charged = bucket_debit(tb, cost, nil)",
        "local charged = cost; bucket_debit(tb, cost, -r.burst)"),
    Bug("admit_checks_as_it_goes", "a merged admit checks each request's arguments only when it "
        "comes to it: the requests before a bad one are admitted, and the call's error reply "
        "hides that they were",
        "admit.lua", "  for k = 1, n do requests[k] = read_request(k) end\n", "",
        also=(("admit.lua", "    out[k] = admit_one(p, requests[k], now)",
               "    requests[k] = read_request(k)\n    requests[k].c = policy_class(p, requests[k].cls)\n"
               "    out[k] = admit_one(p, requests[k], now)"),)),
    Bug("bucket_cache_ignores_new_burst", "a bucket used twice in one call with another burst keeps "
        "the first use's (a merged admit of a tenant under two configurations is not what "
        "separate calls do)",
        "include/bucket.lua",
        "  if b and (stored or (b.rate == rate and b.burst == burst)) then return b end",
        "  if b then return b end"),
    Bug("admit_wakes_one_worker", "a merged admit pushes one wake marker for all its queued "
        "requests: one idle worker wakes where separate calls woke one each",
        "admit.lua", "  if queued > 0 then wake_workers(queued) end",
        "  if queued > 0 then wake_workers() end"),
    Bug("complete_checks_as_it_goes", "a merged complete checks each request's offset and "
        "token count only when it comes to it: the requests before a refused one are finished, "
        "and the call's error reply hides that they were",
        "complete.lua", "  for k = 1, n do records[k] = leased_completion(calls[k]) or false end\n", "",
        also=(("complete.lua", "out[k] = complete_one(p, calls[k], records[k] or nil, now, expired)",
               "out[k] = complete_one(p, calls[k], leased_completion(calls[k]), now, expired)"),)),
    Bug("complete_takes_an_id_twice", "a merged complete takes two completions of one request: both "
        "pass the checks made before the first write, and the second finishes it again",
        "complete.lua", "    if seen[id] then fail(", "    if false then fail("),
    Bug("requeue_resets_own_wait", "a requeue gives the request its class's max wait, not its own",
        "include/requeue.lua", "r.deadline_ms = now + r.max_wait_ms",
        "r.deadline_ms = now + p.class[r.class].max_wait_ms"),
    Bug("fixed_record_ttl", "records get a fixed TTL shorter than a max wait",
        "include/record.lua", "local ttl = math.max(until_ms - now, 0) + LIVE_RECORD_GRACE_MS",
        "local ttl = 500"),
    Bug("fence_is_attempt", "the fence is the attempt number (release gives it back: it repeats)",
        "claim.lua", "local fence = redis.call('HINCRBY', K_STATS, 'lease_fence', 1)",
        "local fence = attempt"),
    Bug("claim_stops_at_misfit", "claim stops at the first request that does not fit (blocks all classes)",
        "claim.lua", "          closed[pick] = true\n        else\n          room = room - need",
        "          break\n        else\n          room = room - need"),
    Bug("no_vtc_lift", "a tenant that becomes backlogged keeps its old (low) counter: banked credit",
        "include/queue.lua", "math.max(own, virtual_time(cls))", "own"),
    Bug("vtc_refund_unclamped", "a refund may take a tenant's counter below the class's virtual time",
        "include/vtc.lua", "local new = math.max(v - amount, math.min(v, virtual_time(cls)))",
        "local new = v - amount"),
    Bug("inflight_leak_on_expiry", "an expired request is not subtracted from its tenant's in-flight count",
        "include/finish.lua", "if redis.call('HINCRBY', K_TENANT_INFLIGHT, r.tenant, -1) <= 0 then",
        "if (state == 'expired' and 1 or redis.call('HINCRBY', K_TENANT_INFLIGHT, r.tenant, -1)) <= 0 then"),
    Bug("fifo_head_not_updated", "in an arrival-order class a tenant keeps the place of a request that left",
        "include/queue.lua", "    if not fair then redis.call('ZADD', backlog, head[2], tenant) end\n", ""),
    Bug("stale_completion", "complete does not check the fence: a stale worker can finish a request",
        "complete.lua", "local r = leased_request(c.request_id, c.worker_id, c.fence, COMPLETE_FIELDS)",
        "local r = load_request(c.request_id, COMPLETE_FIELDS)"),
    Bug("expired_stays_indexed", "an expired request is left in the deadline index",
        "include/queue.lua", "  redis.call('ZREM', q, r.id)\n  redis.call('ZREM', K_DEADLINES, r.id)",
        "  redis.call('ZREM', q, r.id)"),
    Bug("push_token_string_without_ttl", "a push that creates a token string leaves it without a TTL",
        "push_tokens.lua", "        redis.call('PEXPIRE', P_TOKENS .. id, lease_ms + LIVE_RECORD_GRACE_MS)",
        "        local _ = 0"),
    Bug("grouped_entry_without_ttl", "a push's grouped reply entry leaves its stream without a TTL",
        "include/notify.lua", "    redis.call('EXPIRE', stream, REPLY_TTL_S)  -- as notify's",
        "    local _ = 0"),
    Bug("grouped_entry_spells_count_as_given", "a grouped entry carries the count argument as written "
        "('2e0'), not the number's digits",
        "push_tokens.lua", "group_entry(groups, id, frontend, fence_s, out_s, count, ARGV[a + 6])",
        "group_entry(groups, id, frontend, fence_s, out_s, ARGV[a + 4], ARGV[a + 6])"),
    Bug("groups_ignore_the_flag", "push_tokens groups every call of several requests, also for the "
        "requests of a frontend that reads only entries of their own",
        "push_tokens.lua", "arg_int(ARGV[4], 'grouped', 0, 1) == 1 and n > 1",
        "arg_int(ARGV[4], 'grouped', 0, 1) >= 0 and n > 1"),
    Bug("group_not_found_again", "a frontend's group is started anew for each of its requests (the "
        "earlier requests' batches are lost, the last one's sent twice)",
        "include/notify.lua", "  local fields = groups[frontend]\n", "  local fields = nil\n"),
    Bug("push_moves_leases", "a push moves its requests' lease end in their records (only renew_leases "
        "may; a push is not passed the lease index's key)",
        "push_tokens.lua", "        redis.call('HSET', key, 'out_tokens', delivered)\n",
        "        redis.call('HSET', key, 'out_tokens', delivered, 'lease_ms', now + lease_ms)\n"),
    Bug("push_restamps_first_token", "every push takes itself for its request's first and writes "
        "first_ms again (the TTFT moves to the latest push)",
        "include/lease.lua", "tonumber(v[6]), v[5] ~= false,", "tonumber(v[6]), false,"),
    Bug("first_push_without_first_ms", "an attempt's first push writes out_tokens without first_ms "
        "(the next push takes the request for started and no TTFT is ever stamped)",
        "push_tokens.lua", "redis.call('HSET', key, 'out_tokens', delivered, 'first_ms', fmt('%d', now))",
        "redis.call('HSET', key, 'out_tokens', delivered)"),
    Bug("push_ignores_fence", "push_tokens writes for a request leased to another attempt (no fence check)",
        "push_tokens.lua", "leased_for_write(id, worker_id,\n      ARGV[a + 2])\n",
        "leased_for_write(id, redis.call('HGET', P_REQUEST .. id, 'worker') or '',\n"
        "      redis.call('HGET', P_REQUEST .. id, 'fence') or '0')\n"),
    Bug("write_check_ignores_fence", "the lease check of push_tokens and renew_leases passes a stale fence",
        "include/lease.lua",
        "PUSH_FIELDS))\n  if v[1] ~= 'leased' or v[2] ~= worker_id then return false end\n"
        "  if v[3] ~= fence and tonumber(v[3]) ~= tonumber(fence) then return false end\n",
        "PUSH_FIELDS))\n  if v[1] ~= 'leased' or v[2] ~= worker_id then return false end\n",
        also=(("include/lease.lua",
               "RENEW_FIELDS))\n  if v[1] ~= 'leased' or v[2] ~= worker_id then return false end\n"
               "  if v[3] ~= fence and tonumber(v[3]) ~= tonumber(fence) then return false end\n",
               "RENEW_FIELDS))\n  if v[1] ~= 'leased' or v[2] ~= worker_id then return false end\n"),)),
    Bug("renewal_drops_cancel", "renew_leases never tells the worker its client cancelled",
        "include/lease.lua", "v[5] == '1' and 1 or 0", "0"),
    Bug("arg_int_takes_fractions", "an integer argument takes a fraction (the fast path skips a check)",
        "include/validate.lua", "n <= hi and n % 1 == 0 then return n end",
        "n <= hi then return n end"),
    Bug("push_writes_before_checks", "a push batch writes its first requests before a later one is refused",
        "push_tokens.lua", "ARGV[a + 5], ARGV[a + 6], ARGV[a + 7])\n",
        "ARGV[a + 5], ARGV[a + 6], ARGV[a + 7])\n"
        "    redis.call('HSET', P_REQUEST .. id, 'out_tokens', 0 + ARGV[a + 3] + ARGV[a + 4])\n"),
    Bug("push_streams_a_wrong_offset", "the reply stream's entry carries the batch's count as its offset",
        "push_tokens.lua", "'o', out_s, 'n'", "'o', fmt('%d', count), 'n'"),
    Bug("push_writes_a_refused_request",
        "push_tokens writes a batch it answers is past the request's max_tokens",
        "push_tokens.lua", "      replies[i] = {'max_tokens', max_tokens}\n",
        "      replies[i] = {'max_tokens', max_tokens}\n"
        "      redis.call('HSET', P_REQUEST .. id, 'out_tokens', offset + count)\n"),
    Bug("unknown_class_unrestricted", "a look-ahead naming a class the policy lacks claims every class "
        "(and avoids its tenants nowhere)",
        "claim.lua", "local rank = p.index[cls] or 0", "local rank = p.index[cls] or (#p.classes + 1)"),
    Bug("live_kv_read_per_misfit", "claim reads every worker's KV room again for each misfit",
        "claim.lua", "if largest == nil then largest = largest_worker_kv() end",
        "largest = largest_worker_kv()"),
    Bug("fair_switch_not_rescored", "a deploy that switches a class's fair flag leaves its backlog's scores",
        "init_pool.lua", "~= (fair[i] == 1) then rescore(", "~= (fair[i] == 1) and false then rescore("),
    Bug("refund_moves_arrival_order", "a refund moves a tenant's score in a class turned to arrival order",
        "include/refund.lua", "if r.c_vtc > 0 and class_fair(p, r.class) then\n    given.r_vtc",
        "if r.c_vtc > 0 and (class_fair(p, r.class) or true) then\n    given.r_vtc"),
    Bug("rates_not_repacked", "set_rates writes the fields but not the policy's packed copy",
        "set_rates.lua", "  pack_policy(K_POLICY)  -- last", "  local _ = 0  -- last"),
    Bug("packed_copy_of_any_version", "the scripts use the packed policy even when the version moved on",
        "include/policy.lua", "if p.version ~= tonumber(v[2]) then p = nil end", "local _ = 0"),
    Bug("claim_forgets_delivered_tokens", "a re-claimed request is not given the tokens it delivered before",
        "claim.lua", "local gen = r.out_tokens > 0 and redis.call(", "local gen = false and redis.call("),
    Bug("claim_reads_no_weight", "claim reads a queued request without its tenant's weight (charges it as 1)",
        "claim.lua", "'cost', 't_weight', 'out_tokens', 'payload'}", "'cost', 'out_tokens', 'payload'}"),
    Bug("finish_keeps_cancel_flag", "a finished request whose client left stays in the cancels set",
        "include/finish.lua", "if r.cancel == 1 then redis.call('SREM'", "if false then redis.call('SREM'"),
    Bug("finish_keeps_token_ttl", "a finished request's token string keeps its week-long TTL",
        "include/finish.lua", "if r.out_tokens > 0 or r.wrote_ids then", "if false then"),
    Bug("idle_tenant_not_charged", "a claim that empties its tenant's queue does not charge its counter",
        "include/vtc.lua", "    redis.call('HINCRBYFLOAT', P_VTIME .. cls, tenant, fmt(amount))\n", ""),
    Bug("vtc_charged_twice", "a claim adds twice the request's cost to a backlogged tenant's counter",
        "include/vtc.lua", "'XX', 'INCR', amount, tenant", "'XX', 'INCR', 2 * amount, tenant"),
    Bug("claim_takes_last_candidate", "past a skipped tenant, claim serves the last candidate it read",
        "claim.lua", "then tenant = t break end", "then tenant = t end"),
    Bug("served_ledger_not_written", "claim never writes the served ledger (as if every claim were empty)",
        "claim.lua", "  if #out > 2 or ledger.dirty then\n", "  if false then\n"),
    Bug("served_never_settled", "a finished request's served-ledger charge stays at its reservation (a "
        "context reserved and left after a token counts as a context served toward its class's floor)",
        "include/refund.lua", "  served_settle(p, r.class, used, r.cost, r.claimed_ms)\n", ""),
    Bug("claim_settles_behind_its_own_ledger", "a request a claim finishes is settled in Redis, and the "
        "claim's own write of its ledger undoes it",
        "claim.lua", "  local served = ledger.served\n",
        "  local served = ledger.served\n  served_open = nil\n"),
    Bug("complete_settles_unwritten", "complete settles its requests in the ledger it opened and never "
        "writes it: a request a worker finishes stays at its reservation in the served ledger",
        "complete.lua", "  if ledger and ledger.dirty then served_write(p, ledger) end\n", ""),
    Bug("complete_reads_no_claim_time", "complete reads the record without its first claim's time: a "
        "request a worker finishes is never settled in the served ledger",
        "complete.lua", "'first_ms', 'claimed_ms', 'cancel',", "'first_ms', 'cancel',"),
    Bug("served_removed_class_stands_still", "the served ledger is written for the policy's classes "
        "alone: a class a deploy removed keeps its entry undecayed, and comes back with it",
        "include/served.lua", "  for cls, v in pairs(ledger.served) do\n"
        "    if p.class[cls] == nil and v < SERVED_GONE then\n",
        "  for _, cls in ipairs(p.classes) do\n    local v = ledger.served[cls]\n    if false then\n"),
    Bug("complete_reads_no_weight", "complete reads the record without its tenant's weight (refunds as 1)",
        "complete.lua", "'t_rate', 't_burst', 't_weight',\n", "'t_rate', 't_burst',\n"),
    Bug("complete_reads_no_out_weight", "complete reads the record without its output weight",
        "complete.lua", "'cost', 'w_in', 'w_out',", "'cost', 'w_in',"),
    Bug("requeue_leaves_token_ttl", "a requeued request's token string keeps the TTL of its last lease",
        "include/requeue.lua", "keep_alive(p, r.id, r.deadline_ms, now, r.out_tokens == 0)",
        "keep_alive(p, r.id, r.deadline_ms, now, true)"),
    Bug("removed_class_drains_as_fair", "a class a deploy removed drains as if fair (arrival order lost)",
        "include/queue.lua", "local fair = class_fair(p, cls)",
        "local fair = p.class[cls] == nil or class_fair(p, cls)"),
    Bug("queued_end_refunds_all", "a request requeued after an attempt served it, then ended while "
        "queued (cancelled, expired, too large), is refunded as if nothing had been used",
        "include/record.lua", "  if r.state == 'leased' or r.out_tokens > 0 then return actual_cost",
        "  if r.state == 'leased' then return actual_cost"),
    Bug("leased_end_charges_nothing", "a request a worker held, ended with nothing delivered (its "
        "lease given up, its client gone), is charged nothing, not its prompt",
        "include/record.lua", "  if r.state == 'leased' or r.out_tokens > 0 then return actual_cost",
        "  if r.out_tokens > 0 then return actual_cost"),
    Bug("expiry_refunds_all", "an expiry refunds a request in full, whatever an earlier attempt served",
        "include/expire.lua", "' ms', used_cost(r), now,", "' ms', 0, now,"),
    Bug("janitor_stops_at_stale_entries", "a janitor pass judges whether there is more by what it "
        "ended: a sweep of 16 stale index entries ends the pass with due entries behind them",
        "reap_expired.lua", "local more = (overdue >= limit or lapsed >= limit) and 1 or 0",
        "local more = (expired >= limit or requeued + failed + cancelled >= limit) and 1 or 0"),
    Bug("second_key_outside_slot", "a script reads a key of another pool as a command's second key "
        "(a plain Redis runs it; a cluster refuses the script)",
        "cancel_request.lua", "  local r = load_request(request_id)\n",
        "  local r = load_request(request_id)\n  redis.call('EXISTS', K_POLICY, 'qos:{elsewhere}:x')\n"),
    Bug("ceiling_debt_floored", "the ceiling bucket's debt is floored at -ceil_burst: a request "
        "larger than the burst is charged ~2 bursts (the ceiling holds requests per burst_s)",
        "include/ceiling.lua", "  return bucket_debit(h, hold, nil), ceil_out_text(r.out_tokens, from)\n",
        "  return bucket_debit(h, hold, -h.burst), ceil_out_text(r.out_tokens, from)\n"),
    Bug("ceiling_charged_reservation", "a binding ceiling holds a request's whole reservation, not the "
        "output charged ahead (one request reserving a context closes its class until it ends)",
        "include/ceiling.lua", "math.min(max_tokens - out, p.ceil_ahead or DEFAULT_CEIL_AHEAD)",
        "max_tokens - out"),
    Bug("ceiling_ahead_ignored", "a binding ceiling is charged the prompt alone at claim, no output "
        "charged ahead (a class starts as many requests as its bucket has prompts for)",
        "include/ceiling.lua", "math.min(max_tokens - out, p.ceil_ahead or DEFAULT_CEIL_AHEAD)", "0"),
    Bug("renewal_charges_no_output", "a lease renewal does not charge the ceiling the output delivered "
        "since (a class runs past its ceiling until its requests end)",
        "renew_leases.lua", "charged = ceiling_charge_delivered(whole_policy, id, ceil_out, ceil_from, now)",
        "charged = nil"),
    Bug("requeue_charges_no_output", "a request requeued (its lease lost, or handed back) leaves the "
        "output its worker delivered since its last renewal off its ceiling until a later renewal",
        "include/requeue.lua", "  if r.ceil_out ~= nil then\n", "  if false then\n"),
    Bug("ceiling_never_settled", "a request whose ceiling was charged as it was served is not settled at "
        "its end (what it used beyond the charges, or its unused prompt, stays off the ceiling)",
        "include/refund.lua", "given.r_ceil = ceiling_settle(p, r, used, now, fields)", "given.r_ceil = 0"),
    Bug("ceiling_never_marks_late", "a request claimed while its class's ceiling did not bind is "
        "never charged to it after the controller cuts it (its running requests go on past it)",
        "renew_leases.lua", "      elseif ceiling_binds_now(cls) then\n", "      elseif false then\n"),
    Bug("ceiling_base_charged", "a request marked by a renewal (claimed before its ceiling bound) is "
        "settled at its end to all it used, its prompt and output before the mark too",
        "include/ceiling.lua",
        "  if r.ceil_from then used = math.max(r.out_tokens - r.ceil_from, 0) * r.w_out end\n", ""),
    Bug("ceiling_settles_all_it_used", "a request marked late is settled to what its end counted less "
        "its prompt and its output before the mark (an end that counted less, such as a request stopped "
        "before its prefill, gives the ceiling back more than it was charged)",
        "include/ceiling.lua",
        "  if r.ceil_from then used = math.max(r.out_tokens - r.ceil_from, 0) * r.w_out end\n",
        "  if r.ceil_from then used = used - (r.input_tokens * r.w_in + r.ceil_from * r.w_out) end\n"),
    Bug("ceiling_hold_ignores_mark", "a request marked late holds (and its renewals charge) its prompt "
        "and the output it delivered before its mark",
        "include/ceiling.lua", "  if from then return (out - from + ahead) * w_out end\n", ""),
    Bug("ceiling_late_mark_numeric", "a late mark is written as a plain number, as a mark at claim "
        "(this release and the one before then charge the request its prompt and its output before the mark)",
        "include/ceiling.lua", "  if from then return fmt(out) .. '@' .. fmt(from) end\n", ""),
    Bug("ceiling_marks_charged", "a renewal marks a request an older release's claim charged its whole "
        "reservation (no mark) as if never charged: its charge is lost from its record",
        "include/ceiling.lua", "  if (tonumber(v[1]) or 0) ~= 0 then return nil end\n", ""),
    Bug("ceiling_marks_unbound", "a renewal marks a request never charged whether or not its class's "
        "ceiling binds (a ceiling at the capacity holds its running requests' output: charged to a bucket "
        "no claim reads, and kept charged once a cut binds it)",
        "include/ceiling.lua", "  if c == nil or not ceiling_binds(p, c) then return nil end\n",
        "  if c == nil then return nil end\n",
        also=(("renew_leases.lua", "      elseif ceiling_binds_now(cls) then\n",
               "      elseif true then\n"),)),
    Bug("ceiling_mark_at_zero", "a late mark is put before the request's first output token: the output "
        "it delivered before its ceiling bound is charged",
        "include/ceiling.lua", "tonumber(v[4]), out, out)", "tonumber(v[4]), out, 0)",
        also=(("include/ceiling.lua", "'ceil_out', ceil_out_text(out, out)}",
               "'ceil_out', ceil_out_text(out, 0)}"),)),
    Bug("ceiling_mark_moves", "a renewal moves a late mark on to the output delivered: a request marked "
        "late holds the output ahead alone, and the output it delivers is charged only at its end, "
        "after its last renewal",
        "include/ceiling.lua", "  local held = tonumber(v[3]) or 0\n",
        "  local held = tonumber(v[3]) or 0\n  if from then from = out end\n"),
    Bug("reclaim_never_marks", "a request requeued before a ceiling cut and re-claimed under it is not "
        "marked by the re-claim (its prompt, read under the ceiling, is never charged)",
        "claim.lua", "          elseif ceiling_of(pick) then\n", "          elseif false then\n"),
    Bug("refund_caps_at_admitted_burst", "a refund reads the tenant's bucket with the quota its "
        "request was admitted under (a raised quota is cut back to the old burst)",
        "include/refund.lua", "r.t_rate, r.t_burst, now, true),", "r.t_rate, r.t_burst, now),"),
    Bug("overrun_not_charged", "a request whose engine counted more prompt than its reservation is "
        "charged the reservation alone (the rest is free to its tenant)",
        "include/refund.lua", "if used > r.cost then charge_overrun(",
        "if false and used > r.cost then charge_overrun("),
    Bug("overrun_counter_not_charged", "what a request used beyond its reservation is recorded on its "
        "tenant's counter but not added to it (its fair class serves it as if it had not)",
        "include/refund.lua", "r.c_vtc + vtc_charge(r.class, r.tenant, over / r.t_weight)",
        "r.c_vtc + over / r.t_weight"),
    Bug("guarantee_wait_after_ceiling", "admission's wait takes the guarantee path's as a cap after "
        "the ceiling's floor (a class in ceiling debt admits what can only expire)",
        "admit.lua",
        "    est = math.max(est, (own + math.max(-h.level, 0)) / c.ceil)\n  end\n  return est * 1000",
        "    est = math.max(est, (own + math.max(-h.level, 0)) / c.ceil)\n  end\n"
        "  if c.rate > 0 then\n    local g = bucket_get(P_BUCKET .. 'class:' .. cls, c.rate, c.burst, now)\n"
        "    est = math.min(est, (own + math.max(-g.level, 0)) / c.rate)\n  end\n  return est * 1000"),
    Bug("bucket_ts_ahead_kept", "a bucket whose ts lies ahead of now (the clock stepped back) is "
        "not rebased when only read: nothing refills it for the whole step",
        "include/bucket.lua", "    if now < ts then b.dirty = true end", ""),
    Bug("compliance_without_expiry", "the controller's compliance report is written without its "
        "expiry: a dead controller's figures read as current for good",
        "publish_compliance.lua", "  redis.call('PEXPIRE', K_COMPLIANCE, ttl_ms)\n", ""),
)


def _pytest(args: list[str]) -> tuple[bool, str]:
    """Run pytest; (failed, the first assertion or failing test it printed)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, QOS_MODEL_NO_SHRINK="1"))
    out = proc.stdout + proc.stderr
    failed = [ln.split(" ")[1] for ln in out.splitlines() if ln.startswith("FAILED ")]
    asserts = [ln.strip() for ln in out.splitlines() if "AssertionError" in ln and ln.startswith(("E", "|"))]
    why = (failed[0] + ": " if failed else "") + (asserts[0] if asserts else out.strip().splitlines()[-1])
    return proc.returncode != 0, why[:220]


def run(bug: Bug) -> tuple[tuple[bool, str], tuple[bool, str]]:
    """Apply ``bug``; run the model test, then the scripts' own tests. Each: (caught, why)."""
    edits = [(bug.path, bug.old, bug.new), *bug.also]
    saved: dict[Path, str] = {}
    try:
        for rel, old, new in edits:
            path = LUA / rel
            saved.setdefault(path, path.read_text())
            current = path.read_text()
            if current.count(old) != 1:
                raise SystemExit(f"{bug.name}: the text to replace is not in {rel} exactly once "
                                 f"({current.count(old)} times)")
            path.write_text(current.replace(old, new))
        return _pytest(["-x", TEST]), _pytest(["-x", *UNIT_TESTS])
    finally:
        for path, text in saved.items():
            path.write_text(text)


def main(argv: list[str]) -> int:
    if any(a.startswith("-") for a in argv):
        print(__doc__.strip() + "\n\nBugs: " + ", ".join(b.name for b in BUGS))
        return 0 if set(argv) <= {"-h", "--help"} else 2
    # a name not in the catalogue was skipped without a word: "0/0 caught", exit 0
    if unknown := sorted(set(argv) - {b.name for b in BUGS}):
        print(f"no such seeded bug: {', '.join(unknown)} (python -m tests.seeded_bugs --help lists them)",
              file=sys.stderr)
        return 2
    # a SIGTERM must still run run()'s finally: the Lua files are restored
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    chosen = [b for b in BUGS if not argv or b.name in argv]
    missed = by_model = 0
    for bug in chosen:
        t0 = time.monotonic()
        (model, model_why), (unit, unit_why) = run(bug)
        missed += not (model or unit)
        by_model += model
        took = time.monotonic() - t0
        print(f"{bug.name} ({took:.0f} s): {bug.what}\n"
              f"    model test: {'caught' if model else 'MISSED'}  {model_why}\n"
              f"    script tests: {'caught' if unit else 'MISSED'}  {unit_why}", flush=True)
    print(f"{len(chosen) - missed}/{len(chosen)} seeded bugs caught; {by_model} of them by {TEST}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
