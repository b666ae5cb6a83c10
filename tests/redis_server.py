"""Private redis-server processes for tests: never the shared instance on 6379."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis


def free_port() -> int:
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

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", str(self.dir), "--daemonize", "no", "--loglevel", "warning", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, socket_connect_timeout=0.2).ping():
                    return self
            except redis.exceptions.BusyLoadingError:
                pass
            except redis.exceptions.ConnectionError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class RedisClusterServers:
    """A local 3-master Redis Cluster (no replicas)."""

    nodes: list[RedisServer] = field(default_factory=list)

    def start(self, masters: int = 3) -> RedisClusterServers:
        for _ in range(masters):
            node = RedisServer(extra=["--cluster-enabled", "yes", "--cluster-node-timeout", "2000",
                                      "--cluster-config-file", "nodes.conf"])
            self.nodes.append(node.start())
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = self.nodes[0].client().execute_command("CLUSTER", "INFO").decode()
            if "cluster_state:ok" in info:
                return self
            time.sleep(0.1)
        raise RuntimeError("cluster did not become ok")

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
