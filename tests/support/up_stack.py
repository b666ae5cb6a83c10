"""`qos up` as an operator runs it, for the lifecycle tests: in a session of its own (so a
signal to its process group is what the terminal's Ctrl-C would be), its output collected
by a thread so that a test can wait for a line with a deadline, and a config of its own."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from limiter.config import hash_key
from limiter.localstack.launcher import spawn, wait_for
from limiter.localstack.sse import sse_data
from limiter.localstack.toml_writer import write_toml
from tests.support.helpers import three_classes
from tests.support.qos_up import QOS

KEY = "key-user"


def write_config(path: Path, *, lease_ms: int = 2000, grace_s: float = 10.0, time_scale: float = 1.0,
                 drain_s: float = 10.0) -> Path:
    """One tenant (``KEY``), pool "tiny"; the Redis URL is a placeholder (`qos up` sets its own)."""
    return write_toml({
        "redis": {"url": "redis://127.0.0.1:1/0"},
        "classes": three_classes(),
        "pools": [{"name": "tiny", "context_tokens": 4096, "lease_ms": lease_ms}],
        "tenants": [{"name": "user", "key_sha256": [hash_key(KEY)], "max_inflight": 64}],
        "frontend": {"shutdown_grace_s": grace_s, "heartbeat_s": 0.5},
        "worker": {"time_scale": time_scale, "drain_timeout_s": drain_s, "heartbeat_s": 0.5},
    }, path)


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def children(pid: int) -> dict[int, str]:
    """pid -> command line of each child of ``pid``."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    found = {}
    for p in out.stdout.split():
        if cmd := _cmdline(int(p)):
            found[int(p)] = cmd
    return found


class Up:
    """One `qos up` process; ``lines`` fills as it prints (stdout and stderr together)."""

    def __init__(self, port: int, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = port
        full_env = {**{k: v for k, v in os.environ.items() if not k.startswith("QOS_")},
                    "QOS_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = spawn([QOS, "up", "--port", str(port), *args], full_env, new_session=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.redis_url = ""
        self.known: dict[int, str] = {}  # its children once ready: killed by close() if left

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def line(self, pattern: str) -> str | None:
        rx = re.compile(pattern)
        return next((x for x in list(self.lines) if rx.search(x)), None)

    def wait_line(self, pattern: str, timeout_s: float, what: str) -> str:
        def seen() -> str | None:
            if (found := self.line(pattern)) is None and self.proc.poll() is not None:
                raise AssertionError(f"qos up exited ({self.proc.returncode}) before {what}:\n{self.output}")
            return found
        try:
            return wait_for(seen, timeout_s, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- qos up printed:\n{self.output}") from None

    def wait_ready(self, timeout_s: float = 180) -> Up:
        line = self.wait_line(r"^qos up: ready at", timeout_s, "the ready line")
        self.redis_url = re.search(r"redis (redis://\S+),", line).group(1)
        self.known.update(children(self.proc.pid))
        return self

    def ctrl_c(self) -> None:
        """What the terminal does: SIGINT to the foreground process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait_exit(self, timeout_s: float, what: str = "qos up to exit") -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}:\n"
                                 f"{self.output}") from None

    def close(self) -> None:
        """Whatever happened: nothing of this stack is left running."""
        kids = {**self.known, **(children(self.proc.pid) if self.proc.poll() is None else {})}
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid, cmd in kids.items():
            if alive(pid) and _cmdline(pid) == cmd:  # (not a new process that got the pid)
                os.kill(pid, signal.SIGKILL)
        self._reader.join(5)

    def __enter__(self) -> Up:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def post(port: int, body: dict[str, Any], timeout_s: float = 120):
    """POST /v1/completions with the test key; the open response (a file-like object)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}",
                                          "Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout_s)


def complete(port: int, prompt: str, max_tokens: int) -> dict[str, Any]:
    with post(port, {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}) as r:
        return json.loads(r.read())


def stream(port: int, max_tokens: int, on_first: Callable[[], None] | None = None,
           timeout_s: float = 120) -> tuple[str, dict[str, Any] | None]:
    """One streamed completion: (the raw SSE text, the usage chunk's usage or None)."""
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage = [], None
    with post(port, body, timeout_s) as r:
        assert r.status == 200
        for raw in r:
            text.append(raw.decode().rstrip("\n"))
            if isinstance(chunk := sse_data(raw), dict):
                if on_first is not None:
                    on_first()
                    on_first = None
                if chunk.get("usage"):
                    usage = chunk["usage"]
    return "\n".join(text), usage
