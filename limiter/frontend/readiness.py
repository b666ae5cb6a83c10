"""What ``/readyz`` decides: which of the frontend's pools it can serve now, and why not.

Per pool, because the things a pool needs are its own: on a Redis Cluster its keys live on
one shard (a master down until its failover took only the pools on it away, but the check
pinged one node and asked every primary for the scripts, and any failure made the frontend
503 for every pool: a readiness probe took every frontend out of its load balancer), and
its model servers are its own (one broken server took every pool away the same way). A
pool is out of service when its shard does not answer, its heartbeat is stale, its reply
stream cannot be read, or every live worker of it reports its upstream unreachable.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from limiter.errors import QosError
from limiter.frontend.runtime import Frontend
from limiter.keys import PoolKeys
from limiter.redis_conn import CONNECTION_ERRORS, shard_of

log = logging.getLogger("qos.frontend")

# One shard's check, before its pools count as out of reach: the whole answer stays under a
# probe's 1 s timeout (Kubernetes' default) while a shard's host does not answer at all.
CHECK_S = 0.8
STORE_DOWN = "its Redis shard cannot be reached"  # no address, no driver text: the path needs no key
UPSTREAM_DOWN = "every worker reports its upstream unreachable"


async def readiness(fe: Frontend, asked: str | None) -> tuple[str, dict[str, str]]:
    """(why this frontend can serve none of the pools asked about, '' when it can serve
    one; the pools it cannot serve, each with why). ``asked``: one pool, or every pool."""
    if not fe.bootstrapped:
        return fe.not_ready_because(), {}
    scope = [asked] if asked is not None else list(fe.pool_keys)
    why = dict.fromkeys(await _pools_out_of_reach(fe, scope), STORE_DOWN)
    for pool in scope:
        if pool not in why and (problem := fe.pool_problem(pool)):
            why[pool] = problem
    why.update(await _pools_with_upstream_down(fe, [p for p in scope if p not in why]))
    if len(why) < len(scope):
        return "", why
    return _summary(why, everything=asked is None or len(fe.pool_keys) == 1), why


def _summary(why: dict[str, str], everything: bool) -> str:
    """One line for the 503: the pools grouped by what keeps each out of service."""
    by_reason: dict[str, list[str]] = {}
    for pool, reason in why.items():
        by_reason.setdefault(reason, []).append(pool)
    parts = []
    for reason, pools in by_reason.items():
        if reason == STORE_DOWN:
            parts.append("Redis unavailable" + ("" if everything and len(by_reason) == 1
                                                 else f" for pool {', '.join(pools)}"))
        elif reason == UPSTREAM_DOWN:
            parts.append(f"every worker of pool {', '.join(pools)} reports its upstream unreachable")
        else:
            parts.append(reason)  # fe.pool_problem's: it names its pool
    return "; ".join(parts)


async def _check_server(fe: Frontend, keys: PoolKeys, node: Any) -> None:
    """PING the server holding ``keys``, and load the scripts there again if it lost them
    (a restart without the cache); raises what it met."""
    target = {} if node is None else {"target_nodes": node}
    await fe.client.execute_command("PING", **target)
    loaded = await fe.client.execute_command("SCRIPT EXISTS", *fe.scripts.shas(), **target)
    if not all(loaded):
        await fe.scripts.load_all(keys)


async def _pools_out_of_reach(fe: Frontend, pools: Iterable[str]) -> list[str]:
    """Those of ``pools`` whose server does not answer within CHECK_S; each server is
    checked once, the servers at the same time."""
    pools = list(pools)
    by_server: dict[str, tuple[Any, list[str]]] = {}
    try:
        async with asyncio.timeout(CHECK_S):
            for pool in pools:
                node = await shard_of(fe.client, fe.pool_keys[pool].policy)
                by_server.setdefault("" if node is None else node.name, (node, []))[1].append(pool)
    except Exception as exc:  # no slot map, or a slot no node covers: none can be checked
        log.warning("readiness: the cluster's layout could not be read: %s", exc)
        return pools

    async def answers(node: Any, pool: str) -> bool:
        try:
            async with asyncio.timeout(CHECK_S):
                await _check_server(fe, fe.pool_keys[pool], node)
            return True
        except (TimeoutError, QosError, *CONNECTION_ERRORS) as exc:
            log.warning("readiness: Redis unavailable for pool %s: %s", pool, exc)
            return False

    groups = list(by_server.values())
    ok = await asyncio.gather(*(answers(node, members[0]) for node, members in groups))
    return [p for (_, members), up in zip(groups, ok, strict=True) if not up for p in members]


async def _pools_with_upstream_down(fe: Frontend, pools: Iterable[str]) -> dict[str, str]:
    """Those of ``pools`` none of whose live workers can serve: each one's heartbeat says its
    upstream is unreachable (openai engine, breaker open); and those whose workers could not
    be read (the shard went since it answered). A pool with no worker heartbeat at all is
    left alone: workers may simply not have started yet, and admitted work waits for them.
    (A probe of one pool reads that pool's workers only.)"""
    down: dict[str, str] = {}
    for name in pools:
        keys = fe.pool_keys[name]
        try:
            async with asyncio.timeout(CHECK_S):
                ids = await fe.client.zrange(keys.workers, 0, -1)
                if not ids:
                    continue
                pipe = fe.client.pipeline(transaction=False)
                for w in ids:
                    wid = w.decode() if isinstance(w, bytes) else str(w)
                    pipe.hmget(keys.worker(wid), ["engine", "upstream_state"])
                rows = [r for r in await pipe.execute() if r[0] is not None]  # no hash: expired
        except (TimeoutError, QosError, *CONNECTION_ERRORS) as exc:
            log.warning("readiness: Redis unavailable for pool %s: %s", name, exc)
            down[name] = STORE_DOWN
            continue
        if rows and all(r[1] in (b"open", "open") for r in rows):
            down[name] = UPSTREAM_DOWN
    return down
