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


def test_the_load_balancer_points_at_the_frontends():
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    port = _qos_services()["frontend"]["command"][_qos_services()["frontend"]["command"].index("--port") + 1]
    assert re.search(rf"server\s+frontend:{port};", conf)
    assert "proxy_buffering off" in conf  # SSE must stream
    assert COMPOSE["services"]["lb"]["depends_on"] == ["frontend"]


def test_the_shared_config_is_valid():
    cfg = config.load(ROOT / "deploy" / "qos.toml", {})
    assert cfg.redis.url == "redis://redis:6379/0"
