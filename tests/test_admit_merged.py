"""admit.lua with several requests in one call (limiter/script_batcher.py merges a frontend's
admits of one event-loop turn): the replies and writes of the same requests in separate
calls, and a bad argument of any of them refuses the whole call with nothing written."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ResponseError

from limiter.keys import PoolKeys
from limiter.scripts import ADMIT_LIMIT, lifecycle_keys, script_source
from tests.support.helpers import dump_all
from tests.support.pool_state import init_demo_pool, pool_state

SLOW_RATE = 1e-9  # no refill between two calls: separate calls see the buckets a merged one does


def request(rid: str, tenant: str = "t1", cls: str = "P1", input_tokens: int = 100, max_tokens: int = 10,
            burst: float = 1e6, max_inflight: int = 0, max_wait_ms: int = 0,
            weight: float = 1.0) -> list[Any]:
    """admit.lua's 12 arguments of one request."""
    return [rid, tenant, cls, input_tokens, max_tokens, repr(SLOW_RATE), repr(float(burst)), max_inflight,
            max_wait_ms, "fe1", b'{"p": 1}', repr(float(weight))]


# A frontend's turn: a duplicate inside the call, a tenant at its in-flight cap, a tenant
# whose bucket the first of its requests empties, fair and arrival-order classes, weights.
SCENARIO = [
    request("a1"),
    request("a2", tenant="t2", cls="P0", input_tokens=7),
    request("a1", input_tokens=5),
    request("b1", tenant="t3", max_inflight=1),
    request("b2", tenant="t3", max_inflight=1),
    request("c1", tenant="t4", burst=50),
    request("c2", tenant="t4", burst=50),
    request("d1", tenant="t5", cls="P2", weight=3.0),
    request("d2", tenant="t6", cls="P2", max_wait_ms=1),
    request("e1", tenant="t2", cls="P0", input_tokens=9),
]


def _reply(r: list[Any]) -> tuple[Any, ...]:
    """A reply without its time-made parts (the wait estimates and deadlines, a bucket's wait)."""
    status = r[0].decode()
    if status == "queued":
        return status, r[1], r[2]
    if status in ("throttled", "overloaded"):
        return status, r[2] if status == "throttled" else None
    return tuple(x.decode() if isinstance(x, bytes) else x for x in r)


@pytest.fixture
def sha(sync_redis) -> str:
    return sync_redis.script_load(script_source("admit"))


def admit_call(sync_redis, sha: str, keys: PoolKeys, requests: list[list[Any]]) -> Any:
    ks = lifecycle_keys(keys)
    return sync_redis.evalsha(sha, len(ks), *ks, *[a for r in requests for a in r])


def test_a_merged_call_replies_and_writes_as_the_same_requests_in_separate_calls(sync_redis, sha):
    apart, merged = init_demo_pool(sync_redis, "tiny"), init_demo_pool(sync_redis, "tiny-m")
    one_by_one = [admit_call(sync_redis, sha, apart, [r]) for r in SCENARIO]
    together = admit_call(sync_redis, sha, merged, SCENARIO)
    assert len(together) == len(SCENARIO)
    assert [_reply(r) for r in together] == [_reply(r) for r in one_by_one]
    statuses = {r[0].decode() for r in together}
    assert {"queued", "duplicate", "tenant_busy", "throttled"} <= statuses, statuses  # not vacuous
    assert pool_state(sync_redis, merged) == pool_state(sync_redis, apart)
    queued = sum(r[0] == b"queued" for r in together)
    assert sync_redis.llen(merged.wake) == queued  # a marker each: as many idle workers wake


_requests = st.lists(st.builds(
    request, rid=st.sampled_from([f"q{i}" for i in range(12)]), tenant=st.sampled_from(["t1", "t2", "t3"]),
    cls=st.sampled_from(["P0", "P1", "P2", "P2"]), input_tokens=st.integers(0, 300),
    max_tokens=st.integers(1, 100), burst=st.sampled_from([1e6, 1e6, 200.0, 30.0]),
    max_inflight=st.sampled_from([0, 0, 1, 3]), max_wait_ms=st.sampled_from([0, 0, 1, 50]),
    weight=st.sampled_from([1.0, 0.5, 3.0])), min_size=2, max_size=ADMIT_LIMIT)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=_requests)
def test_any_merged_call_replies_and_writes_as_separate_calls(sync_redis, sha, requests):
    """The same, for random calls: repeated ids, tenants at their caps, small buckets,
    a tenant whose burst differs between its requests, every class."""
    sync_redis.flushall()
    sha = sync_redis.script_load(script_source("admit"))
    apart, merged = init_demo_pool(sync_redis, "tiny"), init_demo_pool(sync_redis, "tiny-m")
    one_by_one = [admit_call(sync_redis, sha, apart, [r]) for r in requests]
    together = admit_call(sync_redis, sha, merged, requests)
    assert [_reply(r) for r in together] == [_reply(r) for r in one_by_one]
    assert pool_state(sync_redis, merged) == pool_state(sync_redis, apart)


def test_a_call_of_one_request_keeps_its_reply_and_its_optional_weight(sync_redis, sha):
    keys = init_demo_pool(sync_redis, "tiny")
    reply = admit_call(sync_redis, sha, keys, [request("a")[:11]])  # no tenant_weight: 1
    assert reply[0] == b"queued" and reply[1] == 1
    assert sync_redis.hget(keys.request("a"), "t_weight") == b"1"


@pytest.mark.parametrize("bad_at", [0, 4, 9])
@pytest.mark.parametrize(("field", "index", "value"), [
    ("max_tokens", 4, 0), ("tenant_rate", 5, "nan"), ("request_id", 0, "a:b"), ("class", 2, "nope"),
    ("payload", 10, b"x" * (8 << 20 | 1))])
def test_a_bad_argument_of_any_request_refuses_the_whole_call_and_writes_nothing(
        sync_redis, sha, bad_at, field, index, value):
    keys = init_demo_pool(sync_redis, "tiny")
    requests = [list(r) for r in SCENARIO]
    requests[bad_at][index] = value
    before = dump_all(sync_redis)
    with pytest.raises(ResponseError, match=field if field != "class" else "class|NOPOLICY|P1"):
        admit_call(sync_redis, sha, keys, requests)
    assert dump_all(sync_redis) == before


@pytest.mark.parametrize(("args", "message"), [
    (lambda: [a for i in range(ADMIT_LIMIT + 1) for a in request(f"r{i}")], "at most 64"),
    (lambda: [*request("a"), *request("b")[:11]], "not groups of 12"),
    (lambda: [*request("a"), "extra"], "not groups of 12"),
])
def test_a_call_whose_arguments_are_not_whole_requests_is_refused(sync_redis, sha, args, message):
    keys = init_demo_pool(sync_redis, "tiny")
    before = dump_all(sync_redis)
    ks = lifecycle_keys(keys)
    with pytest.raises(ResponseError, match=f"BADARG ARGV: .*{message}"):
        sync_redis.evalsha(sha, len(ks), *ks, *args())
    assert dump_all(sync_redis) == before
