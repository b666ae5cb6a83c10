"""``[controller]`` settings: defaults follow the original problem, every error names controller.<field>."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from limiter import cli
from limiter.config import demo_config
from limiter.controller.settings import WORKER_HEARTBEAT_S, ControllerSettings, load_settings
from limiter.errors import ConfigError
from limiter.slo import ClassSLO
from worker.settings import WorkerSettings


def _cfg(section: dict):
    return dataclasses.replace(demo_config(), controller=section)


def test_defaults_are_the_original_problems_numbers_and_come_from_the_classes():
    cfg = demo_config()
    s = load_settings(cfg, {"controller_id": "c1"})
    law = s.control_config(cfg)
    assert (law.target, law.low, law.relax_step, law.tighten_step, law.cooldown_s, law.window) == (
        0.99, 0.95, 0.05, 0.10, 5.0, 1000)
    assert law.shares == (0.60, 0.35, 0.05) and law.ceilings == (1.0, 1.0, 1.0)
    assert law.min_shares == pytest.approx((0.30, 0.105, 0.015))
    assert s.slos(cfg) == {"P0": ClassSLO(500, 50), "P1": ClassSLO(2000, 150), "P2": ClassSLO()}
    assert s.claim_idle_ms == 3000 and [p.name for p in s.pool_configs(cfg)] == ["tiny"]
    assert ControllerSettings().resolved(cfg).controller_id  # <hostname>-<pid>


def test_a_class_s_ttft_allowance_per_prompt_token_reaches_its_slo():
    cfg = demo_config()
    p0 = dataclasses.replace(cfg.classes[0], slo_ttft_ms_per_1k_prompt_tokens=100.0)
    cfg = dataclasses.replace(cfg, classes=(p0, *cfg.classes[1:]))
    slos = load_settings(cfg, {"controller_id": "c1"}).slos(cfg)
    assert slos["P0"] == ClassSLO(500, 50, 100.0) and slos["P0"].ttft_target_ms(8_000) == 1_300.0
    assert slos["P1"] == ClassSLO(2000, 150)


def test_the_table_and_the_flags_are_merged():
    cfg = _cfg({"tick_s": 0.5, "lease_s": 6.0, "capacity": {"window": 5}, "floors": [0.2, 0.1, 0.01]})
    s = load_settings(cfg, {"controller_id": "x", "lease_s": 4.0, "pools": ["tiny"], "metrics_port": None})
    assert (s.tick_s, s.lease_s, s.capacity.window, s.pools) == (0.5, 4.0, 5, ("tiny",))
    assert s.control_config(cfg).min_shares == (0.2, 0.1, 0.01)


def test_the_rates_written_keep_the_configured_bursts():
    """The controller rescales rates, not the bursts the operator chose: each class keeps its
    burst_s, unless [controller] burst_s overrides them all."""
    cfg = demo_config()
    cfg = dataclasses.replace(cfg, classes=tuple(dataclasses.replace(c, burst_s=b)
                                                 for c, b in zip(cfg.classes, (2.0, 1.0, 4.0), strict=True)))
    law = load_settings(cfg, {"controller_id": "c1"}).control_config(cfg)
    assert law.class_bursts == (2.0, 1.0, 4.0)
    law = load_settings(cfg, {"controller_id": "c1", "burst_s": 0.5}).control_config(cfg)
    assert (law.class_bursts, law.burst_s) == ((), 0.5)


@pytest.mark.parametrize(("section", "path"), [
    ({"tick_s": 0}, "controller.tick_s"),
    ({"lease_s": "3s"}, "controller.lease_s"),
    ({"bogus": 1}, "controller.bogus"),
    ({"renew_s": 2.0}, "controller.renew_s"),  # more than half the 3 s lease
    ({"low": 0.995}, "controller.low"),  # above the target
    ({"min_samples": 5000}, "controller.min_samples"),  # more than the window
    ({"settle_s": 9.0}, "controller.settle_s"),  # longer than the cooldown
    ({"cooldown_s": float("inf"), "settle_s": float("inf")}, "controller.cooldown_s"),  # TOML's inf
    ({"window": 10**9}, "controller.window"),
    ({"floors": [0.9, 0.1, 0.01]}, "controller.floors"),  # above P0's share
    ({"floors": [0.3]}, "controller.floors"),  # one per class
    ({"memory": "yes"}, "controller.memory"),
    ({"capacity": {"window": 0}}, "controller.capacity.window"),
    ({"capacity": {"nope": 1}}, "controller.capacity.nope"),
    ({"capacity": {"worker_field": "a b"}}, "controller.capacity.worker_field"),
    # inf, or so small that int(ts // interval) overflowed while feeding samples
    ({"capacity": {"interval_s": float("inf")}}, "controller.capacity.interval_s"),
    ({"capacity": {"interval_s": 1e-300}}, "controller.capacity.interval_s"),
    ({"capacity": {"busy_queue_ms": float("inf")}}, "controller.capacity.busy_queue_ms"),
    ({"capacity": {"worker_ttl_s": float("inf")}}, "controller.capacity.worker_ttl_s"),
    ({"capacity": {"rate_intervals": 10**9}}, "controller.capacity.rate_intervals"),
    ({"pools": ["nope"]}, "controller.pools[0]"),
    ({"window_max_age_s": -1}, "controller.window_max_age_s"),
    ({"used_min_claims": -1}, "controller.used_min_claims"),
    ({"used_min_claims": 2.5}, "controller.used_min_claims"),
    ({"used_max_window_s": float("nan")}, "controller.used_max_window_s"),
    ({"used_max_window_s": 61}, "controller.used_max_window_s"),
    ({"used_min_claims": 201}, "controller.used_min_claims"),
    ({"burst_s": -1}, "controller.burst_s"),
    ({"controller_id": "a:b"}, "controller.controller_id"),
])
def test_errors_name_the_field(section, path):
    with pytest.raises(ConfigError) as err:
        load_settings(_cfg(section), {"controller_id": section.get("controller_id", "c1")})
    assert err.value.path == path


def test_the_capacitys_worker_ttl_leaves_room_for_the_workers_beats():
    """[worker] heartbeat_s may be up to 60 s; with 10 s beside the controller's 5 s
    worker_ttl_s every live worker left the capacity 5 s after each beat and came back at the
    next, each time a change the law applies at once."""
    slow = {"heartbeat_s": 10.0}
    set_too_short = dataclasses.replace(_cfg({"capacity": {"worker_ttl_s": 5.0}}), worker=slow)
    with pytest.raises(ConfigError) as err:
        load_settings(set_too_short, {"controller_id": "c1"})
    assert err.value.path == "controller.capacity.worker_ttl_s" and "heartbeat_s" in err.value.message
    left_to_default = dataclasses.replace(_cfg({}), worker=slow)  # follows the beats
    assert load_settings(left_to_default, {"controller_id": "c1"}).capacity.worker_ttl_s == 30.0
    assert load_settings(_cfg({}), {"controller_id": "c1"}).capacity.worker_ttl_s == 5.0
    assert WORKER_HEARTBEAT_S == WorkerSettings.heartbeat_s  # the worker's default, not a guess


def test_a_class_without_a_share_is_reported_against_classes():
    cfg = demo_config()
    cfg = dataclasses.replace(cfg, classes=(dataclasses.replace(cfg.classes[0], share=0.0), *cfg.classes[1:]))
    with pytest.raises(ConfigError) as err:
        load_settings(cfg, {"controller_id": "c1"})
    assert err.value.path == "classes"


def test_the_cli_reports_a_bad_controller_table(tmp_path: Path, capsys):
    path = tmp_path / "qos.toml"
    path.write_text("""
[[classes]]
name = "P0"
share = 0.6
slo_ttft_ms = 500
[[pools]]
name = "tiny"
[controller]
lease_s = 0
""")
    assert cli.main(["controller", "--config", str(path), "--id", "a"]) == 2
    assert "controller.lease_s" in capsys.readouterr().err
    path.write_text(path.read_text().replace("lease_s = 0", "lease_s = 3.0"))
    assert cli.main(["controller", "--config", str(path), "--id", "a", "--pool", "nope"]) == 2
    assert "controller.pools[0]: unknown pool 'nope'" in capsys.readouterr().err


def test_a_taken_metrics_port_is_a_clear_error_and_the_process_exits(redis_server, sync_redis):
    """The loops used to start before the bind: a failed bind left them running, and the
    process neither exited nor answered SIGTERM, while its lease loop kept taking the lease."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "limiter.cli", "controller", "--redis-url", redis_server.url, "--id", "x",
             "--metrics-port", str(port), "--metrics-host", "127.0.0.1"],
            capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert "controller.metrics_port" in proc.stderr and str(port) in proc.stderr
    assert sync_redis.get("qos:{tiny}:leader") is None  # it never led


@pytest.mark.parametrize("role", [["controller"], ["worker", "--engine", "sim"], ["frontend"]])
def test_a_bad_log_level_is_a_usage_error_not_a_traceback(role):
    """A typo in QOS_LOG_LEVEL under `qos up` killed every child with logging's traceback."""
    env = {**os.environ, "QOS_LOG_LEVEL": "verbose"}
    proc = subprocess.run([sys.executable, "-m", "limiter.cli", *role, "--redis-url", "redis://127.0.0.1:1/0"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-600:]
    assert "'verbose' is not a log level" in proc.stderr and "QOS_LOG_LEVEL" in proc.stderr


@pytest.mark.parametrize("level", ["WARN", "warn", "FATAL", "NOTSET", "debug"])
def test_every_level_name_logging_takes_is_still_a_log_level(level):
    """The check must not refuse what logging.basicConfig took before it (QOS_LOG_LEVEL=WARN)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    cli.log_level_arg(parser)
    assert parser.parse_args(["--log-level", level]).log_level == level.upper()


def test_a_renewal_left_unset_follows_a_short_lease():
    """`qos controller --lease 1` was refused as "controller.renew_s: must be in [0.01,
    lease_s / 2], got 1.0": a field the operator never set. Left unset, it follows the lease;
    set, it is checked as given."""
    assert load_settings(_cfg({}), {"controller_id": "c1", "lease_s": 1.0}).renew_s == pytest.approx(1 / 3)
    assert load_settings(_cfg({"lease_s": 1.2}), {"controller_id": "c1"}).renew_s == pytest.approx(0.4)
    assert load_settings(_cfg({}), {"controller_id": "c1"}).renew_s == 1.0  # the default lease: as before
    with pytest.raises(ConfigError) as err:
        load_settings(_cfg({"lease_s": 1.0, "renew_s": 0.9}), {"controller_id": "c1"})
    assert err.value.path == "controller.renew_s"
