"""Start and stop `qos up` as a real process, for the tests that exercise the whole stack."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from limiter.localstack.launcher import spawn

QOS = str(Path(sys.executable).parent / "qos")


def start_qos_up(port: int, *extra: str, timeout_s: float = 180) -> tuple[subprocess.Popen, str, str]:
    """Run `qos up --port PORT EXTRA...` until its ready line; returns (process, line, redis URL)."""
    env = {**os.environ, "QOS_LOG_LEVEL": "WARNING"}
    proc = spawn([QOS, "up", "--port", str(port), *extra], env, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("qos up: ready at"):
            return proc, line, re.search(r"redis (redis://\S+),", line).group(1)
    proc.kill()
    proc.wait()
    raise AssertionError("qos up did not become ready:\n" + "".join(lines[-30:]))


def stop_qos_up(proc: subprocess.Popen) -> str:
    """Ctrl-C, as an operator would; returns what it printed after the ready line."""
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out
