"""A private ``redis-server`` child process on a free port.

Used by the benchmarks and the tests (and by roles that start a throwaway Redis), so that
nothing ever touches a shared instance by accident. ``--save ""``: no RDB snapshots;
``extra`` adds server flags (e.g. ``--appendonly yes``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """A redis-server child on a free port; `restart()` keeps its data dir (AOF)."""

    extra: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="qos-redis-")))
    proc: subprocess.Popen | None = None
    binary: str = "redis-server"
    # `qos up`: a session of its own (the terminal's Ctrl-C does not reach it; `qos up` stops
    # it last) and a preexec_fn that binds it to its parent (limiter.lifecycle.bind_to_parent).
    new_session: bool = False
    preexec_fn: Callable[[], None] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if shutil.which(self.binary) is None:
            raise RuntimeError(f"{self.binary} not found on PATH")
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", str(self.dir), "--daemonize", "no", "--loglevel", "warning", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=self.new_session, preexec_fn=self.preexec_fn)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with redis.Redis(port=self.port, socket_connect_timeout=0.2) as probe:
                    if probe.ping():
                        return self
            except (redis.exceptions.BusyLoadingError, redis.exceptions.ConnectionError):
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.02)
        self.kill()
        raise RuntimeError("redis-server did not start")

    def restart(self) -> RedisServer:
        """Kill and start again on the same port and data dir."""
        self.kill()
        return self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def terminate(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (Redis shuts down cleanly), SIGKILL if it takes longer than ``timeout_s``."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
