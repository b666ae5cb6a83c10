"""The one launcher of a local stack: role processes started, waited for and stopped in order.

``qos up``, the benchmarks and the tests start the same things the same way:

* :func:`spawn` starts one process (optionally in a session of its own, bound to its parent
  by a parent-death signal, its output to a log file) and :func:`stop_process` stops one
  (a signal, a deadline, then SIGKILL);
* :func:`wait_for` polls a condition with a deadline and :func:`answers_ok` asks one HTTP
  endpoint whether it answers 200, the pieces every "wait until ready" is made of;
* :class:`Stack` holds the processes of one stack (:func:`build_commands` makes the
  ``qos frontend|controller|worker`` command lines), :func:`wait_ready` waits until its
  frontend is ready and each worker has sent a heartbeat, and :meth:`Stack.stop` stops it in
  order: frontends, workers, controllers, Redis last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import aiohttp

from limiter import config as config_mod
from limiter import lifecycle
from limiter.localstack.embedded_redis import EmbeddedRedis
from limiter.localstack.redis_server import RedisServer

# Seconds each role may take to stop after SIGTERM, unless its settings say otherwise.
DEFAULT_STOP_LIMITS = {"frontend": 30.0, "worker": 30.0, "controller": 5.0}
# Past its stop limit a role gets this much longer before SIGKILL.
KILL_GRACE_S = 10.0
# While starting, what the stack still waits for is printed this often.
READY_REPORT_S = 15.0
# Signal a child of a stack gets when its launcher dies without stopping it (handled like SIGTERM).
PARENT_DEATH_SIGNAL = signal.SIGTERM


def say(line: str, err: bool = False) -> None:
    """Print a status line; a closed terminal (SIGHUP) must not break the stop."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr if err else sys.stdout, flush=True)


@dataclass
class Child:
    """One role process (of a :class:`Stack`, or of a test's stack); the restart fields serve
    ``qos up --restart``."""

    name: str
    role: str  # frontend | controller | worker
    argv: list[str]
    worker_id: str = ""  # workers: the id it was first started with
    proc: subprocess.Popen | None = None
    sock: socket.socket | None = None  # frontends: the listening socket it inherits
    log: Path | None = None  # its output goes there (appended); None: inherited, or as ``popen`` says
    port: int = 0  # the port it serves on when it has one of its own (0: none, or the stack's)
    started: float = 0.0
    quick_deaths: int = 0  # deaths in a row, each within RESTART_RESET_S of its start
    restarts: int = 0
    restart_at: float | None = None  # --restart: when to start it again
    gone: bool = False  # dead and not coming back

    def close_sock(self) -> None:
        """Close our copy of its listening socket, if we hold one (idempotent)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def launch(self, env: dict[str, str], *extra: str, **spawn_args: Any) -> Child:
        """Start ``argv`` and ``extra`` (:func:`spawn`; the output to ``log`` if set)."""
        self.proc = spawn([*self.argv, *extra], env, log=self.log, **spawn_args)
        self.started = time.monotonic()
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def url(self, path: str = "") -> str:
        """``path`` on its own port (e.g. ``/readyz``)."""
        return f"http://127.0.0.1:{self.port}{path}"

    def send_signal(self, sig: int) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(sig)

    def kill9(self) -> None:
        """SIGKILL and reap: the process gets no chance to clean anything up."""
        self.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """:func:`stop_process` with SIGTERM (None: never started, or killed past ``timeout_s``)."""
        if self.proc is None:
            return None
        return stop_process(self.proc, signal.SIGTERM, timeout_s)

    def rss_kb(self) -> int:
        """Resident set size now (0 once the process is gone)."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except (OSError, AssertionError):
            pass
        return 0

    def tail(self, n: int = 30) -> str:
        """The last ``n`` lines of its ``log`` ("" without one)."""
        if self.log is not None:
            with contextlib.suppress(OSError):
                return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""


@dataclass
class Stack:
    """The processes of one local stack; :meth:`stop` ends every one of them, in order."""

    # What its status lines start with: `qos up`'s, or a bench's (LoggedStack), whose output
    # read "qos up: stopping ..." though nobody had run `qos up` (a newcomer's walk)
    label: ClassVar[str] = "qos up"
    redis_url: str
    base_url: str
    children: list[Child] = field(default_factory=list)
    redis: RedisServer | EmbeddedRedis | None = None
    # Children :meth:`stop` had to SIGKILL past their limits: the stop was not clean (a
    # worker's requests were cut, not handed back), whatever each one's own exit status.
    killed_late: list[str] = field(default_factory=list)

    def start(self, child: Child, env: dict[str, str], **popen: Any) -> None:
        """Start ``child`` (its own session, bound to us; a frontend inherits its socket)."""
        # A session per child: Ctrl-C in the terminal reaches `qos up` only, which then stops
        # the children in order (workers drain before Redis goes). The parent-death signal:
        # no child outlives `qos up` (SIGKILLed, or its terminal gone).
        extra, fds = (), ()
        if child.sock is not None:
            extra, fds = ("--listen-fd", str(child.sock.fileno())), (child.sock.fileno(),)
        child.launch(env, *extra, new_session=True, death_signal=PARENT_DEATH_SIGNAL, pass_fds=fds, **popen)
        if child.sock is not None:
            # Our copy must go: the children's keep the socket open, and once the last of
            # them exits the socket must close with it (connections refused), not stay
            # listening here with nobody accepting (connections hanging in its backlog).
            child.close_sock()
        if child not in self.children:
            self.children.append(child)

    def exited(self) -> Child | None:
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                return c
        return None

    def redis_exited(self) -> int | None:
        if isinstance(self.redis, RedisServer) and self.redis.proc is not None:
            return self.redis.proc.poll()
        return None

    def redis_death(self, rc: int) -> str:
        """"redis-server exited with RC" and the end of its log (why: its output goes nowhere,
        and the stop removes the log with its data dir)."""
        tail = self.redis.log_tail() if isinstance(self.redis, RedisServer) else ""
        return f"redis-server exited with {rc}" + (f" (its log ends: {tail})" if tail else "")

    def starting_failure(self) -> str | None:
        """While :func:`wait_ready` waits: why the stack cannot become ready (a child or
        Redis died), else None."""
        if (dead := self.exited()) is not None:
            return f"{dead.name} (pid {dead.pid}) exited with status {dead.proc.returncode} while starting"
        if (rc := self.redis_exited()) is not None:
            return f"{self.redis_death(rc)} while starting"
        return None

    # --- stopping ---------------------------------------------------------------------------
    def stop(self, limits: dict[str, float] | None = None,
             interrupted: Callable[[], bool] = lambda: False) -> bool:
        """Frontends -> workers -> controllers, each given ``limits[role]`` seconds after
        SIGTERM (then ``KILL_GRACE_S`` more before SIGKILL, named in :attr:`killed_late`),
        Redis last. ``interrupted()`` true (a second Ctrl-C): kill everything that is left
        now, and return True (not a clean stop)."""
        limits = {**DEFAULT_STOP_LIMITS, **(limits or {})}
        for role, label, what in (
            ("frontend", "frontends", "stop accepting, finish open streams within {:g} s"),
            ("worker", "workers", "drain: finish running work and hand back the rest within {:g} s"),
            ("controller", "controllers", "release their leases"),
        ):
            group = [c for c in self.children if c.role == role and c.running]
            if not group:
                continue
            say(f"{self.label}: stopping {len(group)} {label} ({what.format(limits[role])})")
            for c in group:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + limits[role] + KILL_GRACE_S
            while any(c.running for c in group):
                if interrupted():
                    say(f"{self.label}: interrupted again: killing every process of the stack now")
                    self.kill()
                    return True
                if time.monotonic() > deadline:
                    late = [c.name for c in group if c.running]
                    self.killed_late += late
                    say(f"{self.label}: {', '.join(late)} did not stop in time; killing", err=True)
                    for c in group:
                        if c.running:
                            c.proc.kill()
                    break
                time.sleep(0.05)
        self.kill_children()  # reaps them (each has stopped, or was killed past its limit)
        if self.redis is not None:
            say(f"{self.label}: stopping redis")
            if isinstance(self.redis, RedisServer):
                self.redis.terminate(5.0)
            self._stop_redis()
        return False

    def kill(self) -> None:
        self.kill_children()
        self._stop_redis()

    def _stop_redis(self) -> None:
        if self.redis is not None:
            _report_unreaped(self.label, self.redis.stop() or [])
            self.redis = None

    def kill_children(self) -> None:
        """SIGKILL the children still running and reap them all within
        ``lifecycle.REAP_TIMEOUT_S``; one that SIGKILL does not end is named, not waited for."""
        for c in self.children:
            c.close_sock()
        left = lifecycle.kill_and_reap({c.name: c.proc for c in self.children if c.proc})
        _report_unreaped(self.label, left)


def _report_unreaped(label: str, left: list[str]) -> None:
    if left:
        say(f"{label}: {', '.join(left)} still running {lifecycle.REAP_TIMEOUT_S:g} s after SIGKILL "
            f"(stuck in the kernel?); left behind, not waited for", err=True)


def qos_argv() -> list[str]:
    """How to start a `qos` child: the console script next to this Python, if installed."""
    script = Path(sys.executable).parent / "qos"
    if script.exists():
        return [str(script)]
    found = shutil.which("qos")
    return [found] if found else [sys.executable, "-m", "limiter.cli"]


# --- one process ----------------------------------------------------------------------------------

def spawn(argv: Sequence[str], env: dict[str, str], *, log: Path | None = None, append: bool = True,
          new_session: bool = False, death_signal: int | None = None, **popen: Any
          ) -> subprocess.Popen[Any]:
    """Start ``argv``. ``log``: stdout and stderr go to that file (appended to, unless not
    ``append``; without ``log`` and ``stdout``/``stderr`` in ``popen`` they are inherited).
    ``new_session``: the terminal's Ctrl-C does not reach it. ``death_signal``: it gets that
    signal when this process dies (Linux), so it never outlives us."""
    preexec = lifecycle.bind_to_parent(death_signal) if death_signal is not None else None
    if log is None:
        return subprocess.Popen(list(argv), env=env, start_new_session=new_session, preexec_fn=preexec,
                                **popen)
    with open(log, "ab" if append else "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(list(argv), env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=new_session, preexec_fn=preexec, **popen)


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout_s: float = 30.0
                 ) -> int | None:
    """Send ``sig`` (if it still runs) and wait up to ``timeout_s``: its exit status, or None
    when it had to be killed."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        lifecycle.kill_and_reap({"process": proc})
        return None


def module_argv(role: str, config: Path | str, *args: str) -> list[str]:
    """``python -m limiter.cli ROLE --config CONFIG ARGS``: a role run from this source tree
    (the tests' way; ``qos up`` runs the installed console script, :func:`qos_argv`)."""
    return [sys.executable, "-m", "limiter.cli", role, "--config", str(config), *args]


# --- waiting --------------------------------------------------------------------------------------

def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something truthy; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


async def answers_ok(session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0) -> str:
    """"" when GET ``url`` answers 200, else what it answered instead (a status and the start of
    its body, or the transport error's name)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status == 200:
                return ""
            return f"answers {r.status} ({(await r.text())[:200]})"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"does not answer yet ({type(exc).__name__})"


# --- a stack --------------------------------------------------------------------------------------

def build_commands(args: argparse.Namespace) -> list[Child]:
    """The child command lines, in start order (frontends, controllers, workers)."""
    qos = qos_argv()
    common = ["--config", args.config] if args.config else []
    children = []
    for i in range(args.frontends):
        # --host/--port name the address in its logs; it serves the socket `qos up` bound.
        public = ["--allow-demo-keys-public"] if getattr(args, "allow_demo_keys_public", None) else []
        children.append(Child(f"frontend-{i}", "frontend",
                              [*qos, "frontend", "--host", args.host, "--port", str(args.port), *public,
                               *common]))
    controllers = ["up-controller-a", "up-controller-b"] if args.standby else ["up-controller-a"]
    for cid in controllers:
        children.append(Child(cid, "controller", [*qos, "controller", "--id", cid, *common]))
    for i in range(args.workers):
        wid = f"up-worker-{i}"
        argv = [*qos, "worker", "--engine", args.engine, "--device", args.device, "--worker-id", wid, *common]
        if args.engine == "openai":
            argv += ["--upstream-url", args.upstream_url]
            if model := getattr(args, "upstream_model", None):
                argv += ["--upstream-model", model]
            if (priority := getattr(args, "upstream_priority", None)) is not None:
                argv.append("--upstream-priority" if priority else "--no-upstream-priority")
        if args.engine == "torch" and args.device == "cpu":
            # Several CPU workers on few cores: one torch thread each keeps step times even.
            argv += ["--torch-threads", "1"]
        children.append(Child(f"worker-{i}", "worker", argv, worker_id=wid))
    return children


async def redis_time_ms(url: str) -> int:
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    try:
        sec, usec = await client.time()
        return int(sec) * 1000 + int(usec) // 1000
    finally:
        await client.aclose()


async def wait_ready(stack: Stack, cfg: config_mod.QosConfig,
                     worker_ids: Sequence[str] | Callable[[], Sequence[str]], since_ms: int,
                     timeout_s: float, abort: Callable[[], bool] = lambda: False,
                     pool_of: Mapping[str, str] | None = None) -> bool:
    """Until /readyz answers 200 and each of ``worker_ids`` has sent a heartbeat since
    ``since_ms`` (Redis time; entries of an earlier stack do not count): True. False when
    ``abort()`` (Ctrl-C while starting); raises when ``stack.starting_failure()`` says why
    it cannot start (a child died) or time ran out. ``worker_ids`` may be a function, asked
    each time: the ids change as ``qos up --restart`` starts a worker again under a new one.
    ``pool_of``: worker id -> the pool it serves (default: the config's first pool)."""
    import dataclasses

    from limiter.keys import PoolKeys
    from limiter.redis_conn import open_redis

    started = time.monotonic()
    deadline = started + timeout_s
    next_report = started + READY_REPORT_S
    # cfg.redis says whether it is a cluster (a pool's keys may then live on any node)
    client = open_redis(dataclasses.replace(cfg.redis, url=stack.redis_url), max_connections=4)
    first = cfg.pools[0].name
    try:
        async with aiohttp.ClientSession() as session:
            while True:
                if abort():
                    return False
                if (why := stack.starting_failure()) is not None:
                    raise RuntimeError(why)
                wait_s = min(2.0, max(0.05, deadline - time.monotonic()))  # never past the deadline
                # (the port is bound before a frontend serves it: a request may wait in the
                # socket's backlog until the frontend is up)
                missing = await answers_ok(session, f"{stack.base_url}/readyz", wait_s)
                missing = missing and f"/readyz {missing}"
                if not missing:
                    ids = list(worker_ids() if callable(worker_ids) else worker_ids)
                    async with client.pipeline(transaction=False) as pipe:
                        for w in ids:  # (ZSCORE: the documented ACL user has no ZMSCORE)
                            pipe.zscore(PoolKeys((pool_of or {}).get(w, first)).workers, w)
                        seen = await pipe.execute() if ids else []
                    silent = [w for w, s in zip(ids, seen, strict=True) if s is None or s < since_ms]
                    if not silent:
                        return True
                    missing = f"no heartbeat yet from {', '.join(silent)}"
                now = time.monotonic()
                if now > deadline:
                    raise RuntimeError(f"the stack was not ready within {timeout_s:g} s: {missing}")
                if now >= next_report:  # never wait silently
                    say(f"{stack.label}: not ready after {now - started:.0f} s: {missing}", err=True)
                    next_report = now + READY_REPORT_S
                await asyncio.sleep(0.2)
    finally:
        await client.aclose()
