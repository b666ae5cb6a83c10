"""One pool's Redis state as comparable data, for tests that run the same scripts on two
pools (one call of several requests against separate calls) and compare what each wrote."""

from __future__ import annotations

import json
from typing import Any

from limiter.config import demo_config
from limiter.keys import PoolKeys
from limiter.scripts import lifecycle_keys, policy_document, script_source

ALIVE = 4102444800000  # a frontend heartbeat in 2100: alive throughout a test
# Hash fields that hold the time a call ran (enqueue, deadline, finish and first-token
# times, a bucket's refill time): two calls a moment apart write them differently.
TIME_FIELDS = {"enq_ms", "deadline_ms", "ts", "finished_ms", "first_ms"}


def _number(v: bytes) -> Any:
    try:
        return round(float(v), 6)
    except ValueError:
        return v


def init_demo_pool(client: Any, name: str, class_rate: float | None = None) -> PoolKeys:
    """A pool with the demo pool's policy, and a live frontend fe1. ``class_rate``: every
    class's guaranteed rate and ceiling instead, set even when the pool exists (1e-9:
    buckets that do not refill between two calls, so that separate calls see the class
    buckets a merged one does; admit refuses nearly everything at such rates)."""
    cfg = demo_config()
    keys = PoolKeys(name)
    init_sha = client.script_load(script_source("init_pool"))
    doc = policy_document(cfg, cfg.pool("tiny"))
    if class_rate is not None:
        for c in doc["classes"]:
            c["rate"] = c["ceil"] = class_rate
    client.evalsha(init_sha, len(lifecycle_keys(keys)), *lifecycle_keys(keys), json.dumps(doc),
                   "keep_rates" if class_rate is None else "reset_rates")
    client.zadd(keys.frontends, {"fe1": ALIVE})
    return keys


def copy_pool(client: Any, source: PoolKeys, target: PoolKeys) -> None:
    """Every key of ``source``'s pool copied to ``target``'s, with its TTL: two pools in the
    same state to the last decayed counter, which two runs of the same calls never are."""
    for raw in client.scan_iter(match=source.base + "*", count=1000):
        client.copy(raw, target.base + raw.decode()[len(source.base):])


def pool_state(client: Any, keys: PoolKeys) -> dict[str, Any]:
    """Every key of the pool, by its name within the pool, and whether it has a TTL, with
    what time puts in it left out (the :data:`TIME_FIELDS`, stream entry ids)."""
    out: dict[str, Any] = {}
    for raw in client.scan_iter(match=keys.base + "*", count=1000):
        name = raw.decode()[len(keys.base):]
        kind = client.type(raw).decode()
        if kind == "hash":
            value: Any = {f.decode(): _number(v) for f, v in client.hgetall(raw).items()
                          if f.decode() not in TIME_FIELDS}
        elif name == "deadlines":
            value = sorted(client.zrange(raw, 0, -1))
        elif kind == "zset":
            value = [(m, round(s, 6)) for m, s in client.zrange(raw, 0, -1, withscores=True)]
        elif kind == "stream":
            value = [fields for _, fields in client.xrange(raw)]
        else:
            value = client.dump(raw)
        out[name] = (value, client.pttl(raw) != -1)
    return out
