"""What `qos config check` calls ok can run, and a bad file, URL or flag is an error that
names it: the policy script's own bounds (class count, weights, bursts), unreadable files,
malformed Redis URLs (and which setting gave them), `qos status`/`qos top` against a Redis
that answers but refuses, and `qos up` flags it cannot honour. Each was found by review as a
traceback, or as a config that every role then failed to start with."""

from __future__ import annotations

import argparse

import pytest

from limiter import config
from limiter.cli import build_parser, main
from limiter.controller.control_law import _rates
from limiter.controller.settings import load_settings
from limiter.errors import ConfigError
from limiter.keys import PoolKeys
from limiter.localstack.toml_writer import write_toml
from limiter.scripts import policy_document


def _write(tmp_path, p0: dict | None = None, pool: dict | None = None, extra_classes: int = 0,
           tenants: list | None = None):
    classes = [{"name": "P0", "share": 0.6, **(p0 or {})}, {"name": "P1", "share": 0.4}]
    classes += [{"name": f"X{i}", "share": 0.0} for i in range(extra_classes)]
    return write_toml({"redis": {"url": "redis://127.0.0.1:6390/0"}, "classes": classes,
                       "pools": [{"name": "tiny", "context_tokens": 8192, **(pool or {})}],
                       "tenants": tenants or []}, tmp_path / "qos.toml")


# --- `qos config check FILE`: a bad file must be a config error, never a traceback ---------------

def test_config_check_on_a_directory_is_a_config_error_not_a_traceback(tmp_path, capsys):
    # config.load catches FileNotFoundError only: IsADirectoryError escapes cli.main.
    assert main(["config", "check", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_config_check_on_a_file_that_is_not_utf8_is_a_config_error_not_a_traceback(tmp_path, capsys):
    # tomllib raises UnicodeDecodeError (not TOMLDecodeError) for bytes that are not UTF-8.
    p = tmp_path / "qos.toml"
    p.write_bytes(b"\xff\xfe = 1\n")
    assert main(["config", "check", str(p)]) == 2
    assert "qos.toml" in capsys.readouterr().err


# --- what `qos config check` calls ok must be what the pool's policy script accepts ---------------

@pytest.mark.parametrize(("p0", "pool", "extra_classes", "field"), [
    ({"weight": 2e6}, None, 0, "classes[0].weight"),  # init_pool: weight in [0, 1e6]
    ({"out_weight": float("inf")}, None, 0, "classes[0].out_weight"),  # init_pool: not a number
    ({"burst_s": 3600}, {"capacity_tokens_s": 1e12}, 0, "pools[0].capacity_tokens_s"),  # burst 2.16e15 > 1e15
    (None, None, 15, "classes"),  # 17 classes > 16
], ids=["weight-2e6", "out_weight-inf", "capacity-1e12-burst", "17-classes"])
async def test_a_config_that_check_accepts_can_initialise_its_pool(tmp_path, scripts, p0, pool,
                                                                  extra_classes, field):
    path = _write(tmp_path, p0, pool, extra_classes)
    try:
        cfg = config.load(path, {})
    except ConfigError as exc:
        assert exc.path == field, exc  # refused up front, naming the field (not another's)
        return
    # Accepted: then every role's start (frontend/worker/controller call init_pool) must work.
    await scripts.init_pool(PoolKeys("tiny"), policy_document(cfg, cfg.pool("tiny")))


# --- the Redis URL / cluster flag: a bad value must be named, not a traceback ---------------------

def test_a_redis_url_with_a_bad_port_is_a_config_error(tmp_path, capsys):
    # validate() checks only the scheme; redis-py's ValueError escapes `qos status`.
    rc = main(["status", "--redis-url", "redis://127.0.0.1:notaport/0"])
    assert rc == 2
    assert "redis" in capsys.readouterr().err.lower()


def test_status_against_a_db_index_out_of_range_is_an_error_line_not_a_traceback(redis_server, capsys):
    url = redis_server.url.rsplit("/", 1)[0] + "/99"  # the private server has 16 databases
    rc = main(["status", "--redis-url", url])
    assert rc in (1, 2)
    assert "DB index" in capsys.readouterr().err


def test_status_with_cluster_on_a_standalone_redis_is_an_error_line_not_a_traceback(
        redis_server, monkeypatch, capsys):
    monkeypatch.setenv("QOS_REDIS_CLUSTER", "1")
    rc = main(["status", "--redis-url", redis_server.url])
    assert rc in (1, 2)
    assert "cluster" in capsys.readouterr().err.lower()


def test_a_bad_qos_redis_url_is_named_as_the_env_override(tmp_path):
    # The error says "redis.url: must start with redis://" although the file's redis.url is fine
    # and the bad value came from QOS_REDIS_URL (or --redis-url).
    with pytest.raises(ConfigError) as exc:
        config.load(_write(tmp_path), {"QOS_REDIS_URL": "http://127.0.0.1:6390"})
    assert "QOS_REDIS_URL" in str(exc.value)


# --- `qos up` flags ------------------------------------------------------------------------------

def _up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def test_qos_up_refuses_an_infinite_demo_duration():
    # --demo-duration inf passes `< 0`; run_demo_load then builds poisson_schedule(..., inf), which
    # never ends (t >= inf is never true): the stack is up but the demo hangs, eating memory.
    from limiter.localstack import up

    with pytest.raises(ConfigError) as exc:
        up._check_args(_up_args("--demo-load", "--demo-duration", "inf"))
    assert "--demo-duration" in str(exc.value)


@pytest.mark.parametrize("interval", ["-1", "0", "nan"])
def test_top_refuses_an_interval_that_would_poll_redis_in_a_busy_loop(redis_server, interval, capsys):
    # --interval is not checked: -1, 0 or nan give asyncio.sleep(0) between full snapshots, so
    # `qos top` (meant to be "safe to call at any rate") polls Redis flat out.
    rc = main(["top", "--interval", interval, "--iterations", "2", "--redis-url", redis_server.url])
    assert rc == 2
    assert "--interval" in capsys.readouterr().err


async def test_a_tenant_that_check_accepts_can_be_admitted(tmp_path, scripts):
    # tenants[].rate_tokens_s <= 1e12 and burst_s <= 3600 pass validate(), but the frontend sends
    # tenant_burst = rate_tokens_s * burst_s (generation.py) and admit.lua refuses above 1e15:
    # every request of this tenant fails although `qos config check` said ok.
    from tests.support.helpers import admit

    p = _write(tmp_path, tenants=[{"name": "big", "key_sha256": [config.hash_key("k")], "rate_tokens_s": 1e12,
                                   "burst_s": 3600.0}])
    try:
        cfg = config.load(p, {})
    except ConfigError as exc:
        assert exc.path == "tenants[0].burst_s", exc  # refused up front, naming the field
        return
    keys = PoolKeys("tiny")
    await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny")))
    await scripts.client.zadd(keys.frontends, {"fe1": 4102444800000})
    t = cfg.tenants[0]
    await admit(scripts, keys, cls="P1", tenant=t.name, tenant_rate=t.rate_tokens_s,
                tenant_burst=t.rate_tokens_s * t.burst_s)


@pytest.mark.parametrize(("rate", "burst_s"), [(1e-10, 1.0), (1e-3, 1e-7)], ids=["rate-1e-10", "burst-1e-10"])
async def test_a_tenant_with_a_tiny_quota_that_check_accepts_can_be_admitted(tmp_path, scripts, rate,
                                                                            burst_s):
    # validate() took any rate_tokens_s > 0 and burst_s > 0, as admit.lua's header said (> 0), but
    # admit refuses tenant_rate and tenant_burst below 1e-9 (BADARG): a tenant throttled to almost
    # nothing got a 400 invalid_value on every request instead of its 429.
    from tests.support.helpers import admit

    p = _write(tmp_path, tenants=[{"name": "slow", "key_sha256": [config.hash_key("k")],
                                   "rate_tokens_s": rate, "burst_s": burst_s}])
    try:
        cfg = config.load(p, {})
    except ConfigError as exc:
        assert "tenants[0]" in str(exc)
        return
    keys = PoolKeys("tiny")
    await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny")))
    await scripts.client.zadd(keys.frontends, {"fe1": 4102444800000})
    t = cfg.tenants[0]
    await admit(scripts, keys, cls="P1", tenant=t.name, tenant_rate=t.rate_tokens_s,
                tenant_burst=t.rate_tokens_s * t.burst_s)


CONTROLLER_BURST_CFG = """
[redis]
url = "redis://127.0.0.1:6390/0"

[[classes]]
name = "P0"
share = 0.6
burst_s = 0.5

[[classes]]
name = "P1"
share = 0.4
burst_s = 0.5

[[pools]]
name = "tiny"
context_tokens = 8192
capacity_tokens_s = 1e12

[controller]
burst_s = 3600.0
"""


async def test_config_check_ok_means_the_controller_can_write_its_rates(tmp_path, scripts, aredis):
    """The controller's own ``[controller] burst_s`` replaces every class's burst_s in the
    rates it writes: bounding by the classes' alone, `qos config check` said ok to a config
    whose first rate change set_rates refused (burst > 1e15)."""
    p = tmp_path / "qos.toml"
    p.write_text(CONTROLLER_BURST_CFG)
    try:
        cfg = config.load(p, env={})  # config check
        settings = load_settings(cfg)  # the controller's settings
    except ConfigError as exc:
        assert exc.path == "pools[0].capacity_tokens_s" and "[controller]" in exc.message
        return  # refused at config check, naming both: what is wanted
    pool = cfg.pool("tiny")
    keys = PoolKeys("tiny")
    await scripts.init_pool(keys, policy_document(cfg, pool))
    fence, _ = await scripts.acquire_leader(keys, "ctl1", 10_000)
    control = settings.control_config(cfg)
    rates = _rates(control, pool.capacity_tokens_s, list(control.ceilings))
    fields = {"capacity": pool.capacity_tokens_s}
    for name, r in rates.items():
        fields |= {f"{name}.rate": r.rate, f"{name}.burst": r.burst,
                   f"{name}.ceil": r.ceil, f"{name}.ceil_burst": r.ceil_burst}
    # what the controller's tick sends when it moves the rates (decision.policy_fields())
    await scripts.set_rates(keys, "ctl1", fence, {"test": 1}, fields)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0?db=x", "redis://127.0.0.1:1/0?socket_timeout=abc"])
def test_qos_status_with_a_bad_redis_url_query_is_a_config_error(url, capsys):
    """A query value redis-py cannot parse (not only a bad port) is a config error too."""
    try:
        rc = main(["status", "--redis-url", url])
    except (ValueError, TypeError) as exc:
        pytest.fail(f"traceback instead of a config error: {type(exc).__name__}: {exc}")
    assert rc == 2
    assert "config error" in capsys.readouterr().err


# --- a Redis URL that redis-py itself would refuse (at the first command, or building the cluster
# client) must be refused by `qos config check` and every role's start, naming redis.url -----------

def _write_redis(tmp_path, url: str, cluster: bool):
    return write_toml({"redis": {"url": url, "cluster": cluster}, "classes": [{"name": "P0", "share": 0.6}],
                       "pools": [{"name": "tiny"}]}, tmp_path / "qos.toml")


@pytest.mark.parametrize(("url", "cluster", "word"), [
    ("unix:///tmp/redis.sock", True, "unix"),  # RedisClusterException: Unix domain socket ... (a traceback)
    ("redis://127.0.0.1:7000/1", True, "database"),  # RedisClusterException: 'db' must be 0
    ("redis://127.0.0.1:7000/0?db=2", True, "database"),
    ("redis://127.0.0.1:6390/0?sockettimeout=1", False, "sockettimeout"),  # TypeError at the first command
    ("redis://127.0.0.1:7000/0?sockettimeout=1", True, "sockettimeout"),  # TypeError building the client
    ("redis://127.0.0.1:6390/0?timeout=1", False, "timeout"),  # a pool option: TypeError on most clients
    ("rediss://127.0.0.1:6390/0?ssl_cert_reqs=requird", False, "ssl_cert_reqs"),  # RedisError, first command
    ("rediss://127.0.0.1:7000/0?ssl_cert_reqs=requird", True, "ssl_cert_reqs"),  # an "outage" for ever
    ("redis://127.0.0.1:6390/0?protocol=4", False, "protocol"),  # "Redis unavailable" for ever
    # numbers redis-py takes whatever they are (found by a review of the shared core):
    ("redis://127.0.0.1:6390/0?socket_timeout=0", False, "socket_timeout"),  # every command timed out
    ("redis://127.0.0.1:7000/0?socket_timeout=nan", True, "socket_timeout"),  # ...and aclose() failed
    ("redis://127.0.0.1:6390/0?socket_timeout=1e-9", False, "socket_timeout"),
    ("redis://127.0.0.1:6390/0?socket_connect_timeout=0", False, "socket_connect_timeout"),
    ("redis://127.0.0.1:6390/0?max_connections=-1", False, "max_connections"),  # a traceback
    ("redis://127.0.0.1:6390/0?health_check_interval=-5", False, "health_check_interval"),  # every command
    ("redis://127.0.0.1:6390/0?db=-1", False, "db"),
], ids=["cluster-unix", "cluster-db1", "cluster-db-query", "unknown-option", "cluster-unknown-option",
        "pool-timeout", "bad-cert-reqs", "cluster-bad-cert-reqs", "protocol-4", "socket-timeout-0",
        "cluster-socket-timeout-nan", "socket-timeout-tiny", "connect-timeout-0", "max-connections-negative",
        "health-check-negative", "db-negative"])
def test_a_redis_url_redis_py_refuses_is_refused_by_config_check(tmp_path, capsys, url, cluster, word):
    """`qos config check` called these ok; each role then died with redis-py's traceback (or, for
    a bad TLS or protocol value, took it for an outage and retried for ever)."""
    assert main(["config", "check", str(_write_redis(tmp_path, url, cluster))]) == 2
    err = capsys.readouterr().err
    assert "redis.url" in err and word in err


@pytest.mark.parametrize(("url", "cluster"), [
    ("rediss://qos:pw@127.0.0.1:6390/0?ssl_ca_certs=/etc/qos/ca.pem&ssl_cert_reqs=required", False),
    ("rediss://qos:pw@127.0.0.1:7000/0?ssl_ca_certs=/etc/qos/ca.pem&ssl_cert_reqs=none", True),
    ("redis://127.0.0.1:7000/0?read_from_replicas=0", True),
    ("redis://127.0.0.1:7000", True),
    ("unix:///tmp/redis.sock?db=3", False),
    ("redis://127.0.0.1:6390/0?socket_timeout=2&max_connections=8&protocol=2&client_name=qos", False),
])
def test_redis_urls_redis_py_takes_are_still_ok(tmp_path, url, cluster):
    config.load(_write_redis(tmp_path, url, cluster), {})


def test_status_with_a_negative_max_connections_is_a_config_error_not_a_traceback(capsys):
    assert main(["status", "--redis-url", "redis://127.0.0.1:6390/0?max_connections=-1"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "max_connections" in err and "Traceback" not in err


def test_status_with_cluster_and_a_unix_socket_is_a_config_error_not_a_traceback(monkeypatch, capsys):
    monkeypatch.setenv("QOS_REDIS_CLUSTER", "1")
    rc = main(["status", "--redis-url", "unix:///tmp/no-such-redis.sock"])
    assert rc == 2
    assert "config error" in capsys.readouterr().err


async def test_floors_that_add_up_to_one_can_initialise_the_pool(tmp_path, scripts):
    """0.56 + 0.34 + 0.10 is 1.0000000000000002 in floating point: `qos config check` allows the
    rounding (floors <= 1 + 1e-9), init_pool refused it ("floors add up to more than 1"), so
    every role failed at start with a config that check called ok."""
    classes = [{"name": "P0", "share": 0.5, "floor": 0.56}, {"name": "P1", "share": 0.3, "floor": 0.34},
               {"name": "P2", "share": 0.2, "floor": 0.10}]
    path = write_toml({"redis": {"url": "redis://127.0.0.1:6390/0"}, "classes": classes,
                       "pools": [{"name": "tiny"}]}, tmp_path / "qos.toml")
    cfg = config.load(path, {})
    await scripts.init_pool(PoolKeys("tiny"), policy_document(cfg, cfg.pool("tiny")))


@pytest.mark.parametrize("url", [
    "redis://qos:Zm9v/YmFyc2VjcmV0@redis.internal:6379/0",  # base64 passwords hold '/' and '+'
    "redis://qos:Zm9vYmFy#c2VjcmV0@redis.internal:6379/0",
    "rediss://qos:Zm9vYmFy?c2VjcmV0@redis.internal:6379/0",
    # ... and where what precedes the '/' reads as a host (and a port): redis-py connected to
    # "ssw0rd:6379", or to localhost:4821 (a Redis there would be read as this one)
    "redis://default:P@ssw0rd/2024@10.0.0.5:6379/0",
    "redis://:4821/Zq@10.0.0.5:6379/0",
])
def test_a_password_that_breaks_the_url_is_not_printed(url, tmp_path, capsys):
    """A password with '/', '#' or '?' not percent-encoded ends the URL's host part early, and
    urllib's "Port could not be cast to integer value as 'Zm9v'" -- the password -- went to
    stderr (and the journal) in the config error."""
    secret = next(part for part in ("Zm9v", "ssw0rd", "4821/Zq") if part in url)  # of the password
    assert main(["status", "--redis-url", url]) == 2
    err = capsys.readouterr().err
    assert secret not in err and "QOS_REDIS_URL" in err and "percent-encode" in err, err
    assert main(["config", "check", str(_write_redis(tmp_path, url, False))]) == 2
    err = capsys.readouterr().err
    assert secret not in err and "redis.url" in err, err


@pytest.mark.parametrize("url", [
    "redis:///0", "redis://", "redis://?db=1",  # no host: localhost, as redis-py reads them
    "redis://h:6379/0?password=p@ss", "redis://h:6379/0?username=me@corp",  # an '@' in a value
    "rediss://h/0?ssl_ca_certs=/etc/ssl/ca@2024.pem",
])
def test_urls_with_an_at_sign_in_their_query_or_no_host_are_accepted(url):
    """The first form of the '@' check looked past the path (a query value) and split on an
    empty host (a traceback): both refused or broke URLs accepted before (found by a review)."""
    config.check_redis_url(url, "redis.url")


def test_a_database_that_is_not_a_number_is_refused(tmp_path, capsys):
    """redis-py ignores a path that is not a number and uses database 0: another role's
    data, silently."""
    assert main(["config", "check", str(_write_redis(tmp_path, "redis://127.0.0.1:6379/abc", False))]) == 2
    assert "redis.url: its path (the database) must be a number" in capsys.readouterr().err
