"""docker-compose.yml is validated, not run (no Docker engine here): every service's command
is a real `qos` subcommand with valid flags, the LB points at the frontends, the config parses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from limiter import config
from limiter.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _qos_services():
    return {name: svc for name, svc in COMPOSE["services"].items() if svc.get("command", [None])[0] == "qos"}


@pytest.mark.parametrize("name", sorted(_qos_services()))
def test_every_qos_command_parses_with_the_real_cli(name):
    cmd = _qos_services()[name]["command"]
    args = build_parser().parse_args(cmd[1:])  # argparse exits (fails the test) on a bad flag
    assert callable(args.func)


def test_the_stack_has_every_role_and_gpu_reservations():
    roles = [svc["command"][1] for svc in _qos_services().values()]
    assert roles.count("frontend") == 1 and roles.count("controller") == 2 and roles.count("worker") >= 1
    assert COMPOSE["services"]["frontend"]["deploy"]["replicas"] >= 2
    redis_cmd = " ".join(COMPOSE["services"]["redis"]["command"])
    assert "--appendonly yes" in redis_cmd and "--appendfsync everysec" in redis_cmd
    assert "--maxmemory-policy noeviction" in redis_cmd
    ids = []
    for svc in _qos_services().values():
        if svc["command"][1] == "worker":
            (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
            assert "gpu" in dev["capabilities"]
            ids += dev["device_ids"]
    assert len(ids) == len(set(ids))  # one worker per card


def test_redis_asks_every_role_for_one_password_that_compose_will_not_start_without():
    """Every container on the project's network reaches Redis: without a password any of them
    could read the queued prompts and rewrite rates and quotas. The one password is compose's
    ``QOS_REDIS_PASSWORD``, required (``:?``: ``docker compose up`` stops, naming it, while it
    is unset), in Redis' ``--requirepass`` and in the URL every role is given."""
    required = "${QOS_REDIS_PASSWORD:?"
    redis_cmd = COMPOSE["services"]["redis"]["command"]
    secret = redis_cmd[redis_cmd.index("--requirepass") + 1]
    assert secret.startswith(required) and secret.endswith("}")
    url = COMPOSE["x-qos"]["environment"]["QOS_REDIS_URL"]
    assert url == f"redis://:{secret}@redis:6379/0"
    for name, svc in _qos_services().items():
        assert svc["environment"]["QOS_REDIS_URL"] == url, name
    # what the roles read: the URL, once compose has put the password in
    cfg = config.load(ROOT / "deploy" / "qos.toml", env={"QOS_REDIS_URL": url.replace(secret, "0f1e2d3c")})
    assert cfg.redis.url == "redis://:0f1e2d3c@redis:6379/0"


def test_the_load_balancer_points_at_the_frontends():
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    port = _qos_services()["frontend"]["command"][_qos_services()["frontend"]["command"].index("--port") + 1]
    assert re.search(rf"server\s+frontend:{port}\b[^;]*;", conf)
    assert "proxy_buffering off" in conf  # SSE must stream


def test_the_load_balancer_follows_the_frontends_addresses():
    """nginx resolves an upstream's name once, at start, unless its server says `resolve`:
    a frontend replica re-created with a new address got 502s until the lb restarted, and
    a replica added by scaling got no traffic (a review). `resolve` needs a shared-memory
    zone, a resolver (Docker's, 127.0.0.11), and nginx 1.27.3 or later."""
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    upstream = re.search(r"upstream\s+qos_frontends\s*\{(.*?)\}", conf, re.S)
    assert upstream, "no upstream block for the frontends"
    assert re.search(r"^\s*server\s+frontend:\d+\s[^;]*\bresolve\b", upstream.group(1), re.M), \
        "the frontends' name is resolved once, at nginx's start"
    assert re.search(r"^\s*zone\s+\S+\s+\d+[km];", upstream.group(1), re.M), "`resolve` needs a zone"
    resolver = re.search(r"^\s*resolver\s+([^;]+);", conf, re.M)
    assert resolver and "127.0.0.11" in resolver.group(1).split(), "no resolver: Docker's DNS is 127.0.0.11"
    image = COMPOSE["services"]["lb"]["image"]
    found = re.fullmatch(r"nginx:(\d+)\.(\d+)(?:\.(\d+))?", image)
    assert found, f"the lb's image {image!r} names no nginx version"
    version = tuple(int(x or 0) for x in found.groups())
    assert version >= (1, 27, 3), f"{image}: the upstream's `resolve` needs nginx 1.27.3 or later"
    assert COMPOSE["services"]["lb"]["depends_on"] == ["frontend"]


def test_a_body_over_the_frontends_limit_reaches_them_to_be_refused_with_their_own_error():
    """nginx's client_max_body_size must be above the frontends' max_body_bytes: at or below
    it, nginx answers an HTML 413 of its own where the frontend answers the OpenAI-shaped 400
    ``request_too_large`` naming its limit."""
    from limiter.frontend.settings import load_settings as frontend_settings

    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    (size, unit) = re.findall(r"^\s*client_max_body_size\s+(\d+)([kKmMgG]?);", conf, re.MULTILINE)[0]
    nginx_bytes = int(size) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit.lower()]
    limit = frontend_settings(config.load(ROOT / "deploy" / "qos.toml", {})).max_body_bytes
    assert nginx_bytes > limit, f"nginx refuses bodies over {nginx_bytes} bytes, the frontends over {limit}"


def test_nginx_waits_for_the_frontends_longer_than_they_wait_for_an_answer():
    """A request queued, or throttled and retried, gets no byte until its first token; the
    frontend ends it at request_timeout_s with a 503 of its own. nginx's proxy_read_timeout
    must be longer, or the client gets nginx's 504 instead (at equal values, either)."""
    from limiter.frontend.settings import load_settings as frontend_settings

    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    (value, unit) = re.findall(r"^\s*proxy_read_timeout\s+(\d+)(s|m)?;", conf, re.MULTILINE)[0]
    nginx_s = int(value) * (60 if unit == "m" else 1)
    limit = frontend_settings(config.load(ROOT / "deploy" / "qos.toml", {})).request_timeout_s
    assert nginx_s > limit, f"nginx gives up after {nginx_s} s of silence, the frontends after {limit:g} s"


def test_the_shared_config_is_valid():
    cfg = config.load(ROOT / "deploy" / "qos.toml", {})
    assert cfg.redis.url == "redis://redis:6379/0"


def test_the_shared_config_is_the_example_with_the_compose_redis():
    """docker-compose.yml says to copy deploy/qos.toml from `qos config example`: a copy edited
    apart from it kept a comment the example had corrected ("max queue wait, then 503", where
    admission answers 429 for a wait it cannot meet) and lacked the newer fields' comments."""
    example = (ROOT / "limiter" / "qos.example.toml").read_text()
    want = example.replace('url = "redis://127.0.0.1:6379/0"', 'url = "redis://redis:6379/0"', 1)
    assert want != example
    assert (ROOT / "deploy" / "qos.toml").read_text() == want


def _seconds(duration: str) -> float:
    """A compose duration ("45s", "1m30s", "500ms") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a compose duration: {duration!r}"
    unit = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * unit[u] for n, u in parts)


DOCKER_DEFAULT_GRACE_S = 10.0  # `docker compose stop/down` sends SIGKILL this long after SIGTERM
MARGIN_S = 5.0  # the last calls of a drain (heartbeat entry removed, connections closed)


@pytest.mark.parametrize("name", sorted(_qos_services()))
def test_every_role_is_given_the_time_its_drain_takes_before_sigkill(name):
    """A frontend gets shutdown_grace_s for its in-flight streams and a worker
    drain_timeout_s for its running requests, then up to hand_back_limit_s to hand back the
    rest (a decided answer retried for up to a lease): docker's default 10 s killed both
    mid-drain (the worker's requests then waited out their leases and spent an attempt each)."""
    from limiter.frontend.settings import load_settings as frontend_settings
    from worker.runtime import hand_back_limit_s
    from worker.settings import load_settings as worker_settings

    svc = _qos_services()[name]
    cfg = config.load(ROOT / "deploy" / "qos.toml", {})
    args = vars(build_parser().parse_args(svc["command"][1:]))
    role = svc["command"][1]
    if role == "frontend":
        needed = frontend_settings(cfg).shutdown_grace_s
    elif role == "worker":
        s = worker_settings(cfg, {"drain_timeout_s": args.get("drain_timeout_s")})
        needed = s.drain_timeout_s + hand_back_limit_s(s, cfg)
    else:  # a controller hands over its leadership at once
        needed = 0.0
    grace = _seconds(svc.get("stop_grace_period", f"{DOCKER_DEFAULT_GRACE_S:g}s"))
    assert grace >= needed + MARGIN_S, \
        f"{name}: SIGKILL {grace:g} s after SIGTERM, its drain takes up to {needed:g} s"


def test_the_load_balancer_keeps_the_frontends_metrics_from_clients():
    """The frontends serve /metrics on the API port without a key, and its series name every
    tenant (docs/frontend.md: where that port faces clients, keep /metrics off it). The lb
    publishes port 8000 to clients and passed every path through, /metrics included."""
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    cfg = config.load(ROOT / "deploy" / "qos.toml", {})
    if cfg.frontend.get("api_metrics", True) is False:
        return  # the frontends do not serve it on the API port at all
    block = re.search(r"location\s+=\s+/metrics\s*\{([^}]*)\}", conf)
    assert block, "nginx passes /metrics (tenant names, no key) to whoever reaches port 8000"
    status = re.search(r"return\s+(\d{3})", block.group(1))
    assert status and 400 <= int(status.group(1)) < 500, block.group(0)


def test_the_load_balancer_stops_gracefully_for_as_long_as_the_frontends_drain():
    """`docker compose stop/down` stops the lb first (it depends on the frontends), and
    docker's default 10 s of grace killed it, every open stream with it, before the
    frontends' shutdown_grace_s (30 s) could finish them (found by a review of the deploy
    files). SIGQUIT is nginx's graceful stop (SIGTERM its fast one; the official image's
    own stop signal is SIGQUIT, said in the compose file so it does not rest on the image),
    bounded by its worker_shutdown_timeout, which must cover the frontends' grace and end
    before SIGKILL."""
    from limiter.frontend.settings import load_settings as frontend_settings

    lb = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["lb"]
    cfg = config.load(ROOT / "deploy" / "qos.toml", {})
    drain = frontend_settings(cfg).shutdown_grace_s
    assert lb.get("stop_signal") == "SIGQUIT", "SIGTERM stops nginx at once, open streams and all"
    nginx = (ROOT / "deploy" / "nginx.conf").read_text()
    found = re.search(r"^worker_shutdown_timeout\s+(\d+)s;", nginx, re.M)
    assert found, "nginx's graceful stop waits without bound for its slowest client"
    timeout = float(found.group(1))
    grace = _seconds(lb.get("stop_grace_period", f"{DOCKER_DEFAULT_GRACE_S:g}s"))
    assert drain <= timeout and timeout + MARGIN_S <= grace, (drain, timeout, grace)


def test_the_balancer_holds_more_streams_than_a_tenant_may_open():
    """nginx's defaults (one worker of 512 connections, two a proxied request) held ~256
    streams, what deploy/qos.toml lets one tenant open alone; and its per-address limit must
    be above every tenant's max_inflight, so a tenant's own limit answers first (with its 429)."""
    import tomllib

    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    connections = int(re.search(r"worker_connections\s+(\d+);", conf).group(1))
    per_address = int(re.search(r"limit_conn\s+per_address\s+(\d+);", conf).group(1))
    assert re.search(r"^worker_processes auto;", conf, re.MULTILINE)
    tenants = tomllib.loads((ROOT / "deploy" / "qos.toml").read_text())["tenants"]
    most = max(t.get("max_inflight", 0) for t in tenants)
    assert connections >= 8 * most and per_address > most, (connections, per_address, most)
    assert int(re.search(r"client_header_timeout\s+(\d+)s;", conf).group(1)) <= 15
