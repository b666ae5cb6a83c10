"""``qos up``: a complete local stack in the foreground, stopped cleanly by Ctrl-C.

Each role runs as its own OS process started with its own ``qos <role> …`` command line,
so ``ps`` shows which is which and an operator can signal one. Lifecycle:

* every child, Redis included, runs in a session of its own, so the terminal's Ctrl-C (or
  SIGHUP when it closes) reaches ``qos up`` alone, which then stops the stack in order:
  frontends (stop accepting, finish open streams within their grace) -> workers (drain) ->
  controllers -> Redis last, one line per role, and exits 0; a second Ctrl-C kills what is
  left at once and exits 128 + that signal (130 for SIGINT, 143 for SIGTERM), as the shell
  reports a killed process: it was not a clean stop; a role killed 10 s past its own stop
  limit is named, and the exit status is 1;
* every child gets a parent-death signal (Linux), so none outlives ``qos up``;
* the HTTP port is bound by ``qos up`` before anything starts (a taken port is refused,
  naming it and its holder, also one a stranger holds on ``[::1]`` beside ``127.0.0.1``,
  where clients of ``localhost`` would reach it); the frontends all inherit that one socket,
  bound without SO_REUSEPORT, so a stranger started later cannot bind the port beside them;
* a worker that dies is reported loudly and the stack keeps serving (its requests resume
  on the other workers when their leases expire); ``--restart`` starts it again with
  back-off, also one that dies before the stack is ready (without it, that fails the
  start). With ``--standby`` a dead controller is reported loudly and the other leads
  while the stack keeps serving. The stack stops on its own, non-zero, only when its pool
  has no worker left or a frontend, the last controller or Redis dies. Nothing is
  restarted silently.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from limiter import config as config_mod
from limiter import lifecycle
from limiter.cli import common_args, load_config
from limiter.errors import ConfigError
from limiter.extras import require
from limiter.localstack.embedded_redis import EmbeddedRedis
from limiter.localstack.launcher import (
    DEFAULT_STOP_LIMITS,
    Child,
    Stack,
    build_commands,
    redis_time_ms,
    say,
    wait_ready,
)
from limiter.localstack.redis_server import RedisServer, remove_stale_dirs

# --restart: back-off before the n-th restart in a row of a worker that died young.
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0)
# A worker that ran this long before it died starts its back-off from the beginning again.
RESTART_RESET_S = 60.0


@dataclass
class UpStack(Stack):
    """The stack of ``qos up``: a worker that dies is reported and (``--restart``) started
    again with back-off, while starting as once serving; any other death stops the stack."""

    restart: bool = False
    lease_ms: int = 0
    env: dict[str, str] = field(default_factory=dict)  # a restarted worker's environment

    # --- while starting and serving -----------------------------------------------------------
    def check(self) -> str | None:
        """Notice dead children: None while the stack can keep serving, else why it must stop.

        A dead worker is reported and (``--restart``) started again after a back-off; the
        stack stops when no worker is left, or a frontend, the last controller or Redis died."""
        if (rc := self.redis_exited()) is not None:
            return self.redis_death(rc)
        now = time.monotonic()
        for c in self.children:
            if c.restart_at is not None and now >= c.restart_at:
                c.restart_at = None
                c.restarts += 1
                self.start(c, self.env)
                say(f"qos up: {c.name} restarted (pid {c.proc.pid}, restart {c.restarts})", err=True)
                continue
            if c.gone or c.restart_at is not None or c.proc is None or c.proc.poll() is None:
                continue
            if c.role == "controller" and self._controller_left(c):
                continue
            if c.role != "worker":
                return (f"{c.name} (pid {c.proc.pid}) exited with {c.proc.returncode} (nothing is "
                        f"restarted silently)")
            self._worker_exited(c, now)
        workers = [c for c in self.children if c.role == "worker"]
        if workers and all(c.gone for c in workers):
            return "no worker is left in the pool"
        return None

    def _controller_left(self, c: Child) -> bool:
        """A controller exited while another of the stack's (``--standby``) still runs: that
        one leads (within two leases), so the stack keeps serving, and says so loudly; it is not
        restarted. True when so; False when ``c`` was the last one (the stack stops). Before,
        any controller's death stopped the stack: the standby that --standby starts for a
        failover could never take over, and the death of either of two controllers took the
        whole service down (a fault hunt, 2026-12-07)."""
        others = [o for o in self.children if o.role == "controller" and o is not c and o.running]
        if not others:
            return False
        c.gone = True
        say(f"qos up: !!! CONTROLLER {c.name} (pid {c.proc.pid}) exited with {c.proc.returncode} !!! "
            f"{', '.join(o.name for o in others)} leads (within two of its leases); the stack keeps "
            f"serving without a standby (not restarted)", err=True)
        return True

    def _worker_exited(self, c: Child, now: float) -> None:
        """Report a worker that exited; with --restart, when to start it again."""
        rc, lived = c.proc.returncode, now - c.started
        if rc == 0:
            # It drained and left on purpose (an operator's SIGTERM to it): not a death, and
            # not to be undone by --restart.
            c.gone = True
            say(f"qos up: {c.name} (pid {c.proc.pid}) drained and stopped (exit status 0) after "
                f"{lived:.0f} s; not restarted", err=True)
            return
        c.quick_deaths = c.quick_deaths + 1 if lived < RESTART_RESET_S else 1
        say(f"qos up: !!! WORKER {c.name} (pid {c.proc.pid}) DIED with exit status {rc} after "
            f"{lived:.0f} s !!! Its requests resume on the other workers once their leases "
            f"expire (within {self.lease_ms / 1000:g} s).", err=True)
        if self.restart and c.quick_deaths <= len(RESTART_BACKOFF_S):
            delay = RESTART_BACKOFF_S[c.quick_deaths - 1]
            c.restart_at = now + delay
            # Its new id now: while starting, the stack waits for a heartbeat under that id.
            c.argv = _with_worker_id(c.argv, f"{c.worker_id}-r{c.restarts + 1}")
            say(f"qos up: restarting {c.name} in {delay:g} s (--restart)", err=True)
        else:
            c.gone = True
            if self.restart:
                say(f"qos up: {c.name} died {c.quick_deaths} times in a row; not restarting it "
                    f"again", err=True)

    def starting_failure(self) -> str | None:
        """With --restart, a worker that dies before the stack is ready is started again as
        one that dies later is (the start fails only when no worker is left); without it, any
        death fails the start."""
        if not self.restart:
            why = super().starting_failure()
            if why is not None and (dead := self.exited()) is not None and dead.role == "worker":
                why += " (--restart starts a worker that died again)"
            return why
        why = self.check()
        return None if why is None else f"{why} while starting"

    def worker_ids(self) -> list[str]:
        """The ids the stack's workers have now (a restarted one's is new), those given up on
        left out: the heartbeats a start waits for."""
        return [c.argv[c.argv.index("--worker-id") + 1] for c in self.children
                if c.role == "worker" and not c.gone]

    def stop(self, limits: dict[str, float] | None = None,
             interrupted: Callable[[], bool] = lambda: False) -> bool:
        for c in self.children:
            c.restart_at = None  # no restart while stopping
        return super().stop(limits, interrupted)


def _with_worker_id(argv: list[str], worker_id: str) -> list[str]:
    """A restarted worker gets an id of its own (the dead one's leases stay fenced off)."""
    out = list(argv)
    out[out.index("--worker-id") + 1] = worker_id
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a complete local stack (Redis, frontends, workers, controller)")
    p.add_argument("--frontends", type=int, default=1, help="frontend processes sharing --port (default 1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--allow-demo-keys-public", action="store_true", default=None,
                   help="serve the published demo keys on a non-loopback --host (as qos frontend's flag)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--engine", choices=("torch", "sim", "openai"), default="sim")
    p.add_argument("--device", default="cpu", help="worker device: cpu, cuda, cuda:N (default cpu)")
    p.add_argument("--upstream-url", default=None, help="openai engine: the upstream server's base URL")
    p.add_argument("--upstream-model", default=None,
                   help="openai engine: the model name sent upstream (default: the pool's model name)")
    p.add_argument("--upstream-priority", action=argparse.BooleanOptionalAction, default=None,
                   help="openai engine: send the class rank as vLLM's `priority` (default on; "
                   "--no-upstream-priority for a server that rejects the field)")
    p.add_argument("--standby", action="store_true", help="also run a standby controller")
    p.add_argument("--restart", action="store_true",
                   help="start a worker that died again, with back-off (1, 2, 4, 8, 16 s: five restarts; "
                   "a sixth quick death in a row is left dead); without it a dead worker is reported "
                   "and left dead")
    p.add_argument("--demo-load", action="store_true", help="drive a mixed P0/P1/P2 load, show a live table")
    p.add_argument(
        "--demo-duration", type=float, default=0.0,
        help="with --demo-load: stop the load, and the stack with it, after S s (0 = until Ctrl-C)"
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
    openai_only = (("--upstream-model", args.upstream_model), ("--upstream-priority", args.upstream_priority))
    for flag, value in openai_only:
        if value is not None and args.engine != "openai":
            raise ConfigError(flag, "applies to --engine openai only")
    if not 0 <= args.demo_duration < math.inf:  # inf (and nan) made a schedule that never ends
        raise ConfigError("--demo-duration", "must be a number of seconds >= 0 (0: until Ctrl-C)")
    if not 0 < args.ready_timeout <= 86_400:
        raise ConfigError("--ready-timeout", "must be in (0, 86400] seconds")


def start_redis(args: argparse.Namespace) -> tuple[str, RedisServer | EmbeddedRedis | None]:
    """--redis-url if given; else a private redis-server child; else an embedded server."""
    # A `qos up` SIGKILLed could not remove its data dir: those whose processes are gone go
    # now, whichever Redis this start uses (a later start with --redis-url saw them too).
    if stale := remove_stale_dirs():
        say(f"qos up: removed {len(stale)} Redis data dir(s) left by a killed qos up: "
            f"{', '.join(str(d) for d in stale)}", err=True)
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
    from worker.runtime import hand_back_limit_s
    from worker.settings import load_settings as worker_settings

    fe = frontend_settings(cfg, {"host": args.host, "port": args.port,
                                 "allow_demo_keys_public": args.allow_demo_keys_public})
    wk = worker_settings(cfg, {"engine": args.engine, "device": args.device,
                               "upstream_url": args.upstream_url, "upstream_model": args.upstream_model,
                               "upstream_priority": args.upstream_priority})
    controller_settings(cfg)
    # a worker's hand-back after its drain may take up to hand_back_limit_s more
    return {**DEFAULT_STOP_LIMITS, "frontend": fe.shutdown_grace_s,
            "worker": wk.drain_timeout_s + hand_back_limit_s(wk, cfg)}


def check_role_ports(cfg: config_mod.QosConfig, args: argparse.Namespace) -> None:
    """The roles' own (metrics) ports, like the HTTP port, before anything starts: a port
    every frontend or worker (or both controllers) of the stack would listen on, or one that
    is taken, made a child fail only once Redis and the other children were running."""
    from limiter.controller.settings import load_settings as controller_settings
    from limiter.frontend.settings import load_settings as frontend_settings
    from worker.settings import load_settings as worker_settings

    fe = frontend_settings(cfg, {"host": args.host, "port": args.port,
                                 "allow_demo_keys_public": args.allow_demo_keys_public})
    wk = worker_settings(cfg, {"engine": args.engine, "device": args.device,
                               "upstream_url": args.upstream_url, "upstream_model": args.upstream_model,
                               "upstream_priority": args.upstream_priority})
    ct = controller_settings(cfg)
    seen = {args.port: "the HTTP port (--port)"}
    controllers = 2 if args.standby else 1
    for role, count, host, port in (("frontend", args.frontends, fe.metrics_host or fe.host, fe.metrics_port),
                                    ("worker", args.workers, wk.metrics_host, wk.metrics_port),
                                    ("controller", controllers, ct.metrics_host, ct.metrics_port)):
        name = f"{role}.metrics_port"
        if not port or not count:
            continue
        if count > 1:
            raise ConfigError(name, f"port {port} would be listened on by each of the stack's {count} "
                              f"{role}s; set 0 (off) to run more than one")
        if port in seen:
            raise ConfigError(name, f"port {port} is also {seen[port]}")
        seen[port] = name
        lifecycle.check_port_free(host, port, name)


def check_demo_load(cfg: config_mod.QosConfig) -> None:
    """--demo-load sends with the demo keys to the demo classes: a config without them got a
    401 for every request, and `qos up` still exited 0."""
    known = {k for t in cfg.tenants for k in t.key_sha256}
    for key, cls in config_mod.DEMO_KEYS.items():
        if config_mod.hash_key(key) not in known or cls not in cfg.class_names():
            raise ConfigError("--demo-load", f"sends as the demo tenants ({', '.join(config_mod.DEMO_KEYS)}, "
                              f"classes {', '.join(config_mod.DEMO_KEYS.values())}), which this config does "
                              f"not have ({key!r} / class {cls}); use it with the demo config (no --config)")


def serve(stack: UpStack, cfg: config_mod.QosConfig, args: argparse.Namespace,
          signalled: Callable[[], bool]) -> int:
    """Print the ready line and serve until ``signalled()`` (0) or the stack must stop (1)."""
    line = (
        f"qos up: ready at {stack.base_url} (redis {config_mod.redacted_url(stack.redis_url)}, "
        f"{args.frontends} frontends, {args.workers} {args.engine} workers)"
    )
    if cfg.demo:
        line += f"; demo keys: {' '.join(config_mod.DEMO_KEYS)} (admin: {config_mod.DEMO_ADMIN_KEY})"
    say(line)
    verdict: dict[str, int | None] = {"rc": None}

    def should_stop() -> bool:
        if verdict["rc"] is None and (why := stack.check()) is not None:
            say(f"qos up: {why}; stopping the stack", err=True)
            verdict["rc"] = 1
        return signalled() or verdict["rc"] is not None

    if args.demo_load:
        from limiter.localstack.demo_load import run_demo_load

        asyncio.run(run_demo_load(stack.base_url, cfg, args.engine, args.demo_duration, should_stop))
    else:
        while not should_stop():
            time.sleep(0.2)
    return verdict["rc"] or 0


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    cfg = load_config(args)
    if args.demo_load:
        check_demo_load(cfg)
    limits = stop_limits(cfg, args)
    if args.engine == "torch":
        require("torch", "qos up --engine torch")
    # The port first: a taken port is refused before anything starts.
    lifecycle.check_port_free(args.host, args.port)
    check_role_ports(cfg, args)
    children = build_commands(args)
    lifecycle.share_listen_socket([c for c in children if c.role == "frontend"], args.host, args.port)
    if not lifecycle.parent_death_supported():
        say("qos up: WARNING: no parent-death signal on this platform: if qos up is killed, stop its "
            "children by hand", err=True)
    signals = {"count": 0, "urgent": 0, "last": int(signal.SIGINT)}
    stop_after: dict[str, int] = {"base": 0}  # the urgent signals counted when the stop began

    def on_signal(signum: int, _frame: object) -> None:
        signals["count"] += 1
        signals["last"] = signum
        if signum != signal.SIGHUP:
            signals["urgent"] += 1

    def interrupted() -> bool:
        # A Ctrl-C (SIGTERM) once the stop began; or a second one however soon after the
        # first: two quick ones both came before the stop began, and the second was taken for
        # part of the first. Never a SIGHUP: a closed terminal may send two, from the shell
        # and from the kernel, and the second (once the stop had begun) killed the stack.
        return signals["urgent"] > stop_after["base"] or signals["urgent"] >= 2

    # Under nohup (SIGHUP ignored on entry) a closed terminal must not stop the stack.
    hup = () if lifecycle.hangup_ignored() else (signal.SIGHUP,)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, *hup)}
    stack: UpStack | None = None
    rc = 0
    try:
        redis_url, redis_server = start_redis(args)
        env = dict(os.environ, QOS_REDIS_URL=redis_url)
        if redis_server is not None and cfg.redis.cluster:
            # Its own Redis is a standalone server: a deployment's config (redis.cluster =
            # true, or QOS_REDIS_CLUSTER=1) told every child it was a cluster, which none
            # could reach, and the start waited out its ready timeout.
            env["QOS_REDIS_CLUSTER"] = "0"
            cfg = dataclasses.replace(cfg, redis=dataclasses.replace(cfg.redis, cluster=False))
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        host = f"[{host}]" if ":" in host else host
        stack = UpStack(redis_url=redis_url, base_url=f"http://{host}:{args.port}", redis=redis_server,
                        restart=args.restart, lease_ms=cfg.pools[0].lease_ms, env=env)
        since_ms = asyncio.run(redis_time_ms(redis_url))
        for child in children:
            stack.start(child, stack.env)
        if asyncio.run(wait_ready(stack, cfg, stack.worker_ids, since_ms, args.ready_timeout,
                                  lambda: signals["count"] > 0)):
            rc = serve(stack, cfg, args, lambda: signals["count"] > 0)
        else:
            say("qos up: interrupted while starting")
            rc = 128 + signals["last"]  # the shell's status for the signal (130: Ctrl-C)
    except RedisError as exc:  # e.g. a wrong password, or a command the Redis user may not run
        say(f"qos up: Redis refused: {type(exc).__name__}: {exc}", err=True)
        rc = 1
    except (RuntimeError, ConfigError, OSError) as exc:
        say(f"qos up: {exc or type(exc).__name__}", err=True)
        rc = 1
    finally:
        stop_after["base"] = signals["urgent"]
        if stack is not None and stack.stop(limits, interrupted):
            # Killed, not stopped cleanly (a second Ctrl-C): exit as the shell reports a process
            # that signal ended (130 for SIGINT, 143 for SIGTERM), never 0.
            rc = 128 + signals["last"]
        elif stack is not None and stack.killed_late and rc == 0:
            # A role killed past its stop limit cut what it held (a worker's running requests,
            # a frontend's open streams): a script or a service manager must not read success.
            say(f"qos up: exit status 1: {', '.join(stack.killed_late)} had to be killed", err=True)
            rc = 1
        for c in children:  # a frontend never started (the start failed first) still holds one
            c.close_sock()
        for s, h in old.items():
            with contextlib.suppress(ValueError):
                signal.signal(s, h)
        say("qos up: stopped")
    return rc
