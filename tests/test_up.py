"""`qos up` end to end: a private Redis and the torch tiny engine, requests through the
official openai SDK, `qos status --json` against it, Ctrl-C stops every child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai

from tests.support.qos_up import QOS, start_qos_up, stop_qos_up
from tests.support.redis_server import free_port


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_qos_up_serves_requests_and_stops_every_child(tmp_path):
    port = free_port()
    proc, ready, redis_url = start_qos_up(port, "--engine", "torch", "--workers", "1", "--frontends", "2")
    children: list[int] = []
    try:
        assert f"http://127.0.0.1:{port}" in ready and "demo-p0" in ready and "demo-admin" in ready
        children = _children(proc.pid)
        assert len(children) >= 5  # redis, 2 frontends, controller, worker

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo-p1")
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, seed=1)
        assert done.usage.completion_tokens == 8 and done.usage.prompt_tokens == 6
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in chat if c.choices]
        assert len(pieces) >= 1

        out = subprocess.run([QOS, "status", "--json", "--redis-url", redis_url], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        snap = json.loads(out.stdout)
        tiny = snap["pools"]["tiny"]
        assert set(tiny["classes"]["P1"]) >= {"rate", "burst", "tokens", "queued", "inflight", "compliance"}
        assert tiny["classes"]["P1"]["counters"]["done"] >= 2
        assert all("last_seen_s" in w for w in tiny["workers"].values()) and len(tiny["workers"]) == 1
    finally:
        rest = stop_qos_up(proc)
    assert proc.returncode == 0, rest
    assert "qos up: stopped" in rest
    time.sleep(0.2)
    assert [pid for pid in children if _alive(pid)] == []


def test_qos_up_without_redis_server_uses_an_embedded_redis_and_says_so(tmp_path):
    bindir = tmp_path / "bin"  # a PATH with python but no redis-server
    bindir.mkdir()
    (bindir / "python").symlink_to(Path(sys.executable))
    port = free_port()
    env = {**os.environ, "PATH": str(bindir), "QOS_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([QOS, "up", "--engine", "sim", "--workers", "1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(x.startswith("qos up: ready") for x in seen):
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
        assert any("embedded in-process Redis" in x and "demos only" in x for x in seen), "".join(seen)
        assert any(x.startswith("qos up: ready") for x in seen), "".join(seen)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo-p0", max_retries=0)
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=4)
        assert done.usage.completion_tokens == 4
    finally:
        rest = stop_qos_up(proc)
    assert proc.returncode == 0, rest
