"""Two and three real ``qos controller`` processes against a private Redis.

* kill -9 of the leader: the standby takes over within two lease periods (measured from the
  kill to the leader key naming the standby; the time is printed);
* SIGTERM of the leader: it releases the lease, so a standby takes over at its next poll,
  well before the lease would have expired.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import redis

from limiter.controller.leader import holder_id
from limiter.keys import PoolKeys
from limiter.localstack import launcher
from tests.support.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
LEASE_S, RENEW_S = 1.0, 0.2
CONFIG = """
[redis]
url = "{url}"
[[classes]]
name = "P0"
share = 0.6
slo_ttft_ms = 500
slo_tpot_ms = 50
[[classes]]
name = "P1"
share = 0.35
slo_ttft_ms = 2000
[[classes]]
name = "P2"
share = 0.05
[[pools]]
name = "tiny"
[controller]
lease_s = {lease}
renew_s = {renew}
tick_s = 0.2
"""


def spawn(config: Path, cid: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("QOS_REDIS_URL", None)
    return launcher.spawn(launcher.module_argv("controller", config, "--id", cid, *extra), env, log=log,
                          append=False, cwd=ROOT)


def wait_leader(r: redis.Redis, key: str, prefix: str, timeout: float) -> tuple[float, str]:
    """Poll the leader key every 5 ms until it names ``prefix``; returns (when, value)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = r.get(key)
        if v is not None and holder_id(v.decode()) == prefix:
            return time.monotonic(), v.decode()
        time.sleep(0.005)
    raise AssertionError(f"{prefix} did not take the lease within {timeout} s (now {r.get(key)!r})")


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    import urllib.request

    def healthy() -> bool:
        assert proc.poll() is None, "controller exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=0.5) as resp:
                return resp.status == 200
        except OSError:
            return False

    launcher.wait_for(healthy, timeout, "the controller to come up")


def stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(10)


def test_a_standby_takes_over_a_killed_leader_with_a_new_fence(redis_server: RedisServer, sync_redis,
                                                                       tmp_path: Path) -> None:
    config = tmp_path / "qos.toml"
    config.write_text(CONFIG.format(url=redis_server.url, lease=LEASE_S, renew=RENEW_S))
    key = PoolKeys("tiny").leader
    r = sync_redis
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(a := spawn(config, "a", tmp_path / "a.log"))
        _, held_a = wait_leader(r, key, "a", timeout=20)
        port_b, port_c = free_port(), free_port()
        procs.append(b := spawn(config, "b", tmp_path / "b.log", "--metrics-port", str(port_b)))
        wait_healthy(port_b, b)
        time.sleep(2 * RENEW_S)
        assert r.get(key).decode() == held_a  # b stands by while a renews
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        killed = time.monotonic()
        # The design bound is two lease periods (docs/controller.md quotes the figure printed
        # here); the wait itself allows for a loaded machine (beside two busy loops, a SIGTERM
        # handover of a 1 s lease once took over 2 s): the state, not the speed, is tested.
        took, held_b = wait_leader(r, key, "b", timeout=30)
        takeover = took - killed
        print(f"\nkill -9 takeover: {takeover:.3f} s (lease {LEASE_S} s, renew {RENEW_S} s)")
        assert int(held_b.split(":")[1]) > int(held_a.split(":")[1])  # a new fence: a's writes are refused

        # Clean shutdown: b releases, c (standing by) takes over at its next poll.
        procs.append(c := spawn(config, "c", tmp_path / "c.log", "--metrics-port", str(port_c)))
        wait_healthy(port_c, c)
        b.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        took, _ = wait_leader(r, key, "c", timeout=30)
        handover = took - sent
        print(f"SIGTERM handover: {handover:.3f} s")
        assert b.wait(10) == 0
        # it did not wait for the lease to expire: b released it (and c took it at its next poll)
        assert b"released leadership" in (tmp_path / "b.log").read_bytes()
    finally:
        for p in procs:
            stop(p)


def test_the_default_lease_is_renewed_not_lost(redis_server: RedisServer, sync_redis, tmp_path: Path) -> None:
    """With the default 1 s renewals of a 3 s lease, the leader keeps one fence for good."""
    lease = 3.0
    config = tmp_path / "qos.toml"
    config.write_text(CONFIG.format(url=redis_server.url, lease=lease, renew=1.0))
    key = PoolKeys("tiny").leader
    a = spawn(config, "a", tmp_path / "a.log")
    try:
        _, held = wait_leader(sync_redis, key, "a", timeout=20)
        time.sleep(3.5)
        assert sync_redis.get(key).decode() == held
        assert 0 < sync_redis.pttl(key) <= lease * 1000
    finally:
        stop(a)
