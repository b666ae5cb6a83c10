"""``qos frontend``: run one stateless HTTP frontend process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from aiohttp import web
from aiohttp.web_runner import GracefulExit

from limiter import lifecycle
from limiter.cli import common_args, load_config, log_level_arg
from limiter.errors import ConfigError
from limiter.event_loop import install_event_loop
from limiter.frontend.app import create_app
from limiter.frontend.settings import load_settings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("frontend", help="run an OpenAI-compatible HTTP frontend (stateless; run many)")
    p.add_argument("--host", default=os.environ.get("QOS_FRONTEND_HOST"),
                   help="listen address (env QOS_FRONTEND_HOST; config frontend.host; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=_env_int("QOS_FRONTEND_PORT"),
                   help="listen port (env QOS_FRONTEND_PORT; config frontend.port; default 8000)")
    p.add_argument("--reuse-port", action="store_true", default=None,
                   help="set SO_REUSEPORT so several frontend processes share the port")
    p.add_argument("--listen-fd", type=int, default=None, metavar="FD",
                   help="serve on this inherited listening socket instead of binding --host/--port "
                   "(what `qos up` passes its frontends)")
    p.add_argument("--allow-demo-keys-public", action="store_true", default=None,
                   help="serve the published demo keys on a non-loopback address (never in production)")
    log_level_arg(p)
    common_args(p)
    p.set_defaults(func=run)


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError as exc:
        raise SystemExit(f"qos: config error: {name}: must be an integer, got {v!r}") from exc


def _raise_graceful_exit() -> None:
    raise GracefulExit()


async def _hangup_stops(_app: web.Application) -> None:
    """SIGHUP (a closed terminal, or `qos up` gone) stops the frontend like SIGTERM does
    (unless started under nohup: SIGHUP ignored stays ignored)."""
    if not lifecycle.hangup_ignored():
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, _raise_graceful_exit)


def _inherited_socket(fd: int) -> socket.socket:
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ConfigError("--listen-fd", f"{fd} is not an open socket: {exc}") from exc
    if sock.type != socket.SOCK_STREAM:
        raise ConfigError("--listen-fd", f"{fd} is not a TCP socket")
    return sock


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args)
    settings = load_settings(cfg, {"host": args.host, "port": args.port, "reuse_port": args.reuse_port,
                                   "allow_demo_keys_public": args.allow_demo_keys_public})
    if cfg.demo:
        logging.getLogger("qos.frontend").warning(
            "no config file: serving the demo config (keys demo-p0, demo-p1, demo-p2, demo-admin)")
    sock = _inherited_socket(args.listen_fd) if args.listen_fd is not None else None
    loop = install_event_loop()
    app = create_app(settings, cfg)
    # First of the startup hooks: a SIGHUP while the Redis context starts (its first heartbeat
    # already written) took the default action, killing the process (seen under load).
    app.on_startup.insert(0, _hangup_stops)
    listen = {"sock": sock} if sock is not None else {
        "host": settings.host, "port": settings.port, "reuse_port": settings.reuse_port or None}
    try:
        # run_app turns SIGTERM/SIGINT (and SIGHUP, above) into a graceful exit: stop listening,
        # give in-flight requests shutdown_grace_s, cancel the rest (their handlers cancel
        # them in Redis).
        web.run_app(app, **listen,
                    shutdown_timeout=settings.shutdown_grace_s, handler_cancellation=True,
                    keepalive_timeout=settings.idle_timeout_s,
                    access_log=None, print=lambda _msg: logging.getLogger("qos.frontend").info(
                        "listening on http://%s:%d (%s)", settings.host, settings.port, loop))
    except OSError as exc:
        where = f"{settings.host}:{settings.port}"
        raise ConfigError("frontend.port", f"cannot listen on {where}: {exc}") from exc
    return 0
