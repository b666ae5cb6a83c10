"""A private ``redis-server`` child process on a free port, and a local Redis Cluster of them.

Used by the benchmarks and the tests (and by roles that start a throwaway Redis), so that
nothing ever touches a shared instance by accident. ``--save ""``: no RDB snapshots;
``extra`` adds server flags (e.g. ``--appendonly yes``).

A data dir it makes itself (``<tmp>/qos-redis-*``) names, in a file ``qos-owner``, the
process that made it and its redis-server: a process SIGKILLed cannot remove its dir, so
:func:`remove_stale_dirs` (``qos up`` calls it as it starts) removes those whose processes
are all gone, and nothing else.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from limiter import lifecycle

DIR_PREFIX = "qos-redis-"
OWNER_FILE = "qos-owner"  # in a dir made here: "owner PID:START" and "server PID:START" lines
STALE_SCAN_LIMIT = 64  # dirs one sweep looks at, whatever else the temp dir holds
PORT_ATTEMPTS = 3  # first starts on a free port someone else took meanwhile: a new one each time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """A redis-server child on a free port; `restart()` keeps its data dir (AOF)."""

    extra: list[str] = field(default_factory=list)
    # 0: a free one (free_port), and another if a process takes it before the server binds it
    # (two test processes, or anything on the host, can be handed the same free port).
    port: int = 0
    dir: Path = None  # type: ignore[assignment]  # None: a temp dir of its own (__post_init__)
    proc: subprocess.Popen | None = None
    binary: str = "redis-server"
    # `qos up`: a session of its own (the terminal's Ctrl-C does not reach it; `qos up` stops
    # it last) and a preexec_fn that binds it to its parent (limiter.lifecycle.bind_to_parent).
    new_session: bool = False
    preexec_fn: Callable[[], None] | None = None
    # A cluster node: its bus port (--cluster-port; Redis' default, port + 10000, may not be
    # free) is a free one too, chosen again with the port when a first start finds either
    # taken. A restart keeps both (the other nodes know them).
    cluster_bus: bool = False
    bus_port: int = 0
    # A command the server runs under (e.g. valgrind: limiter/bench/callgrind.py); the pid is
    # the server's all the same. Give start() a longer timeout: such a server starts slowly.
    wrapper: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.own_port = self.port == 0
        if self.own_port:
            self.port = free_port()
        if self.cluster_bus and self.bus_port == 0:
            self.bus_port = free_port()
        # Only a dir made here may be removed when a first start fails: a caller's is its data.
        self.own_dir = self.dir is None
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix=DIR_PREFIX))
            self._write_owner()

    def _write_owner(self) -> None:
        """Name who this dir belongs to (the sweep of a later start reads it)."""
        lines = [f"owner {_process_id(os.getpid())}"]
        if self.proc is not None:
            lines.append(f"server {_process_id(self.proc.pid)}")
        (self.dir / OWNER_FILE).write_text("\n".join(lines) + "\n")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        for tool in (self.binary, *self.wrapper[:1]):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} not found on PATH")
        first = self.proc is None
        retries = PORT_ATTEMPTS - 1 if first and self.own_port else 0
        while self._launch(first, timeout_s, port_taken_ok=retries > 0):
            # Its free port was taken meanwhile: a first start again, on another one.
            retries -= 1
            self.proc = None
            (self.dir / "redis.log").unlink(missing_ok=True)
            self.port = free_port()
            if self.cluster_bus:
                self.bus_port = free_port()
        return self

    def _launch(self, first: bool, timeout_s: float, port_taken_ok: bool) -> bool:
        """Start the server and wait until it answers: False once it does; True when it exited
        because its port was taken and ``port_taken_ok``; else raise what went wrong."""
        # Its log goes to a file in its dir: a start that fails says why (a port taken since
        # free_port() looked, a bad flag), where "exited with 1" was all there was to read.
        log = self.dir / "redis.log"
        args = [*self.wrapper, self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", str(self.dir), "--daemonize", "no", "--loglevel", "warning",
                "--logfile", str(log), *self.extra]
        if self.cluster_bus:
            args += ["--cluster-port", str(self.bus_port)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=self.new_session, preexec_fn=self.preexec_fn)
        if self.own_dir:  # a server that outlives us keeps its dir from the sweep
            self._write_owner()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if port_taken_ok and _port_taken(log):
                    return True
                self._failed(first, f"redis-server on port {self.port} exited with {self.proc.returncode}")
            try:
                # Bounded, no retries: against a listener that never answers (a port taken by
                # something else) redis-py's default retries made one probe take 5-16 s.
                with redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5,
                                 retry=Retry(NoBackoff(), 0)) as probe:
                    # ours, not another server that took the port since free_port() looked
                    if int(probe.info("server")["process_id"]) == self.proc.pid:
                        return False
            except (redis.exceptions.BusyLoadingError, redis.exceptions.ConnectionError,
                    redis.exceptions.TimeoutError):  # (a listener on the port that is not a Redis)
                pass
            time.sleep(0.02)
        self.kill()
        self._failed(first, f"redis-server on port {self.port} did not answer within {timeout_s:g} s")

    def _failed(self, first: bool, what: str) -> NoReturn:
        """Raise ``what`` with the tail of the server's log; a first start leaves no dir behind
        (each failed start of `qos up` left a qos-redis-* directory)."""
        tail = self.log_tail()
        if first and self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        raise RuntimeError(what + (f": {tail}" if tail else ""))

    def log_tail(self, lines: int = 3) -> str:
        """The last ``lines`` lines of the server's log, joined by " / " ("" without one): why
        it exited, which its log alone says (its output goes nowhere, and :meth:`stop`
        removes the log with its dir)."""
        try:
            tail = (self.dir / "redis.log").read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return ""
        return " / ".join(t.strip() for t in tail if t.strip())

    def restart(self) -> RedisServer:
        """Kill and start again on the same port and data dir."""
        self.kill()
        return self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)

    def kill(self) -> list[str]:
        """SIGKILL, reaped within ``lifecycle.REAP_TIMEOUT_S``: ["redis-server (pid N)"] if not."""
        return lifecycle.kill_and_reap({"redis-server": self.proc}) if self.proc else []

    def terminate(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (Redis shuts down cleanly), SIGKILL if it takes longer than ``timeout_s``."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def stop(self) -> list[str]:
        """Kill it and remove its dir: what :meth:`kill` left behind."""
        left = self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
        return left

    def __enter__(self) -> RedisServer:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _port_taken(log: Path) -> bool:
    """Whether the server's log says it could not bind its port."""
    try:
        return "Address already in use" in log.read_text(errors="replace")
    except OSError:
        return False


def _process_id(pid: int) -> str:
    """'PID:START': the start time (from /proc, where there is one) tells a reused pid apart."""
    try:
        start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        start = ""
    return f"{pid}:{start}"


def _still_running(ident: str) -> bool:
    """Whether the process ``ident`` (:func:`_process_id`) still runs: not gone, not a zombie,
    not a newer process that got its pid."""
    pid = int(ident.partition(":")[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process has that pid: it runs
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc to tell: the pid exists, so count it as running
    return state != "Z" and _process_id(pid) == ident


def _abandoned(path: Path) -> bool:
    """A dir of ours (this user's, made by a RedisServer: it holds OWNER_FILE) whose owner and
    server are all gone. A link, a dir without the file or with a process still running: no."""
    try:
        st, marker = path.lstat(), (path / OWNER_FILE).lstat()
        if not (stat.S_ISDIR(st.st_mode) and stat.S_ISREG(marker.st_mode)):
            return False
        if st.st_uid != os.getuid() or marker.st_uid != os.getuid():
            return False
        idents = [f[1] for f in (line.split() for line in (path / OWNER_FILE).read_text().splitlines())
                  if len(f) == 2 and f[0] in ("owner", "server")]
        return bool(idents) and not any(_still_running(i) for i in idents)
    except (OSError, ValueError):
        return False


def remove_stale_dirs(parent: Path | str | None = None, limit: int = STALE_SCAN_LIMIT) -> list[Path]:
    """Remove the data dirs under ``parent`` (default: the temp dir) left by RedisServers whose
    processes are all gone (a `qos up` SIGKILLed), looking at ``limit`` of them at most: the
    dirs removed."""
    parent = Path(parent if parent is not None else tempfile.gettempdir())
    try:
        with os.scandir(parent) as entries:
            candidates = [Path(e.path) for e in itertools.islice(
                (e for e in entries if e.name.startswith(DIR_PREFIX)), limit)]
    except OSError:
        return []
    removed = [d for d in candidates if _abandoned(d)]
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    return removed


@dataclass
class LocalRedisCluster:
    """A local Redis Cluster of ``masters`` private redis-servers (no replicas), each master
    owning an equal share of the slots (``redis-cli --cluster create``)."""

    nodes: list[RedisServer] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # server flags for every node

    def start(self, masters: int = 3, timeout_s: float = 20.0) -> LocalRedisCluster:
        try:
            for _ in range(masters):
                node = RedisServer(extra=["--cluster-enabled", "yes", "--cluster-node-timeout", "2000",
                                          "--cluster-config-file", "nodes.conf", *self.extra],
                                   cluster_bus=True)
                self.nodes.append(node.start())
            if masters == 1:  # redis-cli --cluster create wants three: the one takes every slot
                self._call(self.nodes[0], "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
            else:
                addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
                subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0",
                                "--cluster-yes"], check=True, capture_output=True, timeout=60)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if all(b"cluster_state:ok" in self._call(n, "CLUSTER", "INFO") for n in self.nodes):
                    return self
                time.sleep(0.1)
            raise RuntimeError("the cluster did not become ok")
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """A seed node's URL (a cluster client discovers the others from it)."""
        return self.nodes[0].url

    def owner(self, key: str) -> RedisServer:
        """The master that holds ``key``'s slot."""
        slot = key_slot(key.encode())
        for start, end, master, *_ in self._call(self.nodes[0], "CLUSTER", "SLOTS"):
            if start <= slot <= end:
                port = int(master[1])
                return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no master owns slot {slot}")

    @staticmethod
    def _call(node: RedisServer, *args: str) -> Any:
        with node.client() as c:
            return c.execute_command(*args)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def pools_on_distinct_shards(shard_of: Callable[[str], str], count: int, prefix: str = "pool",
                             tries: int = 1000) -> list[str]:
    """``count`` pool names ``<prefix><i>`` whose keys live on ``count`` different shards;
    ``shard_of`` names the shard of a key. Every key of a pool shares its hash tag, so the
    pool's policy key stands for all of them."""
    from limiter.keys import PoolKeys

    chosen: dict[str, str] = {}
    for i in range(tries):
        name = f"{prefix}{i}"
        shard = shard_of(PoolKeys(name).policy)
        if shard not in chosen:
            chosen[shard] = name
            if len(chosen) == count:
                return list(chosen.values())
    raise RuntimeError(f"could not spread {count} pools over {count} shards (only {len(chosen)} found)")
