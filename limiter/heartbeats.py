"""Pruning the heartbeat sets (``keys.workers``, ``keys.frontends``) of processes long dead.

A process that stops cleanly removes its own entry; one that is killed leaves it behind,
and nothing else ever removed it: ``qos status`` listed dead workers for ever and the sets
grew with every crash. Whoever beats removes, on each beat, at most ``PRUNE_BATCH`` entries
older than a cut-off far past any liveness rule (bounded work per beat, however many died).
"""

from __future__ import annotations

from typing import Any

# Entries removed per call at most: a few beats clear any backlog, no beat does much.
PRUNE_BATCH = 32


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def prune_stale(client: Any, zset: str, older_than_ms: int, *, skip_while: str | None = None,
                      also_hdel: str | None = None, limit: int = PRUNE_BATCH) -> list[str]:
    """Remove up to ``limit`` members of ``zset`` whose score (last beat, Redis ms) is below
    ``older_than_ms``; returns them. ``skip_while``: a key whose existence means "not now"
    (the frontends' outage marker: after a Redis outage an old beat may still count as
    alive). ``also_hdel``: a hash whose fields named by the pruned members go too."""
    if skip_while is not None and await client.exists(skip_while):
        return []
    stale = [_s(m) for m in await client.zrangebyscore(zset, "-inf", f"({older_than_ms}", start=0, num=limit)]
    if not stale:
        return []
    # (A member that beat between the two calls after a silence this long was counted dead
    # by every liveness rule already; its next beat adds it again.)
    pipe = client.pipeline(transaction=False)
    pipe.zrem(zset, *stale)
    if also_hdel is not None:
        pipe.hdel(also_hdel, *stale)
    await pipe.execute()
    return stale
