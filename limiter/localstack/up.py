"""``qos up``: a complete local stack in the foreground, stopped cleanly by Ctrl-C.

Each role runs as its own OS process started with its own ``qos <role> …`` command line,
so ``ps`` shows which is which and an operator can signal one. Lifecycle:

* every child, Redis included, runs in a session of its own, so the terminal's Ctrl-C (or
  SIGHUP when it closes) reaches ``qos up`` alone, which then stops the stack in order:
  frontends (stop accepting, finish open streams within their grace) -> workers (drain) ->
  controllers -> Redis last, one line per role; a second Ctrl-C kills what is left at once;
* every child gets a parent-death signal (Linux), so none outlives ``qos up``;
* the HTTP port is bound by ``qos up`` before anything starts (a taken port is refused,
  naming it and its holder); the frontends inherit their sockets, so SO_REUSEPORT is only
  ever shared within the stack;
* a worker that dies is reported loudly and the stack keeps serving (its requests resume
  on the other workers when their leases expire); ``--restart`` starts it again with
  back-off. The stack stops on its own, non-zero, only when its pool has no worker left or
  a frontend, a controller or Redis dies. Nothing is restarted silently.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from redis.exceptions import RedisError

from limiter import config as config_mod
from limiter import lifecycle
from limiter.cli import common_args, load_config
from limiter.errors import ConfigError
from limiter.extras import require
from limiter.localstack.embedded_redis import EmbeddedRedis
from limiter.localstack.redis_server import RedisServer

# --restart: back-off before the n-th restart in a row of a worker that died young.
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0)
# A worker that ran this long before it died starts its back-off from the beginning again.
RESTART_RESET_S = 60.0
# Seconds each role may take to stop after SIGTERM, unless its settings say otherwise.
DEFAULT_STOP_LIMITS = {"frontend": 30.0, "worker": 30.0, "controller": 5.0}
# While starting, what the stack still waits for is printed this often.
READY_REPORT_S = 15.0
# Signal a child gets when `qos up` dies without stopping it (handled like SIGTERM).
PARENT_DEATH_SIGNAL = signal.SIGTERM


def say(line: str, err: bool = False) -> None:
    """Print a status line; a closed terminal (SIGHUP) must not break the stop."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr if err else sys.stdout, flush=True)


@dataclass
class Child:
    name: str
    role: str  # frontend | controller | worker
    argv: list[str]
    worker_id: str = ""  # workers: the id it was first started with
    proc: subprocess.Popen | None = None
    sock: socket.socket | None = None  # frontends: the listening socket it inherits
    started: float = 0.0
    quick_deaths: int = 0  # deaths in a row, each within RESTART_RESET_S of its start
    restarts: int = 0
    restart_at: float | None = None  # --restart: when to start it again
    gone: bool = False  # dead and not coming back

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Stack:
    """The processes of one local stack; :meth:`stop` ends every one of them, in order."""

    redis_url: str
    base_url: str
    children: list[Child] = field(default_factory=list)
    redis: RedisServer | EmbeddedRedis | None = None
    restart: bool = False
    lease_ms: int = 0

    def start(self, child: Child, env: dict[str, str], **popen: Any) -> None:
        # A session per child: Ctrl-C in the terminal reaches `qos up` only, which then stops
        # the children in order (workers drain before Redis goes). The parent-death signal:
        # no child outlives `qos up` (SIGKILLed, or its terminal gone).
        argv, fds = child.argv, ()
        if child.sock is not None:
            argv, fds = [*argv, "--listen-fd", str(child.sock.fileno())], (child.sock.fileno(),)
        child.proc = subprocess.Popen(argv, env=env, start_new_session=True, pass_fds=fds,
                                      preexec_fn=lifecycle.bind_to_parent(PARENT_DEATH_SIGNAL), **popen)
        child.started = time.monotonic()
        if child.sock is not None:
            # Our copy must go: the child's keeps the socket open, and once that child exits
            # the socket must close with it (connections refused), not stay listening here
            # with nobody accepting (connections hanging in its backlog).
            child.sock.close()
            child.sock = None
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

    # --- while serving ----------------------------------------------------------------------
    def check(self, env: dict[str, str]) -> int | None:
        """Notice dead children: None while the stack can keep serving, else the exit status.

        A dead worker is reported and (``--restart``) started again after a back-off; the
        stack stops when no worker is left, or a frontend, a controller or Redis died."""
        if (rc := self.redis_exited()) is not None:
            say(f"qos up: redis-server exited with {rc}; stopping the stack", err=True)
            return 1
        now = time.monotonic()
        for c in self.children:
            if c.restart_at is not None and now >= c.restart_at:
                c.restart_at = None
                c.restarts += 1
                c.argv = _with_worker_id(c.argv, f"{c.worker_id}-r{c.restarts}")
                self.start(c, env)
                say(f"qos up: {c.name} restarted (pid {c.proc.pid}, restart {c.restarts})", err=True)
                continue
            if c.gone or c.restart_at is not None or c.proc is None or c.proc.poll() is None:
                continue
            rc = c.proc.returncode
            if c.role != "worker":
                say(f"qos up: {c.name} (pid {c.proc.pid}) exited with {rc}; stopping the stack "
                    f"(nothing is restarted silently)", err=True)
                return 1
            lived = now - c.started
            c.quick_deaths = c.quick_deaths + 1 if lived < RESTART_RESET_S else 1
            say(f"qos up: !!! WORKER {c.name} (pid {c.proc.pid}) DIED with exit status {rc} after "
                f"{lived:.0f} s !!! Its requests resume on the other workers once their leases "
                f"expire (within {self.lease_ms / 1000:g} s).", err=True)
            if self.restart and c.quick_deaths <= len(RESTART_BACKOFF_S):
                delay = RESTART_BACKOFF_S[c.quick_deaths - 1]
                c.restart_at = now + delay
                say(f"qos up: restarting {c.name} in {delay:g} s (--restart)", err=True)
            else:
                c.gone = True
                if self.restart:
                    say(f"qos up: {c.name} died {c.quick_deaths} times in a row; not restarting it "
                        f"again", err=True)
        workers = [c for c in self.children if c.role == "worker"]
        if workers and all(c.gone for c in workers):
            say("qos up: no worker is left in the pool; stopping the stack", err=True)
            return 1
        return None

    # --- stopping ---------------------------------------------------------------------------
    def stop(self, limits: dict[str, float] | None = None,
             interrupted: Callable[[], bool] = lambda: False) -> None:
        """Frontends -> workers -> controllers, each given ``limits[role]`` seconds after
        SIGTERM (then 10 s more before SIGKILL), Redis last. ``interrupted()`` true (a second
        Ctrl-C): kill everything that is left now."""
        limits = {**DEFAULT_STOP_LIMITS, **(limits or {})}
        for c in self.children:
            c.restart_at = None
        for role, label, what in (
            ("frontend", "frontends", "stop accepting, finish open streams within {:g} s"),
            ("worker", "workers", "drain: finish running work within {:g} s, hand back the rest"),
            ("controller", "controllers", "release their leases"),
        ):
            group = [c for c in self.children if c.role == role and c.running]
            if not group:
                continue
            say(f"qos up: stopping {len(group)} {label} ({what.format(limits[role])})")
            for c in group:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + limits[role] + 10.0
            while any(c.running for c in group):
                if interrupted():
                    say("qos up: interrupted again: killing every process of the stack now")
                    self.kill()
                    return
                if time.monotonic() > deadline:
                    late = [c.name for c in group if c.running]
                    say(f"qos up: {', '.join(late)} did not stop in time; killing", err=True)
                    for c in group:
                        if c.running:
                            c.proc.kill()
                    break
                time.sleep(0.05)
        self.kill_children()  # reaps them (each has stopped, or was killed past its limit)
        if self.redis is not None:
            say("qos up: stopping redis")
            if isinstance(self.redis, RedisServer):
                self.redis.terminate(5.0)
            self.redis.stop()
            self.redis = None

    def kill(self) -> None:
        self.kill_children()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def kill_children(self) -> None:
        for c in self.children:
            if c.sock is not None:
                c.sock.close()
                c.sock = None
            if c.proc is not None:
                if c.proc.poll() is None:
                    c.proc.kill()
                c.proc.wait()


def _with_worker_id(argv: list[str], worker_id: str) -> list[str]:
    """A restarted worker gets an id of its own (the dead one's leases stay fenced off)."""
    out = list(argv)
    out[out.index("--worker-id") + 1] = worker_id
    return out


def qos_argv() -> list[str]:
    """How to start a `qos` child: the console script next to this Python, if installed."""
    script = Path(sys.executable).parent / "qos"
    if script.exists():
        return [str(script)]
    found = shutil.which("qos")
    return [found] if found else [sys.executable, "-m", "limiter.cli"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a complete local stack (Redis, frontends, workers, controller)")
    p.add_argument("--frontends", type=int, default=1, help="frontend processes sharing --port (default 1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--engine", choices=("torch", "sim", "openai"), default="sim")
    p.add_argument("--device", default="cpu", help="worker device: cpu, cuda, cuda:N (default cpu)")
    p.add_argument("--upstream-url", default=None, help="openai engine: the upstream server's base URL")
    p.add_argument("--standby", action="store_true", help="also run a standby controller")
    p.add_argument("--restart", action="store_true",
                   help="start a worker that died again, with back-off (1, 2, 4, 8, 16 s; gives up after "
                   "5 quick deaths in a row); without it a dead worker is reported and left dead")
    p.add_argument("--demo-load", action="store_true", help="drive a mixed P0/P1/P2 load, show a live table")
    p.add_argument(
        "--demo-duration", type=float, default=0.0, help="stop the demo load after S s (0 = never)"
    )
    p.add_argument("--ready-timeout", type=float, default=120.0)
    common_args(p)
    p.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    if not 1 <= args.frontends <= 64:
        raise ConfigError("--frontends", "must be between 1 and 64")
    if not 0 <= args.workers <= 64:
        raise ConfigError("--workers", "must be between 0 and 64")
    if not 1 <= args.port <= 65535:
        raise ConfigError("--port", "must be between 1 and 65535")
    if args.engine == "openai" and not args.upstream_url:
        raise ConfigError("--upstream-url", "is required with --engine openai")
    if args.demo_duration < 0:
        raise ConfigError("--demo-duration", "must be >= 0")
    if not 0 < args.ready_timeout <= 86_400:
        raise ConfigError("--ready-timeout", "must be in (0, 86400] seconds")


def build_commands(args: argparse.Namespace) -> list[Child]:
    """The child command lines, in start order (frontends, controllers, workers)."""
    qos = qos_argv()
    common = ["--config", args.config] if args.config else []
    children = []
    for i in range(args.frontends):
        # --host/--port name the address in its logs; it serves the socket `qos up` bound.
        children.append(Child(f"frontend-{i}", "frontend",
                              [*qos, "frontend", "--host", args.host, "--port", str(args.port), *common]))
    controllers = ["up-controller-a", "up-controller-b"] if args.standby else ["up-controller-a"]
    for cid in controllers:
        children.append(Child(cid, "controller", [*qos, "controller", "--id", cid, *common]))
    for i in range(args.workers):
        wid = f"up-worker-{i}"
        argv = [*qos, "worker", "--engine", args.engine, "--device", args.device, "--worker-id", wid, *common]
        if args.engine == "openai":
            argv += ["--upstream-url", args.upstream_url]
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


async def wait_ready(stack: Stack, cfg: config_mod.QosConfig, worker_ids: list[str], since_ms: int,
                     timeout_s: float, abort: Callable[[], bool] = lambda: False) -> bool:
    """Until /readyz answers 200 and each of ``worker_ids`` has sent a heartbeat since
    ``since_ms`` (Redis time; entries of an earlier stack do not count): True. False when
    ``abort()`` (Ctrl-C while starting); raises when a child died or time ran out."""
    import redis.asyncio as aioredis

    from limiter.keys import PoolKeys

    started = time.monotonic()
    deadline = started + timeout_s
    next_report = started + READY_REPORT_S
    client = aioredis.from_url(stack.redis_url)
    keys = PoolKeys(cfg.pools[0].name)
    try:
        async with aiohttp.ClientSession() as session:
            while True:
                if abort():
                    return False
                if (dead := stack.exited()) is not None:
                    raise RuntimeError(f"{dead.name} exited with {dead.proc.returncode} while starting")
                if (rc := stack.redis_exited()) is not None:
                    raise RuntimeError(f"redis-server exited with {rc} while starting")
                missing = ""
                try:
                    wait_s = min(2.0, max(0.05, deadline - time.monotonic()))  # never past the deadline
                    async with session.get(
                        f"{stack.base_url}/readyz", timeout=aiohttp.ClientTimeout(total=wait_s)
                    ) as r:
                        if r.status != 200:
                            missing = f"/readyz answers {r.status} ({(await r.text())[:200]})"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    # (the port is bound before a frontend serves it: a request may wait in
                    # the socket's backlog until the frontend is up)
                    missing = f"/readyz does not answer yet ({type(exc).__name__})"
                if not missing:
                    async with client.pipeline(transaction=False) as pipe:
                        for w in worker_ids:  # (ZSCORE: the documented ACL user has no ZMSCORE)
                            pipe.zscore(keys.workers, w)
                        seen = await pipe.execute() if worker_ids else []
                    silent = [w for w, s in zip(worker_ids, seen, strict=True) if s is None or s < since_ms]
                    if not silent:
                        return True
                    missing = f"no heartbeat yet from {', '.join(silent)}"
                now = time.monotonic()
                if now > deadline:
                    raise RuntimeError(f"the stack was not ready within {timeout_s:g} s: {missing}")
                if now >= next_report:  # never wait silently
                    say(f"qos up: not ready after {now - started:.0f} s: {missing}", err=True)
                    next_report = now + READY_REPORT_S
                await asyncio.sleep(0.2)
    finally:
        await client.aclose()


def start_redis(args: argparse.Namespace) -> tuple[str, RedisServer | EmbeddedRedis | None]:
    """--redis-url if given; else a private redis-server child; else an embedded server."""
    if args.redis_url:
        return args.redis_url, None
    if shutil.which("redis-server") is None:
        say("qos up: WARNING: no redis-server on PATH; using an embedded in-process Redis (fakeredis). "
            "It is for single-machine demos only: nothing is persisted and only this machine can reach it.",
            err=True)
        embedded = EmbeddedRedis().start()
        return embedded.url, embedded
    # Its own session (Ctrl-C does not reach it: it is stopped last) and bound to us: a
    # `qos up` that dies takes it along.
    server = RedisServer(extra=["--appendonly", "no"], new_session=True,
                         preexec_fn=lifecycle.bind_to_parent(signal.SIGTERM)).start()
    return server.url, server


def stop_limits(cfg: config_mod.QosConfig, args: argparse.Namespace) -> dict[str, float]:
    """Seconds each role may take to stop after SIGTERM, from its settings (which are all
    validated here: a bad role section is refused before anything starts)."""
    from limiter.controller.settings import load_settings as controller_settings
    from limiter.frontend.settings import load_settings as frontend_settings
    from worker.settings import load_settings as worker_settings

    fe = frontend_settings(cfg, {"host": args.host, "port": args.port})
    wk = worker_settings(cfg, {"engine": args.engine, "device": args.device,
                               "upstream_url": args.upstream_url})
    controller_settings(cfg)
    return {**DEFAULT_STOP_LIMITS, "frontend": fe.shutdown_grace_s, "worker": wk.drain_timeout_s}


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    cfg = load_config(args)
    limits = stop_limits(cfg, args)
    if args.engine == "torch":
        require("torch", "qos up --engine torch")
    # The port first: a taken port is refused before anything starts.
    lifecycle.check_port_free(args.host, args.port)
    children = build_commands(args)
    frontends = [c for c in children if c.role == "frontend"]
    socks: list[socket.socket] = []
    try:
        for c in frontends:
            c.sock = lifecycle.listen_socket(args.host, args.port, reuse_port=len(frontends) > 1)
            socks.append(c.sock)
    except ConfigError:
        for sk in socks:
            sk.close()
        raise
    if not lifecycle.parent_death_supported():
        say("qos up: WARNING: no parent-death signal on this platform: if qos up is killed, stop its "
            "children by hand", err=True)
    signals = {"count": 0}
    stop_after: dict[str, int] = {"base": 0}

    def on_signal(signum: int, _frame: object) -> None:
        signals["count"] += 1

    def interrupted() -> bool:
        return signals["count"] > stop_after["base"]

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    stack: Stack | None = None
    rc = 0
    try:
        redis_url, redis_server = start_redis(args)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        host = f"[{host}]" if ":" in host else host
        stack = Stack(redis_url=redis_url, base_url=f"http://{host}:{args.port}", redis=redis_server,
                      restart=args.restart, lease_ms=cfg.pools[0].lease_ms)
        env = dict(os.environ, QOS_REDIS_URL=redis_url)
        since_ms = asyncio.run(redis_time_ms(redis_url))
        for child in children:
            stack.start(child, env)
        worker_ids = [c.worker_id for c in children if c.role == "worker"]
        if not asyncio.run(wait_ready(stack, cfg, worker_ids, since_ms, args.ready_timeout,
                                      lambda: signals["count"] > 0)):
            say("qos up: interrupted while starting")
            return 130
        line = (
            f"qos up: ready at {stack.base_url} (redis {redis_url}, {args.frontends} frontends, "
            f"{args.workers} {args.engine} workers)"
        )
        if cfg.demo:
            line += f"; demo keys: {' '.join(config_mod.DEMO_KEYS)} (admin: {config_mod.DEMO_ADMIN_KEY})"
        say(line)
        verdict: dict[str, int | None] = {"rc": None}

        def should_stop() -> bool:
            if verdict["rc"] is None:
                verdict["rc"] = stack.check(env)
            return signals["count"] > 0 or verdict["rc"] is not None

        if args.demo_load:
            from limiter.localstack.demo_load import run_demo_load

            asyncio.run(run_demo_load(stack.base_url, cfg, args.engine, args.demo_duration, should_stop))
        else:
            while not should_stop():
                time.sleep(0.2)
        rc = verdict["rc"] or 0
    except RedisError as exc:  # e.g. a wrong password, or a command the Redis user may not run
        say(f"qos up: Redis refused: {type(exc).__name__}: {exc}", err=True)
        rc = 1
    except (RuntimeError, ConfigError, OSError) as exc:
        say(f"qos up: {exc or type(exc).__name__}", err=True)
        rc = 1
    finally:
        stop_after["base"] = signals["count"]
        if stack is not None:
            stack.stop(limits, interrupted)
        for sk in socks:
            sk.close()
        for s, h in old.items():
            with contextlib.suppress(ValueError):
                signal.signal(s, h)
        say("qos up: stopped")
    return rc
