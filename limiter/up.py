"""``qos up``: a complete local stack in the foreground, stopped cleanly by Ctrl-C.

Each role runs as its own OS process started with its own ``qos <role> …`` command line,
so ``ps`` shows which is which and an operator can signal one. A child that exits on its
own is never restarted silently: the stack reports it and shuts down, non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from limiter import config as config_mod
from limiter.bench.redis_proc import RedisServer
from limiter.cli import common_args, load_config
from limiter.embedded_redis import EmbeddedRedis
from limiter.errors import ConfigError


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None


@dataclass
class Stack:
    """The processes of one local stack; :meth:`stop` ends every one of them."""

    redis_url: str
    base_url: str
    children: list[Child] = field(default_factory=list)
    redis: RedisServer | EmbeddedRedis | None = None

    def start(self, child: Child, env: dict[str, str]) -> None:
        # A new process group per child: Ctrl-C in the terminal reaches `qos up` only,
        # which then stops the children in order (workers drain before Redis goes).
        child.proc = subprocess.Popen(child.argv, env=env, start_new_session=True)
        self.children.append(child)

    def exited(self) -> Child | None:
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                return c
        return None

    def stop(self, timeout_s: float = 20.0) -> None:
        for c in reversed(self.children):
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        if self.redis is not None:
            self.redis.stop()


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


def build_commands(args: argparse.Namespace) -> list[Child]:
    """The child command lines, in start order (frontends, controllers, workers)."""
    qos = qos_argv()
    common = ["--config", args.config] if args.config else []
    children = []
    for i in range(args.frontends):
        children.append(
            Child(
                f"frontend-{i}",
                [*qos, "frontend", "--host", args.host, "--port", str(args.port), "--reuse-port", *common],
            )
        )
    controllers = ["up-controller-a", "up-controller-b"] if args.standby else ["up-controller-a"]
    for cid in controllers:
        children.append(Child(cid, [*qos, "controller", "--id", cid, *common]))
    for i in range(args.workers):
        argv = [
            *qos,
            "worker",
            "--engine",
            args.engine,
            "--device",
            args.device,
            "--worker-id",
            f"up-worker-{i}",
            *common,
        ]
        if args.engine == "openai":
            argv += ["--upstream-url", args.upstream_url]
        if args.engine == "torch" and args.device == "cpu":
            # Several CPU workers on few cores: one torch thread each keeps step times even.
            argv += ["--torch-threads", "1"]
        children.append(Child(f"worker-{i}", argv))
    return children


async def wait_ready(stack: Stack, cfg: config_mod.QosConfig, workers: int, timeout_s: float) -> None:
    """Until /readyz answers 200 and every worker has sent a heartbeat, or a child died."""
    import redis.asyncio as aioredis

    from limiter.keys import PoolKeys

    deadline = time.monotonic() + timeout_s
    client = aioredis.from_url(stack.redis_url)
    try:
        async with aiohttp.ClientSession() as session:
            while True:
                if (dead := stack.exited()) is not None:
                    raise RuntimeError(f"{dead.name} exited with {dead.proc.returncode} while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the stack was not ready within {timeout_s:.0f} s")
                try:
                    async with session.get(
                        f"{stack.base_url}/readyz", timeout=aiohttp.ClientTimeout(total=2)
                    ) as r:
                        ready = r.status == 200
                except aiohttp.ClientError:
                    ready = False
                if ready:
                    seen = sum([await client.zcard(PoolKeys(p.name).workers) for p in cfg.pools])
                    if seen >= workers:
                        return
                await asyncio.sleep(0.2)
    finally:
        await client.aclose()


def start_redis(args: argparse.Namespace) -> tuple[str, RedisServer | EmbeddedRedis | None]:
    """--redis-url if given; else a private redis-server child; else an embedded server."""
    if args.redis_url:
        return args.redis_url, None
    if shutil.which("redis-server") is None:
        print("qos up: WARNING: no redis-server on PATH; using an embedded in-process Redis (fakeredis). "
              "It is for single-machine demos only: nothing is persisted and only this machine can reach it.",
              file=sys.stderr, flush=True)
        embedded = EmbeddedRedis().start()
        return embedded.url, embedded
    server = RedisServer(extra=["--appendonly", "no"]).start()
    return server.url, server


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    cfg = load_config(args)
    redis_url, redis_server = start_redis(args)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    stack = Stack(redis_url=redis_url, base_url=f"http://{host}:{args.port}", redis=redis_server)
    env = dict(os.environ, QOS_REDIS_URL=redis_url)
    stop = {"now": False}

    def on_signal(signum: int, _frame: object) -> None:
        stop["now"] = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = 0
    try:
        for child in build_commands(args):
            stack.start(child, env)
        asyncio.run(wait_ready(stack, cfg, args.workers, args.ready_timeout))
        line = (
            f"qos up: ready at {stack.base_url} (redis {redis_url}, {args.frontends} frontends, "
            f"{args.workers} {args.engine} workers)"
        )
        if cfg.demo:
            line += f"; demo keys: {' '.join(config_mod.DEMO_KEYS)} (admin: {config_mod.DEMO_ADMIN_KEY})"
        print(line, flush=True)
        if args.demo_load:
            from limiter.demo_load import run_demo_load

            asyncio.run(
                run_demo_load(stack.base_url, cfg, args.engine, args.demo_duration, lambda: stop["now"])
            )
            stop["now"] = True
        while not stop["now"]:
            if (dead := stack.exited()) is not None:
                print(
                    f"qos up: {dead.name} exited with {dead.proc.returncode}; stopping the stack "
                    f"(nothing is restarted silently)",
                    file=sys.stderr,
                    flush=True,
                )
                rc = 1
                break
            time.sleep(0.2)
    except RuntimeError as exc:
        print(f"qos up: {exc}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        for s, h in old.items():
            with contextlib.suppress(ValueError):
                signal.signal(s, h)
        stack.stop()
        print("qos up: stopped", flush=True)
    return rc
