"""lua/publish_compliance.lua: the leader's report, written whole with its expiry in one call."""

from __future__ import annotations

import pytest

from limiter.errors import InvalidArgument
from limiter.keys import PoolKeys
from limiter.scripts import Scripts

K = PoolKeys("tiny")


async def test_the_report_is_written_whole_and_always_expires(scripts: Scripts, sync_redis) -> None:
    """The hash and its expiry in one call (a pipeline's HSET could land without the PEXPIRE
    after it: a dead controller's figures then read as current for good); a class with no
    figure now is gone from it, not left at its last value."""
    written = await scripts.publish_compliance(K, 10_000, {
        "P0": 0.995, "P1": 1.0, ".capacity": 41_000.5, ".capacity_source": "workers",
        ".capacity_confidence": 0.8, ".capacity_workers": 2, ".updated_ms": 1_000, ".controller": "ctl"})
    assert written == 8
    assert sync_redis.hgetall(K.compliance) == {
        b"P0": b"0.995", b"P1": b"1", b".capacity": b"41000.5", b".capacity_source": b"workers",
        b".capacity_confidence": b"0.8", b".capacity_workers": b"2", b".updated_ms": b"1000",
        b".controller": b"ctl"}
    assert 0 < sync_redis.pttl(K.compliance) <= 10_000
    await scripts.publish_compliance(K, 20_000, {"P1": 0.5, ".updated_ms": 2_000})
    assert sync_redis.hgetall(K.compliance) == {b"P1": b"0.5", b".updated_ms": b"2000"}
    assert 10_000 < sync_redis.pttl(K.compliance) <= 20_000


@pytest.mark.parametrize("fields, problem", [
    ({}, "field/value pairs"),
    ({"P0": 1.5}, "P0"),
    ({"a.b": 0.5}, "class name"),
    ({".capacity": -1.0}, ".capacity"),
    ({".capacity_workers": 1.5}, ".capacity_workers"),
    ({".controller": "a b"}, ".controller"),
])
async def test_a_bad_report_is_refused_and_the_last_one_stays(scripts: Scripts, sync_redis, fields,
                                                               problem) -> None:
    await scripts.publish_compliance(K, 10_000, {"P0": 0.9})
    before = (sync_redis.hgetall(K.compliance), sync_redis.pttl(K.compliance))
    with pytest.raises(InvalidArgument, match=problem.replace(".", r"\.")):
        await scripts.publish_compliance(K, 10_000, fields)
    assert sync_redis.hgetall(K.compliance) == before[0]
    assert 0 < sync_redis.pttl(K.compliance) <= before[1]


async def test_a_field_given_twice_is_refused(sync_redis) -> None:
    from limiter.scripts import script_source

    sha = sync_redis.script_load(script_source("publish_compliance"))
    with pytest.raises(Exception, match="given twice"):
        sync_redis.evalsha(sha, 1, K.compliance, "10000", "P0", "0.5", "P0", "0.6")
    assert not sync_redis.exists(K.compliance)
