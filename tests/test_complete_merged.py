"""complete.lua with several requests in one call (limiter/script_batcher.py merges a step
worker's completions of one event-loop turn): the replies and writes of the same
completions in separate calls, and an argument or a token count of any of them that the
script refuses refuses the whole call with nothing written."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ResponseError

from limiter.keys import PoolKeys
from limiter.scripts import COMPLETE_LIMIT, lifecycle_keys, pack_token_ids, script_source
from tests.support.helpers import dump_all
from tests.support.pool_state import copy_pool, init_demo_pool, pool_state

SLOW_RATE = repr(1e-9)  # no refill between two calls: separate calls see the buckets a merged one does
# The requests every example completes some of: (id, tenant, class, tokens pushed before).
HELD = [("q0", "t1", "P1", 0), ("q1", "t1", "P1", 2), ("q2", "t2", "P0", 1), ("q3", "t2", "P2", 3),
        ("q4", "t3", "P2", 0), ("q5", "t3", "P1", 4), ("q6", "t1", "P0", 1), ("q7", "t4", "P2", 2)]
# Tenant t1's requests were admitted under different quotas (its config changed between
# them): their refunds meet one bucket, read with a different burst each (the bucket cache's
# write-back and re-read within one call).
BURST = {"q0": "1000000.0", "q1": "700.0", "q6": "400.0"}
MAX_TOKENS = 10


def _eval(client: Any, name: str, keys: PoolKeys, args: list[Any]) -> Any:
    ks = lifecycle_keys(keys)
    return client.evalsha(client.script_load(script_source(name)), len(ks), *ks, *args)


def held_pool(client: Any, name: str) -> tuple[PoolKeys, dict[str, int]]:
    """A pool whose worker w1 holds every request of :data:`HELD`, each with its tokens
    pushed; and each request's fence."""
    keys = init_demo_pool(client, name)
    for rid, tenant, cls, _ in HELD:
        reply = _eval(client, "admit", keys, [rid, tenant, cls, 50, MAX_TOKENS, SLOW_RATE,
                                              BURST.get(rid, "1000000.0"), 0, 0, "fe1", b"{}", "1.0"])
        assert reply[0] == b"queued", reply
    claimed = _eval(client, "claim", keys, ["w1", len(HELD), 0, 60000, "", 0, "", ""])
    fences = {e[0].decode(): int(e[3]) for e in claimed[2:]}
    assert sorted(fences) == sorted(rid for rid, *_ in HELD)
    for rid, _, _, pushed in HELD:
        if pushed:
            ids = list(range(pushed))
            args = ["w1", 0, 1, 0, rid, fences[rid], 0, pushed, pack_token_ids(ids), b"x" * pushed, pushed]
            reply = _eval(client, "push_tokens", keys, args)
            assert reply == [b"ok"], reply
    init_demo_pool(client, name, class_rate=1e-9)  # completions' refunds meet unrefilled buckets
    return keys, fences


def completion(rid: str, fence: int, worker: str = "w1", outcome: str = "ok", count: int = 1,
               finish_reason: str = "stop", message: str = "", sample: bytes = b"",
               offset: int | None = None) -> list[Any]:
    """complete.lua's 13 arguments of one request."""
    return [rid, worker, fence, outcome, 50, count, pack_token_ids(list(range(count))), b"y" * count,
            finish_reason, message, sample, count, "" if offset is None else offset]


def _pushed(rid: str) -> int:
    return next(p for r, _, _, p in HELD if r == rid)


def two_pools(client: Any) -> tuple[PoolKeys, PoolKeys, dict[str, int]]:
    apart, fences = held_pool(client, "tiny")
    merged = PoolKeys("tiny-m")
    copy_pool(client, apart, merged)
    assert pool_state(client, merged) == pool_state(client, apart)
    return apart, merged, fences


def test_a_merged_call_replies_and_writes_as_the_same_completions_in_separate_calls(sync_redis):
    apart, merged, fences = two_pools(sync_redis)
    calls = [
        completion("q0", fences["q0"], count=3, sample=b"s0"),
        completion("q1", fences["q1"], count=2, offset=2, finish_reason="length"),
        completion("q2", fences["q2"], outcome="failed", count=0, finish_reason="error", message="boom"),
        completion("q3", fences["q3"] + 1),  # a stale fence: lost
        completion("q4", fences["q4"], worker="w2"),  # another worker's: lost
        completion("q5", fences["q5"], outcome="cancelled", count=1, finish_reason="cancelled", sample=b"s5"),
        completion("q9", 1),  # no such request: lost
        completion("q7", fences["q7"], count=0, offset=2),
    ]
    one_by_one = [_eval(sync_redis, "complete", apart, c) for c in calls]
    together = _eval(sync_redis, "complete", merged, [a for c in calls for a in c])
    assert together == one_by_one
    assert [r[0] for r in together].count(b"lost") == 3 and [r[0] for r in together].count(b"ok") == 5
    assert pool_state(sync_redis, merged) == pool_state(sync_redis, apart)
    states = {rid: sync_redis.hget(merged.request(rid), "state") for rid in ("q0", "q2", "q3", "q5")}
    assert states == {"q0": b"done", "q2": b"failed", "q3": b"leased", "q5": b"cancelled"}


# (request id, fence off by, worker, outcome, count, offset checked, sample)
_calls = st.lists(st.tuples(
    st.sampled_from([rid for rid, *_ in HELD] + ["q8", "q9"]), st.sampled_from([0, 0, 0, 1]),
    st.sampled_from(["w1", "w1", "w1", "w2"]), st.sampled_from(["ok", "failed", "cancelled"]),
    st.integers(0, 5), st.booleans(), st.sampled_from([b"", b"s"])),
    min_size=2, max_size=10, unique_by=lambda c: c[0])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=_calls)
def test_any_merged_call_replies_and_writes_as_separate_calls(sync_redis, calls):
    """The same, for random calls: any mix of outcomes, lost leases, token counts and offset
    checks, over tenants and classes whose refunds meet in the same buckets."""
    sync_redis.flushall()
    apart, merged, fences = two_pools(sync_redis)
    args = [completion(rid, fences.get(rid, 1) + stale, worker=worker, outcome=outcome, count=count,
                       finish_reason={"ok": "stop", "failed": "error", "cancelled": "cancelled"}[outcome],
                       message="m" if outcome == "failed" else "", sample=sample,
                       offset=_pushed(rid) if offset and rid in fences else None)
            for rid, stale, worker, outcome, count, offset, sample in calls]
    one_by_one = [_eval(sync_redis, "complete", apart, a) for a in args]
    together = _eval(sync_redis, "complete", merged, [a for c in args for a in c])
    assert together == one_by_one
    assert pool_state(sync_redis, merged) == pool_state(sync_redis, apart)


def test_a_call_of_one_request_keeps_its_reply_and_its_optional_arguments(sync_redis):
    keys, fences = held_pool(sync_redis, "tiny")
    reply = _eval(sync_redis, "complete", keys, completion("q1", fences["q1"], count=2)[:11])
    assert reply[0] == b"ok"
    assert sync_redis.hget(keys.request("q1"), "usage_out") == b"4"


@pytest.mark.parametrize("bad_at", [0, 3, 5])
@pytest.mark.parametrize(("field", "index", "value"), [
    ("fence", 2, 0), ("outcome", 3, "maybe"), ("request_id", 0, "a:b"), ("finish_reason", 8, "tired"),
    ("sample", 10, b"x" * 65537), ("offset", 12, 7), ("count", 5, MAX_TOKENS + 1)])
def test_a_refused_argument_or_count_of_any_request_refuses_the_whole_call_and_writes_nothing(
        sync_redis, bad_at, field, index, value):
    """Among them two checked against the record, after every argument: an offset that is
    not what was delivered, and tokens past max_tokens."""
    keys, fences = held_pool(sync_redis, "tiny")
    calls = [completion(rid, fences[rid], count=1) for rid, *_ in HELD[:6]]
    calls[bad_at][index] = value
    if field == "count":  # the token batch must match its count, or its check refuses it first
        calls[bad_at][6], calls[bad_at][7], calls[bad_at][11] = pack_token_ids([1] * value), b"z", value
    before = dump_all(sync_redis)
    with pytest.raises(ResponseError, match=f"BADARG {field}"):
        _eval(sync_redis, "complete", keys, [a for c in calls for a in c])
    assert dump_all(sync_redis) == before


@pytest.mark.parametrize(("args", "message"), [
    (lambda f: [a for i in range(COMPLETE_LIMIT + 1) for a in completion(f"r{i}", 1)], "ARGV: .*at most 64"),
    (lambda f: [*completion("q0", f["q0"]), *completion("q1", f["q1"])[:11]], "ARGV: .*not groups of 13"),
    (lambda f: [*completion("q0", f["q0"]), "extra"], "ARGV: .*not groups of 13"),
    (lambda f: [*completion("q0", f["q0"]), *completion("q0", f["q0"])], "request_id: q0 twice"),
])
def test_a_call_whose_arguments_are_not_whole_distinct_requests_is_refused(sync_redis, args, message):
    keys, fences = held_pool(sync_redis, "tiny")
    before = dump_all(sync_redis)
    with pytest.raises(ResponseError, match=f"BADARG {message}"):
        _eval(sync_redis, "complete", keys, args(fences))
    assert dump_all(sync_redis) == before
