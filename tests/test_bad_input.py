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
from tests.support.helpers import admit, dump_all

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
}
BAD_VALUES = ["", "-1", "abc", "nan", "inf", "1e400", "1.5", "a{b}", "a:b", "x" * 70, "99999999999999999"]


def keys_for(name: str) -> list[str]:
    if name == "set_rates":
        return [K.policy, K.leader, K.decisions]
    if name in ("acquire_leader",):
        return [K.leader, K.fence]
    if name == "release_leader":
        return [K.leader]
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


@pytest.mark.parametrize("name", [n for n in SCRIPT_NAMES if n != "init_pool"])
async def test_each_bad_argument_is_an_error_and_changes_nothing(state, sync_redis, name):
    sha = state[name]
    errors = 0
    for i, args in _bad_variants(name):
        before = dump_all(sync_redis)
        try:
            _call(sync_redis, sha, name, args)
        except ResponseError as exc:
            errors += 1
            assert str(exc).split(" ")[0] in ("BADARG", "NOPOLICY", "STALE"), (name, i, args, str(exc))
            assert dump_all(sync_redis) == before, (name, i, args)
        else:
            # A value that happens to be valid for that position (e.g. "1.5" as a rate) is
            # allowed to succeed; the state may then change. Restore nothing: later cases
            # compare against a fresh snapshot.
            pass
    assert errors > len(GOOD[name]), f"{name}: too few bad arguments were rejected"


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
