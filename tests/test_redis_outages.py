"""What counts as "Redis is out of reach" (limiter/redis_conn.py): a Redis Cluster that cannot
be reached or cannot serve a slot now is an outage (503 + Retry-After in the frontend,
back-off in the loops), not an internal error. Found by review; each failed before its fix."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Iterator

import pytest
from redis.exceptions import RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError

from limiter import redis_conn
from limiter.config import RedisConfig
from limiter.errors import ConfigError, RedisUnavailable
from limiter.frontend.errors import to_api_error
from limiter.keys import PoolKeys
from limiter.localstack.redis_server import LocalRedisCluster, RedisServer
from limiter.redis_conn import REDIS_ERRORS, map_redis_errors, open_redis
from limiter.scripts import Scripts
from tests.support.helpers import wait_until


@pytest.fixture
def one_node_cluster() -> Iterator[RedisServer]:
    """A private one-master Redis Cluster holding every slot: its node."""
    cluster = LocalRedisCluster().start(masters=1)
    try:
        yield cluster.nodes[0]
    finally:
        cluster.stop()


async def _take_slot_zero_away(node: RedisServer) -> None:
    """What a failover in progress looks like to a client: a slot without a master, and the
    node says CLUSTERDOWN until it has one again."""
    with node.client() as admin:
        admin.execute_command("CLUSTER", "DELSLOTS", 0)
        await wait_until(lambda: b"cluster_state:fail" in admin.execute_command("CLUSTER", "INFO"),
                         "the cluster to report cluster_state:fail")


@pytest.mark.parametrize("pool_wait_s", [None, 1.0])
async def test_an_unreachable_cluster_is_an_outage_not_an_internal_error(pool_wait_s: float | None) -> None:
    """Every node down (or a role started before its cluster): redis-py raised a bare
    RedisClusterException, which passed every outage handler: a 500 per request, a worker
    that exited at start."""
    hold = socket.socket()  # bound, never listening: refused, and no one else can take the port
    hold.bind(("127.0.0.1", 0))
    port = hold.getsockname()[1]
    client = open_redis(RedisConfig(url=f"redis://127.0.0.1:{port}/0", cluster=True), pool_wait_s=pool_wait_s)
    try:
        with pytest.raises(REDIS_ERRORS) as info, map_redis_errors():
            await client.ping()
        assert isinstance(info.value, RedisUnavailable)
        assert to_api_error(info.value).status == 503
    finally:
        await client.aclose()
        hold.close()


async def test_client_misuse_on_a_cluster_stays_an_error_not_an_outage(one_node_cluster: RedisServer) -> None:
    """A bug (keys of two slots in one command) must not be taken for an outage and retried
    for ever: it stays an error of its own type."""
    client = open_redis(RedisConfig(url=one_node_cluster.url, cluster=True))
    try:
        with pytest.raises(Exception) as info, map_redis_errors():
            await client.mget("qos:{a}:x", "qos:{b}:x")
        assert not isinstance(info.value, REDIS_ERRORS), info.value
        with pytest.raises(RedisClusterException) as info, map_redis_errors():
            raise RedisClusterException("Keys in request don't hash to the same slot")
    finally:
        await client.aclose()


async def test_a_cluster_that_goes_down_is_an_outage_not_an_internal_error(
    one_node_cluster: RedisServer,
) -> None:
    """A slot loses its master: the node answers CLUSTERDOWN (a ResponseError subclass), then
    the client cannot rebuild its slot map. Both passed the mapping as themselves."""
    client = open_redis(RedisConfig(url=one_node_cluster.url, cluster=True))
    try:
        assert await client.set("qos:{p}:x", "1")  # healthy: the client knows the slots
        await _take_slot_zero_away(one_node_cluster)
        got = []
        for _ in range(2):  # first CLUSTERDOWN, then the slot map cannot be rebuilt
            try:
                with map_redis_errors():
                    await client.get("qos:{p}:x")
                got.append("answered")
            except Exception as exc:
                got.append(type(exc).__name__)
        assert got == ["RedisUnavailable", "RedisUnavailable"]
    finally:
        await client.aclose()


async def test_a_script_call_on_a_downed_cluster_is_a_503_not_a_500(one_node_cluster: RedisServer) -> None:
    """The request path's scripts: CLUSTERDOWN was read as the script's own error reply
    (ScriptError, a 500), not as the outage it is."""
    client = open_redis(RedisConfig(url=one_node_cluster.url, cluster=True))
    scripts = Scripts(client)
    keys = PoolKeys("p")
    try:
        await scripts.load_all()
        await client.set(keys.policy, "x")  # healthy: the client knows the slots
        await _take_slot_zero_away(one_node_cluster)
        with pytest.raises(RedisUnavailable) as info:
            await scripts.cancel(keys, "req-1", "tenant-a")
        assert to_api_error(info.value).status == 503
    finally:
        await client.aclose()


@pytest.mark.parametrize("query", ["ssl_ca_certs=/etc/ca.pem", "ssl_cert_reqs=required", "ssl=true"])
def test_tls_options_on_a_plain_redis_url_are_refused(query: str) -> None:
    """redis:// with TLS options: the cluster client dropped them and connected in plain text
    (a standalone client failed at its first command). One letter from a TLS deployment:
    refused when the config is read, naming the fix."""
    from limiter.config import check_redis_url

    with pytest.raises(ConfigError, match="rediss://"):
        check_redis_url(f"redis://127.0.0.1:7000/0?{query}", "redis.url")
    # the right scheme is fine (on a cluster: a standalone client takes no `ssl` option, rediss:// is it)
    check_redis_url(f"rediss://127.0.0.1:7000/0?{query}", "redis.url", cluster=True)



async def test_a_redis_that_never_answers_is_an_outage_after_the_socket_timeout(monkeypatch) -> None:
    """A Redis that accepts the connection and then stops answering (SIGSTOP: hung, or its
    host frozen) fails the command as an outage, instead of hanging its caller."""
    monkeypatch.setattr(redis_conn, "SOCKET_TIMEOUT_S", 0.5)
    server = RedisServer().start()
    client = open_redis(RedisConfig(url=server.url))
    try:
        await client.set("k", 1)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(RedisUnavailable, match="Timeout"):
                with map_redis_errors():
                    await asyncio.wait_for(client.get("k"), 30)  # the deadline only bounds a hang
        finally:
            server.proc.send_signal(signal.SIGCONT)
    finally:
        await client.aclose()
        server.stop()


async def test_a_blocking_read_longer_than_the_socket_timeout_is_no_outage(monkeypatch, redis_server) -> None:
    """BLPOP / XREAD BLOCK wait by design: a client opened with ``blocking_s`` allows for it.
    Before, every client had redis-py's bare 5 s, so a worker with ``idle_block_s`` of 5 s or
    more (the settings allow 60) took each idle BLPOP for an outage and backed off; so did a
    controller with ``block_s`` of 5 s or more."""
    monkeypatch.setattr(redis_conn, "SOCKET_TIMEOUT_S", 0.3)
    cfg = RedisConfig(url=redis_server.url)
    plain, blocking = open_redis(cfg), open_redis(cfg, blocking_s=1.0)
    try:
        with pytest.raises(RedisTimeoutError):  # what the bare timeout does to a 1 s block
            await plain.blpop(["qos-test-empty"], timeout=1)
        assert await blocking.blpop(["qos-test-empty"], timeout=1) is None
        assert await blocking.xread({"qos-test-stream": "0-0"}, block=1000) in ([], {}, None)
    finally:
        await plain.aclose()
        await blocking.aclose()


async def test_an_idle_worker_waits_out_idle_block_s_without_an_outage(monkeypatch, worker_env) -> None:
    """The worker's own blocking client: idle_block_s above the socket timeout is a quiet
    idle wait, not RedisUnavailable."""
    from worker.main import build_worker
    from worker.settings import load_settings

    monkeypatch.setattr(redis_conn, "SOCKET_TIMEOUT_S", 0.3)
    cfg, _client = worker_env
    rt, _loop = build_worker(load_settings(cfg, {"pool": "tiny", "idle_block_s": 1.0, "engine": "sim"}), cfg)
    await rt.open()
    try:
        assert await asyncio.wait_for(rt.wait_for_work(), 30) is False  # no marker came, and no outage
    finally:
        await rt.close()



async def test_an_idle_worker_outlives_its_redis_turned_replica(worker_env, sync_redis) -> None:
    """A failover demotes the Redis an idle worker waits on: Redis releases the blocked BLPOP
    with UNBLOCKED, a bare ResponseError that was no outage, and the worker process died of it
    (the one role that did; found by a review). It is an outage: the worker backs off, and
    serves again once the server takes writes."""
    from tests.support.redis_server import free_port
    from tests.support.worker_helpers import blocked_on_the_wake_list, start_worker, stop_worker

    cfg, c = worker_env
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.0, idle_block_s=30.0)
    try:
        await blocked_on_the_wake_list(c)
        sync_redis.replicaof("127.0.0.1", free_port())  # a master that never answers
        try:
            await wait_until(lambda: not rt.redis_ok or task.done(), "the worker to meet the demotion")
            assert not task.done(), f"the worker died: {task.exception()!r}"
        finally:
            sync_redis.replicaof("NO", "ONE")
        rid = await c.admit("served after the failover", max_tokens=4)
        await c.wait([rid], timeout=30)
        assert c.answers[rid].done is not None
    finally:
        assert await stop_worker(rt, task) is None


def test_a_refusal_for_the_stores_state_is_an_outage_and_any_other_stays_an_error() -> None:
    """The replies as redis-py's parser makes them into exceptions."""
    from redis._parsers.base import BaseParser
    from redis.exceptions import ResponseError

    def in_pipeline(exc: ResponseError) -> ResponseError:  # as redis-py's pipelines rewrite it
        exc.args = (f"Command # 2 (ZADD qos:{{p}}:workers 1 w) of pipeline caused error: {exc.args[0]}",)
        return exc

    for reply in ("NOREPLICAS Not enough good replicas to write.",
                  "UNBLOCKED force unblock from blocking operation, instance state changed "
                  "(master -> replica?)",
                  "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
                  "OOM command not allowed when used memory > 'maxmemory'.",
                  "READONLY You can't write against a read only replica.",
                  "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT.",
                  "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist "
                  "to disk."):
        with pytest.raises(RedisUnavailable), map_redis_errors():
            raise BaseParser.parse_error(reply)
        with pytest.raises(RedisUnavailable), map_redis_errors():  # a pipeline's command met it
            raise in_pipeline(BaseParser.parse_error(reply))
    for reply in ("WRONGTYPE Operation against a key holding the wrong kind of value",
                  "BUSYKEY Target key name already exists.",  # a code that starts like one
                  "ERR value is not an integer or out of range"):
        with pytest.raises(ResponseError), map_redis_errors():
            raise BaseParser.parse_error(reply)
        with pytest.raises(ResponseError), map_redis_errors():
            raise in_pipeline(BaseParser.parse_error(reply))


async def test_a_worker_outlives_a_script_running_past_the_busy_threshold(worker_env, sync_redis,
                                                                          redis_server) -> None:
    """A script that runs past ``busy-reply-threshold`` (someone's EVAL, a slow one of ours on
    a loaded shard) makes Redis answer BUSY to every other command until it ends: a bare
    ResponseError, and the worker process died of it at its wake-list LPOP (found by a review
    of the shared core). It is an outage: the worker backs off and serves once it ends."""
    import threading

    import redis as sync_redis_mod

    from tests.support.worker_helpers import start_worker, stop_worker

    cfg, c = worker_env
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.0)
    spinner = sync_redis_mod.Redis(port=redis_server.port)
    spun: list[BaseException] = []

    def spin() -> None:
        try:
            spinner.eval("while true do end", 0)  # writes nothing: SCRIPT KILL may end it
        except BaseException as exc:  # killed: what the test waits for
            spun.append(exc)

    threshold = sync_redis.config_get("busy-reply-threshold")["busy-reply-threshold"]
    sync_redis.config_set("busy-reply-threshold", 50)
    thread = threading.Thread(target=spin, daemon=True)
    try:
        rid = await c.admit("before the script", max_tokens=4)
        await c.wait([rid], timeout=30)
        thread.start()
        killer = sync_redis_mod.Redis(port=redis_server.port)
        await wait_until(lambda: not rt.redis_ok or task.done(), "the worker to meet the busy script")
        assert not task.done(), f"the worker died: {task.exception()!r}"
        while thread.is_alive():  # SCRIPT KILL answers NOTBUSY until the script is past the threshold
            try:
                killer.script_kill()
            except sync_redis_mod.ResponseError:
                pass
            await asyncio.sleep(0.05)
        killer.close()
        assert spun and "killed" in str(spun[0]).lower()
        rid = await c.admit("served after the script", max_tokens=4)
        await c.wait([rid], timeout=30)
        assert c.answers[rid].done is not None
    finally:
        if thread.is_alive():
            redis_server.client().script_kill()
        thread.join(10)
        sync_redis.config_set("busy-reply-threshold", threshold)
        spinner.close()
        assert await stop_worker(rt, task) is None


async def test_redis_refusing_writes_after_a_failed_snapshot_is_an_outage(tmp_path) -> None:
    """stop-writes-on-bgsave-error: after a failed snapshot Redis answers every write MISCONF.
    The scripts' calls raised ScriptError (a 500 at the frontend) and plain commands a bare
    ResponseError (a worker died of it); both are an outage, and pass once a snapshot works."""
    from limiter.config import demo_config
    from tests.support.helpers import init_pool

    server = RedisServer(extra=["--enable-protected-configs", "yes"]).start()  # to move its dir
    gone = tmp_path / "gone"
    gone.mkdir()
    client = open_redis(RedisConfig(url=server.url))
    try:
        scripts = Scripts(client)
        keys = await init_pool(scripts, demo_config())
        with server.client() as admin:
            saved_dir = admin.config_get("dir")["dir"]
            admin.config_set("save", "3600 1")  # MISCONF needs a save point configured
            admin.config_set("dir", str(gone))
            gone.rmdir()  # the snapshot cannot write its temporary file
            admin.bgsave()
            deadline = asyncio.get_running_loop().time() + 15
            while admin.info("persistence")["rdb_last_bgsave_status"] != "err":
                assert asyncio.get_running_loop().time() < deadline, "still waiting for the snapshot to fail"
                await asyncio.sleep(0.05)
            with pytest.raises(RedisUnavailable, match="MISCONF"):
                await scripts.reap(keys)
            with pytest.raises(RedisUnavailable, match="MISCONF"), map_redis_errors():
                await client.lpush(keys.wake, "x")
            admin.config_set("dir", saved_dir)
            admin.bgsave()
            while admin.info("persistence")["rdb_last_bgsave_status"] != "ok":
                assert asyncio.get_running_loop().time() < deadline + 15, "still waiting for a snapshot"
                await asyncio.sleep(0.05)
        with map_redis_errors():
            await client.lpush(keys.wake, "x")
    finally:
        await client.aclose()
        server.stop()


@pytest.mark.parametrize("query", ["socket_timeout=0.3", "client_name=qos-w&socket_timeout=0.3"])
async def test_a_socket_timeout_in_the_url_still_leaves_room_for_a_blocking_read(redis_server, query) -> None:
    """A client whose commands block by design (BLPOP, XREAD BLOCK) gets its blocking time on
    top of the socket timeout (open_redis's ``blocking_s``), but redis-py lets a URL's query
    replace any argument: with `?socket_timeout=0.3` in redis.url every idle BLPOP of 1 s (a
    worker's idle_block_s; the frontends' reply reads block 2 s) timed out and was taken for an
    outage."""
    base = redis_server.url
    url = f"{base}{'&' if '?' in base else '?'}{query}"
    client = open_redis(RedisConfig(url=url), blocking_s=1.0)
    try:
        assert await client.blpop(["qos:{url}:empty"], 1) is None  # an idle wait, not an outage
        # and the URL's own timeout is still the one a command that should answer at once gets
        pool = client.connection_pool
        assert pool.connection_kwargs["socket_timeout"] == pytest.approx(0.3 + 1.0)
        assert pool.connection_kwargs.get("client_name") == ("qos-w" if "client_name" in query else None)
    finally:
        await client.aclose()


async def test_a_workers_health_says_redis_is_down_for_the_whole_outage(tmp_path) -> None:
    """/healthz's redis_ok was set by any loop's pass that did not fail, and an idle worker's
    renewal (nothing held: no Redis call) passed every lease/3 in the middle of an outage:
    the flag flapped true (found by a review of what operators see). It stays false until a
    heartbeat, a Redis round trip every pass, lands again."""
    from tests.support.worker_helpers import config, start_worker, stop_worker

    server = RedisServer().start()
    cfg = config(tmp_path / "qos.toml", server.url)
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.0)
    renewals = 0
    renew = rt.renew

    async def counted() -> None:
        nonlocal renewals
        renewals += 1
        await renew()

    rt.renew = counted  # (before the runtime's first await: its loops take this one)
    try:
        await wait_until(lambda: rt.redis_ok, "the worker to reach Redis")
        server.kill()
        await wait_until(lambda: not rt.redis_ok, "the worker to see the outage")
        seen_true, start = [], renewals

        def three_renewals_later() -> bool:
            if rt.redis_ok:
                seen_true.append(renewals)
            return renewals >= start + 3
        await wait_until(three_renewals_later, "three renewal passes during the outage", every=0.002)
        assert seen_true == [], f"redis_ok true during the outage after renewal {seen_true[0]}"
        assert not task.done()
        server.start()
        await wait_until(lambda: rt.redis_ok, "the worker to see Redis back")
    finally:
        assert await stop_worker(rt, task) is None
        server.stop()


def test_a_command_whose_cluster_redirections_ran_out_says_so() -> None:
    """redis-py gives up on a command the cluster kept redirecting (a reshard or a failover
    under way) with ClusterError("TTL exhausted."): the outage said only "Redis unavailable:
    TTL exhausted." (a review of reshards)."""
    from redis.exceptions import ClusterError

    from limiter.errors import RedisUnavailable

    with pytest.raises(RedisUnavailable, match=r"kept redirecting the command .*reshard or a failover"):
        with map_redis_errors():
            raise ClusterError("TTL exhausted.")
    with pytest.raises(RedisUnavailable, match=r"^Redis unavailable: Cluster is down$"):
        with map_redis_errors():
            raise ClusterError("Cluster is down")
