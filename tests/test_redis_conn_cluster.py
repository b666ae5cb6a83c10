"""open_redis on a cluster: more commands in flight than connections wait their turn (as on a
standalone Redis) instead of failing at once with redis-py's MaxConnectionsError; and a
connection the server closed while idle is opened again, as the standalone pool does."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from limiter.cluster_client import UNKNOWN_NODE, CheckedConnection, WaitingRedisCluster
from limiter.config import RedisConfig
from limiter.localstack.redis_server import LocalRedisCluster
from limiter.redis_conn import open_redis
from tests.support.helpers import wait_until
from tests.support.redis_server import move_slot, pools_on_different_shards

HOLD_S = 0.2  # each command holds its connection this long (BLPOP on an empty list)


async def _hold(client, n: int) -> list[object]:
    return await asyncio.gather(*(client.blpop(["qos:{conn}:empty"], HOLD_S) for _ in range(n)),
                                return_exceptions=True)


async def test_commands_beyond_max_connections_wait_for_a_turn(redis_cluster) -> None:
    client = open_redis(RedisConfig(url=redis_cluster.url, cluster=True), max_connections=2, pool_wait_s=5.0)
    assert isinstance(client, WaitingRedisCluster)
    try:
        t0 = time.monotonic()
        got = await _hold(client, 6)
        took = time.monotonic() - t0
        assert got == [None] * 6  # every one answered: none failed for want of a connection
        assert took >= 3 * HOLD_S * 0.9  # two at a time: three turns
        async with client.pipeline(transaction=False) as pipe:  # pipelines take a turn too
            pipe.get("qos:{conn}:x")
            assert await pipe.execute() == [None]
    finally:
        await client.aclose()


async def test_a_turn_not_given_within_pool_wait_is_an_outage(redis_cluster) -> None:
    client = open_redis(RedisConfig(url=redis_cluster.url, cluster=True), max_connections=1, pool_wait_s=0.05)
    try:
        got = await _hold(client, 3)
        assert got[0] is None
        assert any(isinstance(g, RedisConnectionError) for g in got[1:])
    finally:
        await client.aclose()


async def test_without_pool_wait_the_cluster_client_fails_at_once(redis_cluster) -> None:
    """What the waiting client is for: redis-py's own refuses a command past max_connections."""
    client = open_redis(RedisConfig(url=redis_cluster.url, cluster=True), max_connections=1)
    assert not isinstance(client, WaitingRedisCluster)
    try:
        await client.initialize()  # the three below go out together, not behind a first read of the map
        got = await _hold(client, 3)
        assert any(isinstance(g, RedisConnectionError) for g in got)
    finally:
        await client.aclose()


def _kill_clients_named(nodes, name: str) -> int:
    """Close, server side, every connection named ``name`` on ``nodes``, as Redis' idle
    ``timeout`` does: the count closed."""
    closed = 0
    for node in nodes:
        with node.client() as c:
            for entry in c.client_list():
                if entry["name"] == name:
                    closed += c.client_kill_filter(_id=entry["id"])
    return closed


async def _closed_seen_by(connections) -> bool:
    """Whether each of ``connections`` has seen its server close it (EOF on the socket)."""
    for conn in connections:
        try:
            await conn.can_read()
        except (RedisConnectionError, OSError):
            continue
        return False
    return True


@pytest.mark.parametrize("pool_wait_s", [None, 5.0], ids=["plain", "waiting"])
async def test_connections_the_server_closed_while_idle_are_opened_again_not_an_outage(
        redis_cluster, pool_wait_s) -> None:
    """A connection the server closed while it sat idle (Redis' ``timeout``, a managed
    service's idle limit) is opened again before the next command: redis-py's cluster node
    handed it out as it was and the command failed, "Connection closed by server", once per
    node (a 503, a worker's back-off)."""
    name = f"idle-{pool_wait_s}"
    client = open_redis(RedisConfig(url=f"{redis_cluster.url}?client_name={name}", cluster=True),
                        pool_wait_s=pool_wait_s)
    keys = [f"qos:{{idle{i}}}:k" for i in range(12)]  # spread over the three masters
    try:
        for key in keys:
            await client.set(key, "1")
        assert _kill_clients_named(redis_cluster.nodes, name) >= 3
        connections = [c for node in client.get_nodes() for c in node._connections]
        deadline = time.monotonic() + 15
        while not await _closed_seen_by(connections):
            assert time.monotonic() < deadline, "still waiting for the client to see its connections closed"
            await asyncio.sleep(0.01)
        assert [await client.get(key) for key in keys] == [b"1"] * len(keys)
    finally:
        await client.aclose()


async def test_a_reply_not_yet_read_is_not_taken_for_a_closed_connection(redis_server) -> None:
    """Commands sent before their replies are read (the handshake sends several; a pipeline)
    keep their connection: only a connection the server closed is opened again. Taking the
    first reply, already buffered, for a closed connection reconnected in the middle of the
    handshake, and one command in ten of a fresh cluster client timed out."""
    conn = CheckedConnection(port=redis_server.port)
    try:
        await conn.connect()
        await conn.send_command("PING")
        deadline = time.monotonic() + 15
        while not await conn.can_read():
            assert time.monotonic() < deadline, "still waiting for PING's reply to arrive"
            await asyncio.sleep(0.01)
        await conn.send_command("ECHO", "second")
        assert [await conn.read_response(), await conn.read_response()] == [b"PONG", b"second"]
    finally:
        await conn.disconnect()


async def test_the_handshake_is_not_checked_for_a_closed_connection(redis_server, monkeypatch) -> None:
    """While connecting, nothing is checked: a check finding the connection closed there
    would connect again inside the handshake."""
    async def closed(self) -> bool:
        raise RedisConnectionError("closed")

    conn = CheckedConnection(port=redis_server.port, client_name="handshake")  # several commands
    monkeypatch.setattr(CheckedConnection, "can_read", closed)
    try:
        await conn.connect()
        assert conn.is_connected
    finally:
        await conn.disconnect()


def _a_node_not_holding(redis_cluster, key: str):
    owner = redis_cluster.owner(key)
    return next(n for n in redis_cluster.nodes if n.port != owner.port)


async def test_a_cluster_node_named_without_redis_cluster_is_a_config_error(redis_cluster) -> None:
    """redis.url a node of a Redis Cluster, redis.cluster left false: a command on a slot of
    another node is answered MOVED, which a client that does not speak cluster does not
    follow. Scripts, plain commands and pipelines said only "2789 127.0.0.1:22896" (the
    slot and the other node): now a configuration error naming the setting."""
    from limiter.config import demo_config
    from limiter.errors import ConfigError
    from limiter.keys import PoolKeys
    from limiter.redis_conn import map_redis_errors
    from limiter.scripts import Scripts, policy_document
    from limiter.status import snapshot

    cfg, keys = demo_config(), PoolKeys("tiny")
    node = _a_node_not_holding(redis_cluster, keys.policy)
    client = open_redis(RedisConfig(url=node.url, cluster=False))
    want = r"redis\.cluster: redis\.url is a node of a Redis Cluster .* set redis\.cluster = true"
    try:
        with pytest.raises(ConfigError, match=want):
            await Scripts(client).init_pool(keys, policy_document(cfg, cfg.pool("tiny")))
        with pytest.raises(ConfigError, match=want):
            with map_redis_errors():
                await client.exists(keys.policy)
        with pytest.raises(ConfigError, match=want):
            await snapshot(client, cfg)  # pipelines
    finally:
        await client.aclose()


@pytest.mark.parametrize("role", [["controller", "--id", "x"], ["status"], ["frontend", "--port", "0"],
                                  ["worker", "--engine", "sim"]])
def test_a_role_on_a_cluster_node_without_redis_cluster_exits_naming_it(redis_cluster, role) -> None:
    """The controller logged a MovedError traceback every second for ever; `qos status`, the
    frontend and the worker named the slot and another node. Each now exits 2 naming
    redis.cluster."""
    import subprocess
    import sys

    node = _a_node_not_holding(redis_cluster, "qos:{tiny}:policy")
    proc = subprocess.run([sys.executable, "-m", "limiter.cli", role[0], "--redis-url", node.url, *role[1:]],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert "config error: redis.cluster: redis.url is a node of a Redis Cluster" in proc.stderr, proc.stderr
    assert "127.0.0.1" not in proc.stderr.rpartition("config error")[2]  # no node's address


async def test_a_controller_finding_the_cluster_node_later_ends_naming_it(redis_cluster, monkeypatch) -> None:
    """Redis out of reach at the controller's start skips its check; once Redis answered as
    a cluster node named without redis.cluster, every loop logged the error and went on, a
    traceback a second for ever (found by a review). The process now ends with it."""
    import asyncio
    import dataclasses

    from limiter.config import demo_config
    from limiter.controller.service import Controller, serve
    from limiter.errors import ConfigError
    from tests.support.controller_helpers import fast_settings

    async def unreachable_at_start(self) -> None:
        return None

    monkeypatch.setattr(Controller, "_check_redis_mode", unreachable_at_start)
    node = _a_node_not_holding(redis_cluster, "qos:{tiny}:policy")
    base = demo_config()
    cfg = dataclasses.replace(base, redis=dataclasses.replace(base.redis, url=node.url, cluster=False))
    with pytest.raises(ConfigError, match=r"redis\.cluster"):
        await asyncio.wait_for(serve(fast_settings(cfg), cfg), 30)


def test_status_and_top_run_on_a_cluster(redis_cluster, monkeypatch, capsys) -> None:
    """A new client knows no slots until its first command: reading each pool's clock from
    its shard first said every slot was not covered (found by a review)."""
    import json

    from limiter.cli import main

    monkeypatch.setenv("QOS_REDIS_CLUSTER", "1")
    assert main(["status", "--json", "--redis-url", redis_cluster.url]) == 0, capsys.readouterr().err
    assert "tiny" in json.loads(capsys.readouterr().out)["pools"]
    assert main(["top", "--iterations", "1", "--interval", "0.1", "--redis-url", redis_cluster.url]) == 0


@pytest.mark.parametrize("role", [["controller", "--id", "x"], ["status"], ["frontend", "--port", "0"],
                                  ["worker", "--engine", "sim"]])
def test_a_role_with_redis_cluster_on_a_standalone_redis_exits_naming_it(redis_server, role) -> None:
    """The mirror of the case above: redis.cluster = true (or QOS_REDIS_CLUSTER=1) with
    redis.url a standalone Redis. redis-py answers "Redis Cluster cannot be connected ...:
    Cluster mode is not enabled on this node", which was read as an outage: the frontend
    answered 503 "not connected to Redis yet", the worker and the controller retried for
    ever (and `qos up` with a cluster config waited out its ready timeout). A Redis that
    says it is no cluster is the deployment's mistake: each role exits 2 naming it."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, QOS_REDIS_CLUSTER="1")
    try:
        proc = subprocess.run([sys.executable, "-m", "limiter.cli", role[0], "--redis-url", redis_server.url,
                               *role[1:]], capture_output=True, text=True, timeout=20, env=env)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{role[0]} still running after 20 s: {exc.stderr!r:.1500}") from None
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert "config error: redis.cluster:" in proc.stderr and "not a Redis Cluster" in proc.stderr, \
        proc.stderr[-1500:]


async def test_a_cluster_node_busy_with_a_script_is_an_outage_not_a_config_error(redis_cluster) -> None:
    """A cluster node running a script past busy-reply-threshold answers CLUSTER SLOTS with
    BUSY, a ResponseError: redis-py's "Cluster mode is not enabled on this node" then wraps
    a real cluster's passing state. Read as redis.cluster's mistake (a ConfigError), it made
    every role that (re)built its slot map then exit; it is an outage, retried."""
    import threading

    import redis as sync_redis

    from limiter.errors import RedisUnavailable
    from limiter.redis_conn import map_redis_errors

    url = redis_cluster.url
    node = sync_redis.Redis.from_url(url)
    node.config_set("busy-reply-threshold", 100)
    ended: list[BaseException] = []

    # Until SCRIPT KILL: it cannot end before the test looked. A backstop of 60 s of Redis time
    # ends it anyway, should the kill fail, so that the shared cluster is not left BUSY for the
    # tests after this one.
    endless = ("local t0 = tonumber(redis.call('TIME')[1]) "
               "while tonumber(redis.call('TIME')[1]) < t0 + 60 do end")

    def run_script() -> None:
        runner = sync_redis.Redis.from_url(url)
        try:
            runner.eval(endless, 0)
        except sync_redis.exceptions.ResponseError as exc:  # "Script killed by user"
            ended.append(exc)
        finally:
            runner.close()

    busy = threading.Thread(target=run_script, daemon=True)
    busy.start()
    client = open_redis(RedisConfig(url=url, cluster=True))
    try:
        def answers_busy() -> bool:  # the script ran past the threshold
            try:
                node.ping()
            except sync_redis.exceptions.ResponseError as exc:
                return str(exc).startswith("BUSY")
            return False

        await wait_until(answers_busy, "the node to answer BUSY while the script runs")
        with pytest.raises(RedisUnavailable), map_redis_errors():
            await client.get("qos:{conn}:x")
    finally:
        await client.aclose()
        end = time.monotonic() + 15
        while busy.is_alive() and time.monotonic() < end:  # SCRIPT KILL: NOTBUSY until it began
            with contextlib.suppress(sync_redis.exceptions.ResponseError):
                node.script_kill()
            busy.join(0.05)
        killed = not busy.is_alive()
        busy.join(70)  # not killed: the backstop ends it (a failure below, the cluster free again)
        node.config_set("busy-reply-threshold", 5000)
        node.close()
    assert killed, "the endless script was not killed within 15 s"
    assert ended, "the script ended by itself"


async def test_pipelines_a_reshard_redirects_do_not_wait_for_a_second_turn(redis_cluster) -> None:
    """After a reshard (``redis-cli --cluster reshard``: docs/scaling.md) the commands of a
    pipeline sent on the old map come back MOVED, and redis-py sends each again alone,
    through ``execute_command``, inside the pipeline's turn. The waiting client made that
    resend wait for a turn of its own: with every turn held by such pipelines (a worker's 8,
    the script batcher's pipelines in flight) none could go on, and all waited out
    ``pool_wait_s`` (a worker's 30 s: its leases lapsed) to fail as an outage."""
    client = open_redis(RedisConfig(url=redis_cluster.url, cluster=True), max_connections=2, pool_wait_s=5.0)
    key = "qos:{resharded}:k"
    try:
        await client.set(key, "1")  # the client's map: the slot on its first owner
        src, dst = move_slot(redis_cluster, key)
        assert src is not dst

        async def pipelined() -> list[object]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.get(key)
                pipe.incr(key)
                return await pipe.execute(raise_on_error=False)

        t0 = time.monotonic()
        got = await asyncio.gather(pipelined(), pipelined(), return_exceptions=True)
        took = time.monotonic() - t0
        assert all(isinstance(g, list) and not any(isinstance(x, Exception) for x in g) for g in got), got
        assert sorted(incr for _, incr in got) == [2, 3]  # each INCR ran once, on the new owner
        assert took < 2.0, f"the redirected pipelines took {took:.1f} s"
        assert await client.get(key) == b"3"
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def _waiting_client(url: str, turns: int) -> AsyncIterator[tuple[WaitingRedisCluster, Any]]:
    """A waiting client with ``turns`` turns per node (its slot map read) and a plain one."""
    client = open_redis(RedisConfig(url=url, cluster=True), max_connections=turns, pool_wait_s=10.0)
    pusher = open_redis(RedisConfig(url=url, cluster=True))
    try:
        await client.initialize()
        yield client, pusher
    finally:
        await client.aclose()
        await pusher.aclose()


async def _held_on(client, key: str, n: int) -> list[asyncio.Task]:
    """``n`` BLPOPs of ``key`` (empty: each holds its connection and turn), once all are sent."""
    waiting = [asyncio.ensure_future(client.blpop([key], 4)) for _ in range(n)]
    node = client.get_node_from_key(key)
    deadline = time.monotonic() + 10.0
    while len(node._connections) - len(node._free) < n:  # in flight on the node, not waiting a turn
        assert time.monotonic() < deadline, f"timed out waiting for {n} BLPOPs in flight on {node.name}"
        await asyncio.sleep(0.01)
    return waiting


async def test_a_node_whose_turns_are_all_held_does_not_hold_up_another_node(redis_cluster) -> None:
    """The turns are per node: a shard that does not answer (a host gone without a reset)
    holds each call for the socket timeout, and with one set of turns for the client its
    calls took every turn and the calls of the other shards' pools waited too. Here one
    node's two turns are held (BLPOPs); commands and a pipeline to another node answer while
    they still wait, and a third command to the held node waits its turn."""
    async with _waiting_client(redis_cluster.url, 2) as (client, pusher):
        held_key, other_key = (f"qos:{{{p}}}:turns" for p in pools_on_different_shards(client))
        await pusher.delete(held_key, other_key)
        held = await _held_on(client, held_key, 2)
        third = asyncio.ensure_future(client.lpush(held_key, "x"))  # waits: its node's turns are taken
        assert await client.set(other_key, "1") is True
        async with client.pipeline(transaction=False) as pipe:
            pipe.get(other_key)
            pipe.incr(other_key)
            assert await pipe.execute() == [b"1", 2]
        assert await client.evalsha(await client.script_load("return 7"), 1, other_key) == 7
        assert not any(t.done() for t in held) and not third.done(), "the held node's calls ended first"
        await pusher.lpush(held_key, "a", "b")  # ends the BLPOPs: the third gets a turn
        assert sorted(value for _, value in await asyncio.gather(*held)) == [b"a", b"b"]
        assert await third == 1


async def test_a_pipeline_over_two_nodes_takes_a_turn_of_each(redis_cluster) -> None:
    """A pipeline holds a connection of every node its commands go to: it waits for a turn
    of each, and holds none while it waits. Here one node's only turn is held by a BLPOP; a
    pipeline whose first command goes to the other node and whose second pushes to the
    BLPOP's list waits until the BLPOP has ended (had it not, the BLPOP would have popped
    the pipeline's value), and the other node's turn stays free meanwhile."""
    async with _waiting_client(redis_cluster.url, 1) as (client, pusher):
        # the held node last in any order by name, so that a pipeline which takes its turns
        # one after the other in that order holds the other's while it waits
        other_key, held_key = sorted((f"qos:{{{p}}}:piped" for p in pools_on_different_shards(client)),
                                     key=lambda k: client.get_node_from_key(k).name)
        await pusher.delete(held_key, other_key)
        (held,) = await _held_on(client, held_key, 1)

        async def both() -> list[object]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.set(other_key, "1")
                pipe.rpush(held_key, "from the pipeline")
                return await pipe.execute()

        piped = asyncio.ensure_future(both())
        turns = client.turns_of(client.get_node_from_key(held_key).name)
        deadline = time.monotonic() + 10.0
        while not (piped.done() or held.done() or turns._waiters):
            assert time.monotonic() < deadline, "timed out waiting for the pipeline to wait or end"
            await asyncio.sleep(0.01)
        assert not piped.done() and not held.done(), "the pipeline ran without the held node's turn"
        assert await client.get(other_key + "x") is None  # the other node's turn is free meanwhile
        assert not held.done()
        await pusher.lpush(held_key, "from outside")
        assert (await held)[1] == b"from outside"
        assert await piped == [True, 1]


@pytest.mark.parametrize("queued", ["unlink", "script calls"])
async def test_a_pipeline_takes_the_turns_of_commands_queued_any_way(redis_cluster, queued: str) -> None:
    """The pipeline waits for the held node's turn whatever its commands: ``pipe.unlink``
    (awaited: it may split its keys) queues without ``pipe.execute_command`` (the pipeline's
    nodes are read from redis-py's own queue: it took the unknown node's turn and ran at
    once), and a script batcher's pipeline of EVALSHAs of one slot looks its node up once."""
    async with _waiting_client(redis_cluster.url, 1) as (client, pusher):
        held_key = f"qos:{{{pools_on_different_shards(client)[0]}}}:piped-{queued[0]}"
        await pusher.delete(held_key)
        sha = await client.script_load("return redis.call('EXISTS', KEYS[1])")
        (held,) = await _held_on(client, held_key, 1)

        async def pipelined() -> list[object]:
            async with client.pipeline(transaction=False) as pipe:
                if queued == "unlink":
                    await pipe.unlink(held_key + "-other")
                else:
                    for _ in range(3):
                        pipe.execute_command("EVALSHA", sha, 1, held_key + "-other")
                return await pipe.execute()

        piped = asyncio.ensure_future(pipelined())
        turns = client.turns_of(client.get_node_from_key(held_key).name)
        deadline = time.monotonic() + 10.0
        while not (piped.done() or turns._waiters):
            assert time.monotonic() < deadline, "timed out waiting for the pipeline to wait or end"
            await asyncio.sleep(0.01)
        assert not piped.done(), "the pipeline ran without its node's turn"
        await pusher.lpush(held_key, "x")
        assert (await held)[1] == b"x"
        assert await piped == ([0] if queued == "unlink" else [0, 0, 0])


async def test_commands_a_reshard_redirects_to_a_busy_node_find_connections(redis_cluster) -> None:
    """A command follows MOVED inside the turn of the node it was first sent to: the new
    owner's turns are not asked for. After slots of two nodes moved to a third whose only
    turn is held, a command of each old owner is redirected there: each finds a connection
    (the turns bound the pools, not redis-py's cap). With a pool of exactly the turns the
    first failed with redis-py's MaxConnectionsError, an outage; with twice the turns the
    second still did (found by a review)."""
    async with _waiting_client(redis_cluster.url, 1) as (client, pusher):
        new_owner, *old_owners = redis_cluster.nodes

        def key_on(node, tag: str) -> str:
            return next(k for k in (f"qos:{{{tag}{i}}}:k" for i in range(10_000))
                        if redis_cluster.owner(k) is node and client.get_node_from_key(k).port == node.port)

        busy_key = key_on(new_owner, "busy")
        moved = [key_on(n, f"moved{j}-") for j, n in enumerate(old_owners)]
        await pusher.delete(busy_key, *moved)
        for key in moved:  # the client's map still has each on its old owner
            _move_empty_slot(redis_cluster, key, new_owner)
        (held,) = await _held_on(client, busy_key, 1)  # the new owner's only turn
        got = await asyncio.gather(*(client.set(k, "1") for k in moved), return_exceptions=True)
        assert got == [True, True]  # each sent to its old owner, MOVED, answered by the new
        assert not held.done()
        await pusher.lpush(busy_key, "x")
        assert (await held)[1] == b"x"


def _move_empty_slot(cluster, key: str, to) -> None:
    """Give ``key``'s slot (no key in it) to the master ``to``, as a reshard's last step does."""
    slot = key_slot(key.encode())
    with to.client() as c:
        to_id = c.execute_command("CLUSTER MYID").decode()
    for node in [to, *(n for n in cluster.nodes if n is not to)]:
        with node.client() as c:
            c.execute_command("CLUSTER SETSLOT", slot, "NODE", to_id)
    deadline = time.monotonic() + 10.0
    while cluster.owner(key) is not to:
        assert time.monotonic() < deadline, f"slot {slot} was not announced on its new owner"
        time.sleep(0.01)


@pytest.mark.parametrize("load", ["fast commands", "slow commands"])
async def test_a_pipeline_over_busy_nodes_gets_its_turns(redis_cluster, load: str) -> None:
    """Steady single commands on two nodes keep each node's turns taken or asked for; a
    pipeline over both that gave its first turn back whenever the second was busy never got
    both and failed as an outage after ``pool_wait_s`` (found by a review: 5 of 5 failed).
    It holds the first for a short wait on the next, twice as long each time: with slow
    commands (BLPOPs of 0.2 s, four to a node of two turns: ~0.4 s in line) a fixed 50 ms
    wait still starved it (found by the next review)."""
    async with _waiting_client(redis_cluster.url, 2) as (client, _):
        keys = [f"qos:{{{p}}}:busy-{load[0]}" for p in pools_on_different_shards(client)]
        client.pool_wait_s = 8.0
        stop = asyncio.Event()
        done = dict.fromkeys(keys, 0)

        async def steady(key: str) -> None:
            while not stop.is_set():
                if load == "fast commands":
                    await client.incr(key)
                else:
                    await client.blpop([key + "-empty"], 0.2)
                done[key] += 1

        n = 3 if load == "fast commands" else 4  # a node has 2 turns: others wait in line
        running = [asyncio.ensure_future(steady(k)) for k in keys for _ in range(n)]
        try:
            deadline = time.monotonic() + 30.0
            while min(done.values()) < n:  # every loop has gone round once: the lines are there
                assert time.monotonic() < deadline, f"timed out waiting for the load to run: {done}"
                await asyncio.sleep(0.01)
            for _ in range(3):
                async with client.pipeline(transaction=False) as pipe:
                    for k in keys:
                        pipe.exists(k)
                    assert len(await pipe.execute()) == 2
        finally:
            stop.set()
            await asyncio.gather(*running)


async def test_node_of_names_the_node_each_kind_of_command_goes_to(redis_cluster) -> None:
    """The turn a command takes is its node's, found without asking a server: a script call
    by its first key, a keyed command as redis-py routes it, a container command ("XGROUP
    CREATE": it took the unknown node's turn, found by a review) by its key, a stream read
    by the key after STREAMS (XREADGROUP's group and consumer skipped); a keyless one,
    one sent to a node flag, an EVAL without keys: the unknown node's."""
    async with _waiting_client(redis_cluster.url, 2) as (client, _):
        key = "qos:{node-of}:k"
        node = client.get_node_from_key(key)
        assert await client.node_of(("EVALSHA", "a" * 40, 1, key, "x")) == node.name
        assert await client.node_of(("HGET", key, "f")) == node.name
        assert await client.node_of(("XGROUP CREATE", key, "g", "0", "MKSTREAM")) == node.name
        assert await client.node_of(("XREAD", "COUNT", 5, "STREAMS", key, "0-0")) == node.name
        assert await client.node_of(("XREADGROUP", "GROUP", "STREAMS", "STREAMS", "STREAMS", key, ">")) \
            == node.name
        for keyless in (("PING",), ("EVAL", "return 1", 0), ("EVALSHA", "a" * 40, 0)):
            assert await client.node_of(keyless) == UNKNOWN_NODE, keyless
        assert await client.node_of(("PING",), "primaries") == UNKNOWN_NODE
        assert await client.node_of(("TIME",), node) == [node.name]
        primaries = client.get_primaries()
        assert sorted(await client.node_of(("PING",), primaries)) == sorted(n.name for n in primaries)


async def test_a_stream_read_after_its_slot_moved_and_its_old_owner_died(tmp_path) -> None:
    """A stream read is sent to its key's node from the slot map, but not while a refresh of
    the map is due: redis-py runs it first and routes by the new map. Targeted before the
    refresh, the read after the failure that asked for it went to the dead owner again
    (found by a review: two failed reads where plain redis-py has one)."""
    cluster = LocalRedisCluster(extra=["--cluster-require-full-coverage", "no"]).start()
    client = open_redis(RedisConfig(url=cluster.url, cluster=True), max_connections=2, pool_wait_s=5.0)
    try:
        seed = cluster.nodes[0]  # it answers the refresh: the slot goes there
        key = next(k for k in (f"qos:{{moved{i}}}:replies" for i in range(1000))
                   if cluster.owner(k) is not seed)
        old_owner = cluster.owner(key)
        entry = await client.xadd(key, {"d": "1"})
        assert await client.xread({key: "0-0"}) == [[key.encode(), [(entry, {b"d": b"1"})]]]
        assert move_slot(cluster, key) == (old_owner, seed)  # (the first other master)
        old_owner.stop()
        with pytest.raises(RedisConnectionError):  # the map still names the dead owner
            await client.xread({key: "0-0"})
        deadline = time.monotonic() + 10.0
        while not client._initialize_due():  # the refresh the failure asked for, once it is due
            assert time.monotonic() < deadline, "timed out waiting for the slot map's refresh to be due"
            await asyncio.sleep(0.05)
        assert await client.xread({key: "0-0"}) == [[key.encode(), [(entry, {b"d": b"1"})]]]
    finally:
        await client.aclose()
        cluster.stop()


@pytest.mark.parametrize("waiting", [True, False], ids=["frontend's client", "controller's client"])
async def test_a_stream_read_goes_to_its_key_s_node_without_asking_another(waiting: bool) -> None:
    """redis-py cannot find a stream read's keys itself and asked a server (COMMAND GETKEYS,
    to the default node) before every read: a round trip more for each of a frontend's reply
    reads and a controller's sample reads, and with the default node's shard not answering
    every pool's reads failed. Now a stream read goes to its key's node: XREAD and
    XREADGROUP (a group called "streams" too) answer with the default node stopped."""
    cluster = LocalRedisCluster().start()
    client = open_redis(RedisConfig(url=cluster.url, cluster=True), max_connections=2,
                        pool_wait_s=10.0 if waiting else None)
    stopped = None
    try:
        await client.initialize()
        default = client.get_default_node()
        key = next(k for k in (f"qos:{{read{i}}}:replies" for i in range(1000))
                   if client.get_node_from_key(k).name != default.name)
        entry = await client.xadd(key, {"d": "1"})
        await client.xgroup_create(key, "streams", id="0")
        stopped = next(n for n in cluster.nodes if n.port == default.port)
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        assert await client.xread({key: "0-0"}, count=10) == [[key.encode(), [(entry, {b"d": b"1"})]]]
        assert await client.xread({key: entry}, count=10, block=50) == []  # a blocking read too
        got = await client.xreadgroup("streams", "streams", {key: ">"}, count=10)
        assert got == [[key.encode(), [(entry, {b"d": b"1"})]]]
    finally:
        if stopped is not None:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        await client.aclose()
        cluster.stop()


@contextlib.asynccontextmanager
async def _cluster_to_stop() -> AsyncIterator[tuple[LocalRedisCluster, Any, list[Any]]]:
    """A private cluster, a client of it with its slot map read, and a list for the nodes a
    test stops (SIGSTOP): they are resumed, and the cluster stopped, at the end."""
    cluster = LocalRedisCluster().start()
    probe = open_redis(RedisConfig(url=cluster.url, cluster=True))
    stopped: list[Any] = []
    try:
        await probe.initialize()
        yield cluster, probe, stopped
    finally:
        for node in stopped:
            os.kill(node.proc.pid, signal.SIGCONT)
        await probe.aclose()
        cluster.stop()


async def _first_blpop_answers(url: str, key: str, waiting: bool) -> None:
    """A new client's first command, a BLPOP on ``key``, answers within 20 s: its socket
    timeout is 600 s, so only a call to a stopped node waits out the deadline."""
    client = open_redis(RedisConfig(url=f"{url}?socket_timeout=600", cluster=True), max_connections=2,
                        pool_wait_s=10.0 if waiting else None, blocking_s=1.0)
    try:
        async with asyncio.timeout(20):
            assert await client.blpop([key], timeout=0.05) is None
    finally:
        await client.aclose()


@pytest.mark.parametrize("waiting", [True, False], ids=["frontend's client", "worker's blocking client"])
async def test_a_new_clients_first_command_goes_to_its_key_s_node(waiting: bool, monkeypatch) -> None:
    """redis-py routed a command before it read the slot map, and with none yet took any
    command for a keyless one, sent to a random primary: a worker's first BLPOP on its wake
    list went to another pool's shard, stopped, and waited out the socket timeout (600 s).
    The random pick is made the stopped node here; the command goes to its key's node."""
    from redis.asyncio.cluster import RedisCluster

    async with _cluster_to_stop() as (cluster, probe, stopped):
        seed = cluster.nodes[0].port
        stopped.append(node := next(n for n in cluster.nodes if n.port != seed))
        key = next(k for k in (f"qos:{{first{i}}}:wake" for i in range(1000))
                   if probe.get_node_from_key(k).port != node.port)
        monkeypatch.setattr(RedisCluster, "get_random_primary_node",
                            lambda self: next(n for n in self.get_primaries() if n.port == node.port))
        os.kill(node.proc.pid, signal.SIGSTOP)
        await _first_blpop_answers(cluster.url, key, waiting)


@pytest.mark.parametrize("waiting", [True, False], ids=["frontend's client", "worker's blocking client"])
async def test_commands_sent_while_the_first_reads_the_slot_map_wait_for_it(waiting: bool,
                                                                            monkeypatch) -> None:
    """redis-py publishes the default node before it has read the command table (COMMAND, to
    that node): a command sent meanwhile took the map for read, found no command table and
    fetched it again itself (a second COMMAND, a large reply; with the default node not
    answering, a second wait). It waits for the first read instead: one COMMAND in all."""
    from redis._parsers.commands import AsyncCommandsParser

    fetched: list[Any] = []
    real = AsyncCommandsParser.initialize

    async def slow_initialize(self, node=None) -> None:
        fetched.append(node)
        await asyncio.sleep(0.3)  # a COMMAND reply that takes a while
        await real(self, node)

    monkeypatch.setattr(AsyncCommandsParser, "initialize", slow_initialize)
    cluster = LocalRedisCluster().start()
    client = open_redis(RedisConfig(url=cluster.url, cluster=True), max_connections=2,
                        pool_wait_s=10.0 if waiting else None, blocking_s=1.0)
    try:
        first = asyncio.ensure_future(client.blpop(["qos:{a}:wake"], timeout=0.05))
        await wait_until(lambda: client.get_default_node() is not None, "the default node published")
        second = asyncio.ensure_future(client.blpop(["qos:{b}:wake"], timeout=0.05))
        assert await asyncio.gather(first, second) == [None, None]
        assert len(fetched) == 1, fetched
    finally:
        await client.aclose()
        cluster.stop()


async def test_a_new_clients_first_command_takes_its_key_s_node_s_turn() -> None:
    """A waiting client's first command took the turn of unknown node (the slot map not read
    yet), shared by every command whose node is not known: it takes its key's node's."""
    cluster = LocalRedisCluster().start()
    client = open_redis(RedisConfig(url=cluster.url, cluster=True), max_connections=2, pool_wait_s=10.0)
    probe = open_redis(RedisConfig(url=cluster.url, cluster=True))
    taken: list[Any] = []
    real_turn = WaitingRedisCluster.turn

    def turn(self, nodes):
        taken.append(nodes)
        return real_turn(self, nodes)

    try:
        await probe.initialize()
        key = "qos:{first}:wake"
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(WaitingRedisCluster, "turn", turn)
            assert await client.blpop([key], timeout=0.05) is None
            pipe = open_redis(RedisConfig(url=cluster.url, cluster=True), max_connections=2, pool_wait_s=10.0)
            try:
                p = pipe.pipeline(transaction=False)
                p.exists(key)
                assert await p.execute() == [0]
            finally:
                await pipe.aclose()
        owner = probe.get_node_from_key(key).name
        assert taken == [owner, {owner}], taken
    finally:
        await client.aclose()
        await probe.aclose()
        cluster.stop()


@pytest.mark.parametrize("waiting", [True, False], ids=["frontend's client", "worker's blocking client"])
async def test_a_new_client_starts_while_the_owner_of_slot_0_does_not_answer(waiting: bool) -> None:
    """redis-py fetches the command table (COMMAND) from the default node, the first primary
    of the map (slot 0's owner), whichever node the client was pointed at: with that shard's
    host not answering, every role of every pool waited out its socket timeout at its start.
    The table comes from the node the client was pointed at."""
    async with _cluster_to_stop() as (cluster, probe, stopped):
        first = probe.nodes_manager.get_node_from_slot(0)
        stopped.append(node := next(n for n in cluster.nodes if n.port == first.port))
        seed = next(n for n in cluster.nodes if n.port != first.port)
        key = next(k for k in (f"qos:{{seeded{i}}}:wake" for i in range(1000))
                   if probe.get_node_from_key(k).port == seed.port)
        os.kill(node.proc.pid, signal.SIGSTOP)
        await _first_blpop_answers(seed.url, key, waiting)
