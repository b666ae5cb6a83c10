"""`qos up` end to end: a private Redis and the torch tiny engine, requests through the
official openai SDK, `qos status --json` against it, Ctrl-C stops every child."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai

from tests.redis_server import free_port

QOS = str(Path(sys.executable).parent / "qos")


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
    proc = subprocess.Popen(
        [QOS, "up", "--engine", "torch", "--workers", "1", "--frontends", "2", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "QOS_LOG_LEVEL": "WARNING"})
    children: list[int] = []
    try:
        ready = None
        deadline = time.monotonic() + 180
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("qos up: ready at"):
                ready = line
                break
        assert ready, "".join(lines[-30:])
        assert f"http://127.0.0.1:{port}" in ready and "demo-p0" in ready and "demo-admin" in ready
        redis_url = re.search(r"redis (redis://\S+),", ready).group(1)
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
        proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
    assert proc.returncode == 0, rest
    assert "qos up: stopped" in rest
    time.sleep(0.2)
    assert [pid for pid in children if _alive(pid)] == []
