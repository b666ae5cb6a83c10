"""The policy's packed copy (lua/include/policy.lua): every script reads one msgpack field
instead of the policy's ~40 fields. The invariant: after every write of the policy the
copy is exactly the fields, and a copy that is not current for the hash's version is never
used."""

from __future__ import annotations

import dataclasses

import fakeredis
import msgpack
import pytest

from limiter.errors import Throttled
from limiter.keys import PACKED_POLICY_FIELD, PoolKeys, policy_text
from limiter.scripts import Scripts, policy_document
from tests.support.helpers import admit

POOL_NUMERIC = ("capacity", "lease_ms", "max_attempts", "frontend_ttl_ms", "floor_half_life_ms",
                "record_ttl_s", "floor_quantum", "ceil_ahead")
CLASS_FIELDS = ("rate", "burst", "ceil", "ceil_burst", "weight", "out_weight", "queue_cap", "max_wait_ms",
                "floor", "fair")


def policy_from_fields(fields: dict[str, str]) -> dict:
    """What the packed copy must hold, computed here from the fields."""
    classes = fields["classes"].split(",")
    out = {"name": fields["pool"], "classes": classes, "version": int(fields["version"]),
           "index": {c: i + 1 for i, c in enumerate(classes)}, "class": {}}
    out.update({f: float(fields[f]) for f in POOL_NUMERIC})
    for c in classes:
        t = {f: float(fields[f"{c}.{f}"]) for f in CLASS_FIELDS}
        t["fair"] = t["fair"] != 0
        out["class"][c] = t
    return out


async def assert_copy_is_the_fields(scripts: Scripts, keys: PoolKeys) -> dict:
    raw = await scripts.client.hgetall(keys.policy)
    packed = msgpack.unpackb(raw[PACKED_POLICY_FIELD.encode()], strict_map_key=False)
    expected = policy_from_fields(policy_text(raw))
    assert packed == expected  # numbers compare by value: 5000 == 5000.0, 111.5 exactly
    return packed


async def test_the_packed_copy_is_the_fields_after_every_policy_write(scripts, pool, cfg):
    first = await assert_copy_is_the_fields(scripts, pool)  # init_pool, as the fixture ran it
    assert first["version"] == 0 and first["class"]["P1"]["rate"] > 0

    fence, _ = await scripts.acquire_leader(pool, "ctl", 60_000)
    # a rate below the ceiling's: set_rates lifts the ceiling after its own writes
    await scripts.set_rates(pool, "ctl", fence, {}, {"P1.rate": 123_456.789012345678, "P1.ceil": 1.0,
                                                     "capacity": 777_777.25})
    after = await assert_copy_is_the_fields(scripts, pool)
    assert after["version"] == 1
    assert after["class"]["P1"]["rate"] == 123_456.789012345678 == after["class"]["P1"]["ceil"]

    # a deploy: new static fields (keep_rates keeps the controller's rates) ...
    tiny = cfg.pool("tiny")
    changed = dataclasses.replace(cfg, classes=tuple(
        dataclasses.replace(c, weight=c.weight * 3, queue_cap=c.queue_cap + 1) for c in cfg.classes))
    await scripts.init_pool(pool, policy_document(changed, tiny))
    kept = await assert_copy_is_the_fields(scripts, pool)
    assert kept["class"]["P1"]["rate"] == 123_456.789012345678
    assert kept["class"]["P1"]["weight"] == 3 * next(c.weight for c in cfg.classes if c.name == "P1")
    # ... and a reset of the rates
    await scripts.init_pool(pool, policy_document(cfg, tiny), reset_rates=True)
    reset = await assert_copy_is_the_fields(scripts, pool)
    assert reset["class"]["P1"]["rate"] == first["class"]["P1"]["rate"]


async def test_a_rate_change_reaches_admit_and_claim_at_once(scripts, pool):
    fence, _ = await scripts.acquire_leader(pool, "ctl", 60_000)
    await admit(scripts, pool, cls="P2", request_id="before")
    await scripts.set_rates(pool, "ctl", fence, {}, {"P2.rate": 0, "P2.ceil": 0, "P2.ceil_burst": 0})

    with pytest.raises(Throttled) as e:
        await admit(scripts, pool, cls="P2", request_id="after")
    assert e.value.bucket == "class" and e.value.retry_after_ms == -1
    # its queued request is not claimed either (its ceiling bucket, new, holds a burst of 0)

    assert (await scripts.claim(pool, "w1", 1)).requests == []


async def test_a_copy_not_current_for_the_version_is_not_used(scripts, pool):
    """An older release's set_rates (during a rolling deploy) writes the fields and bumps the
    version, but does not repack: the scripts must read the fields."""
    await scripts.client.hset(pool.policy, mapping={"P2.rate": 0, "P2.ceil": 0})
    await scripts.client.hincrby(pool.policy, "version", 1)
    with pytest.raises(Throttled) as e:
        await admit(scripts, pool, cls="P2", request_id="stale-copy")
    assert e.value.bucket == "class" and e.value.retry_after_ms == -1


async def test_a_server_without_cmsgpack_keeps_no_copy_and_reads_the_fields(cfg):
    """The embedded fakeredis of `qos up` has no cmsgpack in its Lua."""
    client = fakeredis.FakeAsyncRedis()
    scripts = Scripts(client)
    keys = PoolKeys("tiny")
    await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny")))
    assert not await client.hexists(keys.policy, PACKED_POLICY_FIELD)
    await client.zadd(keys.frontends, {"fe1": 4102444800000})
    assert (await admit(scripts, keys, cls="P1", request_id="embedded")).depth == 1
    (got,) = (await scripts.claim(keys, "w1", 1)).requests
    assert got.request_id == "embedded"
