"""Every script validates its ARGV: a bad argument is an error reply and changes nothing."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ResponseError

from limiter.config import demo_config
from limiter.keys import PoolKeys
from limiter.scripts import SCRIPT_NAMES, lifecycle_keys, policy_document, script_source
from tests.support.helpers import admit, dump_all, logical_state

K = PoolKeys("tiny")
GOOD = {
    "admit": ["id-new", "t1", "P1", "10", "5", "1000", "1000", "0", "0", "fe1", "payload", "1"],
    "claim": ["w9", "1", "0", "0", "P1", "0", "t1,t2", "P2"],
    "renew_leases": ["w1", "0", "leased:1"],
    "push_tokens": ["w1", "0", "2", "1", "leased", "1", "0", "1", "\x01\x00\x00\x00", "a", "1",
                    "other", "1", "0", "1", "\x01\x00\x00\x00", "b", ""],
    "complete": ["leased", "w1", "1", "ok", "3", "0", "", "", "stop", "", "", "0", "0"],
    "cancel_request": ["queued", "t1", "client_gone"],
    "release": ["leased", "w1", "1", "0"],
    "reap_expired": ["10"],
    "set_rates": ["ctl", "1", "{}", "P0.rate", "5"],
    "acquire_leader": ["ctl", "1000"],
    "release_leader": ["ctl", "1"],
    "init_pool": ["{}", "keep_rates"],
    "publish_compliance": ["10000", "P0", "0.5", ".capacity_workers", "2"],
}
BAD_VALUES = ["", "-1", "abc", "nan", "inf", "1e400", "1.5", "a{b}", "a:b", "x" * 70, "99999999999999999"]


def keys_for(name: str) -> list[str]:
    if name == "set_rates":
        return [K.policy, K.leader, K.decisions]
    if name in ("acquire_leader",):
        return [K.leader, K.fence]
    if name == "release_leader":
        return [K.leader]
    if name == "publish_compliance":
        return [K.compliance]
    return list(lifecycle_keys(K))


@pytest.fixture
async def state(scripts, pool, sync_redis):
    await admit(scripts, pool, cls="P1", request_id="leased", input_tokens=3, max_tokens=5)
    await admit(scripts, pool, cls="P1", request_id="queued", input_tokens=3, max_tokens=5)
    got = await scripts.claim(pool, "w1", 1)
    assert got.requests[0].request_id == "leased"
    shas = {n: sync_redis.script_load(script_source(n)) for n in SCRIPT_NAMES}
    return shas


def _call(sync_redis, sha, name, args):
    ks = keys_for(name)
    return sync_redis.evalsha(sha, len(ks), *ks, *args)


def _bad_variants(name):
    good = GOOD[name]
    for i in range(len(good)):
        for bad in BAD_VALUES:
            args = list(good)
            args[i] = bad
            yield i, args
    yield -1, good[:-1]  # a missing argument


@pytest.mark.parametrize("name", [n for n in SCRIPT_NAMES if n != "init_pool"])
async def test_the_good_arguments_are_accepted(state, sync_redis, name):
    """The baseline the bad variants below are made from is itself a valid call: else a
    variant could be refused for another argument than the one it changed."""
    if name == "set_rates":  # only the leader with its fence may write rates
        assert _call(sync_redis, state["acquire_leader"], "acquire_leader", GOOD["acquire_leader"])[0] == 1
    _call(sync_redis, state[name], name, GOOD[name])


# Which of BAD_VALUES each position may take, by its contract (the script's header): a name
# takes any name-shaped text, a class name one without a dot, free text anything; MISSING: the
# call without its last argument (an optional one). Every other variant must be refused.
# Counting the refusals was not enough: a tenant name left unchecked, or an input_tokens
# bound raised to 1e17, passed (found by a review).
NAMEISH = frozenset({"-1", "abc", "nan", "inf", "1e400", "1.5", "99999999999999999"})
CLASSISH = NAMEISH - {"1.5"}
FREE = frozenset(BAD_VALUES)
MISSING = -1
ACCEPTED: dict[str, dict[int, frozenset[str]]] = {
    # id, tenant, tenant_rate, tenant_burst, frontend, payload, tenant_weight (optional)
    "admit": {0: NAMEISH, 1: NAMEISH, 5: frozenset({"1.5"}), 6: frozenset({"1.5"}), 9: NAMEISH, 10: FREE,
              11: frozenset({"1.5"}), MISSING: frozenset({""})},
    # worker; a look-ahead class ('' none; one the policy lacks takes nothing); avoided tenants
    # ('' none); the class avoiding starts from
    "claim": {0: NAMEISH, 4: CLASSISH | {""}, 6: NAMEISH | {""}, 7: CLASSISH},
    "renew_leases": {0: NAMEISH, MISSING: frozenset({""})},  # no lease to renew
    # worker; per request: id, uint32 ids (any 4 bytes), text, n_ids ('' = count)
    "push_tokens": {0: NAMEISH, 4: NAMEISH, 8: frozenset({"a{b}"}), 9: FREE, 10: frozenset({""}),
                    11: NAMEISH, 15: frozenset({"a{b}"}), 16: FREE, 17: frozenset({""})},
    # id, worker, ids, text, message, sample (the controller checks it), n_ids and offset
    # ('' = count, unchecked; the offset optional)
    "complete": {0: NAMEISH, 1: NAMEISH, 6: frozenset({""}), 7: FREE, 9: FREE, 10: FREE, 11: frozenset({""}),
                 12: frozenset({""}), MISSING: frozenset({""})},
    "cancel_request": {0: NAMEISH, 1: NAMEISH},
    "reap_expired": {},
    "set_rates": {2: FREE, 4: frozenset({"1.5"})},  # the decision's text; a rate
    "acquire_leader": {0: NAMEISH},
    "release_leader": {0: NAMEISH},
    "release": {0: NAMEISH, 1: NAMEISH, 3: frozenset({""}), MISSING: frozenset({""})},  # spent optional
    "publish_compliance": {1: CLASSISH},  # a class's field: any class-shaped name
}


def _snapshot(client) -> dict[bytes, tuple[bytes, int]]:
    return {k: (client.dump(k), client.pttl(k)) for k in client.keys("*")}


def _restore(client, snap: dict[bytes, tuple[bytes, int]]) -> None:
    client.flushall()
    for k, (value, ttl) in snap.items():
        if value is not None:
            client.restore(k, max(ttl, 0), value)


@pytest.mark.parametrize("name", [n for n in SCRIPT_NAMES if n != "init_pool"])
async def test_each_bad_argument_is_an_error_and_changes_nothing(state, sync_redis, name):
    """Each variant on the same state (restored after one that is taken): a bad value is a
    BADARG reply that changes nothing; what may be taken is exactly ACCEPTED's."""
    sha = state[name]
    if name == "set_rates":  # only the leader with its fence may write rates: else every
        # variant was refused as STALE, whatever its argument
        _call(sync_redis, state["acquire_leader"], "acquire_leader", GOOD["acquire_leader"])
    base = _snapshot(sync_redis)
    accepted: dict[int, set[str]] = {}
    for i, args in _bad_variants(name):
        _restore(sync_redis, base)
        before = logical_state(sync_redis)
        try:
            _call(sync_redis, sha, name, args)
        except ResponseError as exc:
            # set_rates: another owner or fence is not the leader (STALE), as it should be
            codes = ("BADARG", "STALE") if name == "set_rates" and i in (0, 1) else ("BADARG",)
            assert str(exc).split(" ")[0] in codes, (name, i, args, str(exc))
            assert logical_state(sync_redis) == before, (name, i, args)
        else:
            accepted.setdefault(i, set()).add(args[i] if i != MISSING else "")
    assert accepted == {i: set(v) for i, v in ACCEPTED[name].items()}, name


async def test_init_pool_rejects_bad_policies_without_writing(state, sync_redis):
    sha = state["init_pool"]
    cases = ["", "[]", "{", '{"pool": "x"}', '{"pool": "a{b}", "capacity": 1}',
             '{"pool":"tiny","capacity":-1,"lease_ms":1000,"max_attempts":3,'
             '"frontend_ttl_ms":1000,"floor_half_life_ms":1,"record_ttl_s":1,"floor_quantum":0,"classes":[]}']
    # a class name with a dot: its <class>.cost field would be another class's count
    cfg = demo_config()
    doc = policy_document(cfg, cfg.pool("tiny"))
    doc["classes"][1]["name"] = "P0.cost"
    cases.append(json.dumps(doc))
    for doc in cases:
        before = dump_all(sync_redis)
        with pytest.raises(ResponseError, match="BADARG"):
            _call(sync_redis, sha, "init_pool", [doc, "keep_rates"])
        assert dump_all(sync_redis) == before


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from([n for n in SCRIPT_NAMES if n not in ("init_pool",)]),
       data=st.data())
def test_fuzzed_arguments_never_corrupt_state(state, sync_redis, name, data):
    """Random ARGV: either a clean error with nothing changed, or a valid call."""
    n = len(GOOD[name])
    args = data.draw(st.lists(st.one_of(st.text(max_size=20), st.binary(max_size=12),
                                        st.integers(-10, 10**12).map(str), st.floats().map(repr)),
                              min_size=0, max_size=n + 2))
    before = dump_all(sync_redis)
    try:
        _call(sync_redis, state[name], name, args)
    except ResponseError as exc:
        assert str(exc).split(" ")[0] in ("BADARG", "NOPOLICY", "STALE"), (name, args, str(exc))
        assert dump_all(sync_redis) == before
    else:
        # A valid call may leave a key with a short TTL (acquire_leader's lease): it would
        # expire between a later example's two snapshots and read as a change.
        for key in sync_redis.keys("*"):
            if 0 <= sync_redis.pttl(key) < 600_000:
                sync_redis.persist(key)
