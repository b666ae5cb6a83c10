"""One shard of a Redis Cluster out of reach takes only the pools on it out of service.

A private 3-master cluster run with ``cluster-require-full-coverage no`` (the setting with
which a cluster keeps serving the slots it still covers: an operator's choice where each
shard's pools are separate products), two pools on two shards, a frontend serving both,
a sim worker per pool and a controller for both, all real processes. The first pool's
master is killed. The frontend beat every pool in one loop and its readiness asked every
primary: it refused both pools' requests and /readyz said 503, so behind a readiness
probe one shard took every frontend out of its load balancer. Now the other pool is
served, its heartbeat moves, its controller ticks, and /readyz lists the lost pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio.cluster import RedisCluster
from rich.console import Console

from limiter import status as status_mod
from limiter.config import PoolConfig, load
from limiter.keys import PoolKeys
from limiter.localstack.redis_server import LocalRedisCluster, RedisServer
from limiter.ops_cli import full_snapshot, render
from limiter.redis_conn import SOCKET_TIMEOUT_S
from limiter.status import UNREACHABLE
from tests.support.redis_server import pools_on_different_shards, unread_requests_at
from tests.support.reliability_stack import KEY_P0, LiveStack, base_config

DEADLINE_S = 60.0
# The socket timeout the stack's processes get where a test stops a shard: longer than the
# test, so a call to that shard waits until it is resumed (the default 5 s ended such calls
# while the test still counted on them).
HELD_SOCKET_TIMEOUT_S = 600.0


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = DEADLINE_S) -> None:
    """Wait until ``check()`` holds (it may raise meanwhile: not yet), at most ``timeout_s``."""
    end = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < end:
        try:
            if await check():
                return
        except Exception as exc:  # the state is not there yet
            last = exc
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last error: {last!r})")


async def _complete(http: aiohttp.ClientSession, base: str, pool: str) -> tuple[int, dict]:
    """One 8-token completion of ``pool``'s model through the frontend at ``base``."""
    body = {"model": f"model-{pool}", "prompt": "hello", "max_tokens": 8}
    headers = {"Authorization": f"Bearer {KEY_P0}"}
    async with http.post(base + "/v1/completions", json=body, headers=headers) as r:
        return r.status, await r.json()


async def _pools_and_the_shard_to_stop(
        cluster: LocalRedisCluster) -> tuple[RedisCluster, str, str, RedisServer]:
    """A client of ``cluster``, two pools on different shards (the one to lose, the one to
    keep) and the server of the first, which is not the clients' seed node (that one must
    answer: every client reads the cluster's layout from it)."""
    client = RedisCluster.from_url(cluster.url)
    await client.initialize()
    a, b = pools_on_different_shards(client)
    seed_port = cluster.nodes[0].port
    lost, kept = (a, b) if client.get_node_from_key(PoolKeys(a).policy).port != seed_port else (b, a)
    hung = cluster.owner(PoolKeys(lost).policy)
    assert hung.port != seed_port and hung.proc is not None
    return client, lost, kept, hung


@pytest.fixture
def private_cluster() -> LocalRedisCluster:
    cluster = LocalRedisCluster(extra=["--cluster-require-full-coverage", "no"]).start()
    try:
        yield cluster
    finally:
        cluster.stop()


async def test_a_shard_down_takes_only_its_own_pools_out_of_service(
        private_cluster: LocalRedisCluster, tmp_path: Path) -> None:
    client = RedisCluster.from_url(private_cluster.url)
    await client.initialize()
    lost, kept = pools_on_different_shards(client)
    cfg = base_config(private_cluster.url, pools=(lost, kept), cluster=True)
    for p in cfg["pools"]:
        p["model"] = f"model-{p['name']}"
    stack = LiveStack(tmp_path, cfg)
    try:
        stack.frontend("fe0")
        for p in (lost, kept):
            stack.worker(f"w-{p}", pool=p)
        stack.controller("ctl0")
        await stack.wait_ready(client)
        base = stack.base("fe0")
        keys = PoolKeys(kept)
        survivor = client.get_node_from_key(keys.policy)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:

            def complete(pool: str) -> Awaitable[tuple[int, dict]]:
                return _complete(http, base, pool)

            async def readyz(query: str = "") -> tuple[int, dict]:
                async with http.get(base + "/readyz" + query) as r:
                    return r.status, await r.json()

            for p in (lost, kept):
                assert (await complete(p))[0] == 200
            private_cluster.owner(PoolKeys(lost).policy).stop()
            killed_ms = int(time.time() * 1000)

            async def lost_is_degraded() -> bool:
                status, body = await readyz()
                return status == 200 and body.get("degraded") == {lost: "its Redis shard cannot be reached"}

            await _until(lost_is_degraded, f"/readyz to be 200 with pool {lost} listed as degraded")
            status, body = await readyz(f"?pool={lost}")
            assert status == 503 and body["reason"] == f"Redis unavailable for pool {lost}"
            assert (await readyz(f"?pool={kept}"))[0] == 200

            status, body = await complete(lost)
            assert status == 503 and body["error"]["code"] == "redis_unavailable"
            # The kept pool's shard loses its scripts too (a restart without the cache): they
            # are loaded again on that shard alone, by the frontend and by the worker.
            # redis-py's own fallback loaded them on every primary, the dead one included,
            # and failed. (After the readiness checks, which load them too.)
            await client.execute_command("SCRIPT", "FLUSH", target_nodes=survivor)
            for _ in range(5):  # the kept pool is served, end to end, again and again
                status, body = await complete(kept)
                assert status == 200, body
                assert body["usage"]["completion_tokens"] == 8

            async def beats_after_the_kill() -> bool:
                score = await client.zscore(keys.frontends, (await stack.frontend_ids())["fe0"])
                return score is not None and score > killed_ms + 2000

            await _until(beats_after_the_kill, f"the frontend's heartbeat in pool {kept} to move on")

            async def controller_ticks() -> bool:
                updated = await client.hget(keys.compliance, ".updated_ms")
                return updated is not None and int(updated) > killed_ms + 2000

            await _until(controller_ticks, f"the controller to publish pool {kept}'s figures after the kill")

            # The operator's view (`qos status`, `qos top`, /v1/qos/status): one shard down hid
            # every pool's status behind "Redis unavailable"; the lost pool is marked instead.
            snap = await full_snapshot(client, load(stack.path, env={}), 5)
            assert snap["pools"][lost] == {"model": f"model-{lost}", "unreachable": UNREACHABLE}
            assert snap["pools"][kept]["workers"] and snap["pools"][kept]["compliance_age_s"] is not None
            rendered = Console(width=200, record=True)
            rendered.print(render(snap))
            assert f"pool {lost} (model model-{lost}) — {UNREACHABLE}" in rendered.export_text()
    finally:
        stack.stop()
        await client.aclose()


async def test_a_frontend_started_while_a_shard_hangs_serves_the_others_then_that_pool_once_back(
        private_cluster: LocalRedisCluster, tmp_path: Path) -> None:
    """A frontend (and a worker) started while one shard's host does not answer at all (its
    process stopped: every call to it waits out its socket timeout). The start loaded the
    scripts on every primary, and the frontend was never ready for any pool; and one beat
    loop for all pools would have waited on that shard at every beat. Now the other pool
    is served at once, /readyz answers within a probe's timeout, and the lost pool is set
    up and served once its shard answers again."""
    client, lost, kept, hung = await _pools_and_the_shard_to_stop(private_cluster)
    cfg = base_config(f"{private_cluster.url}?socket_timeout={HELD_SOCKET_TIMEOUT_S:g}", pools=(lost, kept),
                      cluster=True)
    for p in cfg["pools"]:
        p["model"] = f"model-{p['name']}"
    stack = LiveStack(tmp_path, cfg)
    os.kill(hung.proc.pid, signal.SIGSTOP)
    try:
        stack.frontend("fe0")
        for p in (lost, kept):
            stack.worker(f"w-{p}", pool=p)
        stack.controller("ctl0")
        started_ms = int(time.time() * 1000)
        base = stack.base("fe0")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:

            def complete(pool: str) -> Awaitable[tuple[int, dict]]:
                return _complete(http, base, pool)

            async def readyz() -> tuple[int, dict, float]:
                t0 = time.monotonic()
                async with http.get(base + "/readyz") as r:
                    return r.status, await r.json(), time.monotonic() - t0

            async def kept_served() -> bool:
                status, body, _ = await readyz()
                return status == 200 and set(body.get("degraded", {})) == {lost} \
                    and (await complete(kept))[0] == 200

            await _until(kept_served, f"pool {kept} served while pool {lost}'s shard hangs")
            status, body, took_s = await readyz()
            # a bound on a hang, not a speed check: the check bounds each shard's part at
            # readiness.CHECK_S (0.8 s, under a probe's 1 s); one that waited on the stopped
            # shard took its socket timeout (5 s). Three checks' worth leaves a loaded machine
            # its margin and still fails a CHECK_S raised to 3 s, or checks made one by one.
            from limiter.frontend import readiness

            assert status == 200 and took_s < 3 * readiness.CHECK_S < SOCKET_TIMEOUT_S, \
                (status, body, took_s)
            status, body = await complete(lost)
            assert status == 503 and body["error"]["code"] == "redis_unavailable"
            # The kept pool beats at its own period meanwhile: one loop for every pool beat it
            # once per call to the hung shard (its socket timeout, 5 s), and its heartbeat went
            # stale between. Over 8 s, 32 beats are due; 4 is what a loaded machine must beat.
            fe_id = (await stack.frontend_ids())["fe0"]
            scores, end = set(), time.monotonic() + 8.0
            while time.monotonic() < end:
                scores.add(await client.zscore(PoolKeys(kept).frontends, fe_id))
                await asyncio.sleep(0.05)
            assert len(scores) >= 4, f"pool {kept} beat {len(scores)} times in 8 s while another shard hung"

            async def controller_ticks() -> bool:
                updated = await client.hget(PoolKeys(kept).compliance, ".updated_ms")
                return updated is not None and int(updated) > started_ms

            await _until(controller_ticks, f"the controller (started meanwhile) to publish pool {kept}")

            os.kill(hung.proc.pid, signal.SIGCONT)

            async def lost_served() -> bool:
                status, body, _ = await readyz()
                return status == 200 and "degraded" not in body and (await complete(lost))[0] == 200

            await _until(lost_served, f"pool {lost} set up and served once its shard answers")
            assert (await complete(kept))[0] == 200
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung.proc.pid, signal.SIGCONT)
        stack.stop()
        await client.aclose()


async def test_a_shard_that_stops_answering_under_load_does_not_hold_up_another_pool(
        private_cluster: LocalRedisCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard whose host stops answering (its process stopped: no reset, every call waits
    out the socket timeout) while its pool has requests coming in. Each of them took one
    of the frontend's command turns, which were one set for the whole process: with all of
    them held, the other pool's requests waited for the lost pool's calls to time out. The
    turns are per node now: the kept pool is served while the lost pool's calls still wait.
    And the operator's status read (`qos status`, `qos top`, /v1/qos/status) read the pools
    one after another, each of the stopped shard's waiting out the socket timeout: it now
    reads them together, each within POOL_READ_S.

    The processes' socket timeout is far longer than the test (``?socket_timeout=`` in the
    URL): the lost pool's calls hold their turns until the shard is resumed, whatever the
    machine's speed, so with one set of turns the kept pool's requests could not be served."""
    turns = 4  # the frontend's redis_max_connections: its turns per node
    client, lost, kept, hung = await _pools_and_the_shard_to_stop(private_cluster)
    also_lost = next(name for i in range(10_000) if client.get_node_from_key(
        PoolKeys(name := f"{lost}-also{i}").policy).port == hung.port)  # a second pool on that shard
    cfg = base_config(f"{private_cluster.url}?socket_timeout={HELD_SOCKET_TIMEOUT_S:g}",
                      pools=(lost, also_lost, kept), cluster=True, frontend={"redis_max_connections": turns})
    for p in cfg["pools"]:
        p["model"] = f"model-{p['name']}"
    stack = LiveStack(tmp_path, cfg)
    try:
        stack.frontend("fe0")
        stack.worker(f"w-{kept}", pool=kept)  # none for the lost pool: the frontend's calls alone wait there
        await stack.wait_ready(client)
        base = stack.base("fe0")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            assert (await _complete(http, base, kept))[0] == 200
            os.kill(hung.proc.pid, signal.SIGSTOP)
            lost_calls: list[asyncio.Task] = []
            for _ in range(3 * turns):  # one at a time: requests of one loop turn share a call
                lost_calls.append(asyncio.ensure_future(_complete(http, base, lost)))
                await asyncio.sleep(0.03)

            async def turns_held() -> bool:
                return unread_requests_at(hung.port) >= turns

            await _until(turns_held, f"{turns} calls waiting on the stopped shard")
            for _ in range(5):
                status, body = await _complete(http, base, kept)
                assert status == 200, body
            held = unread_requests_at(hung.port)
            assert held >= turns, f"{held} calls still wait on the stopped shard: its turns were not all held"

            # the status read, in this process: its pools' reads, and how many of the stopped
            # shard's were under way together (one after another: never both)
            under_way: set[str] = set()
            together: list[int] = []
            read_one = status_mod._pool_status

            async def counted(client_: object, cfg_: object, pool: PoolConfig, clocks: dict) -> object:
                under_way.add(pool.name)
                together.append(len(under_way & {lost, also_lost}))
                try:
                    return await read_one(client_, cfg_, pool, clocks)
                finally:
                    under_way.discard(pool.name)

            monkeypatch.setattr(status_mod, "_pool_status", counted)
            bound_s = 4 * status_mod.POOL_READ_S  # a hang's bound, not a speed check
            # a client of its own whose calls to the stopped shard wait as long as the frontend's:
            # only POOL_READ_S ends these reads (the default 5 s socket timeout would, too)
            reader = RedisCluster.from_url(f"{private_cluster.url}?socket_timeout={HELD_SOCKET_TIMEOUT_S:g}")
            try:
                async with asyncio.timeout(bound_s):
                    snap = await full_snapshot(reader, load(stack.path, env={}), 5)
            except TimeoutError:
                raise AssertionError(
                    f"the status read still waited on the stopped shard after {bound_s:g} s") from None
            finally:
                await reader.aclose()
            for p in (lost, also_lost):
                assert snap["pools"][p] == {"model": f"model-{p}", "unreachable": UNREACHABLE}
            assert snap["pools"][kept]["workers"], snap["pools"][kept]
            assert max(together) == 2, f"the stopped shard's pools were read one after another: {together}"
            for t in lost_calls:  # no worker serves that pool: they would wait for one
                t.cancel()
            await asyncio.gather(*lost_calls, return_exceptions=True)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung.proc.pid, signal.SIGCONT)
        stack.stop()
        await client.aclose()
