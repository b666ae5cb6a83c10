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

from limiter import lifecycle
from limiter.cli import common_args, load_config, log_level_arg
from limiter.errors import ConfigError
from limiter.event_loop import install_event_loop
from limiter.frontend.app import create_app
from limiter.frontend.settings import FrontendSettings, load_settings

log = logging.getLogger("qos.frontend")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("frontend", help="run an OpenAI-compatible HTTP frontend (stateless; run many)")
    p.add_argument("--host", default=os.environ.get("QOS_FRONTEND_HOST"),
                   help="listen address (env QOS_FRONTEND_HOST; config frontend.host; default 127.0.0.1)")
    # (a string default goes through `type` only when this subcommand is the one parsed: a bad
    # QOS_FRONTEND_PORT, read here for every subcommand, stopped `qos worker` and the rest too)
    p.add_argument("--port", type=_port_arg, default=os.environ.get("QOS_FRONTEND_PORT") or None,
                   help="listen port (env QOS_FRONTEND_PORT; config frontend.port; default 8000)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="also serve this process's /metrics and /healthz alone on this port ([frontend] "
                        "metrics_port; default 0: none): processes sharing the API port (--reuse-port) "
                        "each answer its /metrics in turn, so scrape these instead")
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


def _port_arg(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {value!r} (the default comes from "
                                         "QOS_FRONTEND_PORT)") from None


async def _serve(app: web.Application, settings: FrontendSettings, sock: socket.socket | None,
                 loop_name: str) -> None:
    """Serve until SIGTERM, SIGINT or SIGHUP (unless started under nohup: SIGHUP ignored
    stays ignored), then stop listening, give in-flight requests shutdown_grace_s and cancel
    the rest (their handlers cancel them in Redis).

    A signal only sets an event, looked at once the startup is done. aiohttp's run_app raised
    GracefulExit from the handler instead: one that landed while the app started (its first
    heartbeat already written) cancelled the startup halfway and skipped the cleanup, so the
    process left its heartbeat behind or hung in its reply readers' blocking reads (loaded
    pass 18). Handlers go in before the startup: a signal in it must not kill the process."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("%s again: already stopping (in-flight requests get up to %.0f s)",
                        sig.name, settings.shutdown_grace_s)
            return
        log.info("%s: stopping", sig.name)
        stop.set()

    hup = () if lifecycle.hangup_ignored() else (signal.SIGHUP,)
    for sig in (signal.SIGTERM, signal.SIGINT, *hup):
        loop.add_signal_handler(sig, on_signal, sig)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=settings.shutdown_grace_s,
                           handler_cancellation=True, keepalive_timeout=settings.idle_timeout_s,
                           access_log=None)
    await runner.setup()
    try:
        if stop.is_set():
            return  # stopped while starting: never listened
        site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(
            runner, settings.host, settings.port, reuse_port=settings.reuse_port or None)
        try:
            await site.start()
        except OSError as exc:
            where = f"{settings.host}:{settings.port}"
            raise ConfigError("frontend.port", f"cannot listen on {where}: {exc}") from exc
        log.info("listening on http://%s:%d (%s)", settings.host, settings.port, loop_name)
        await stop.wait()
    finally:
        await runner.cleanup()


def _inherited_socket(fd: int) -> socket.socket:
    if not 0 <= fd <= 2**31 - 1:  # socket() raised ValueError (negative) or OverflowError: a traceback
        raise ConfigError("--listen-fd", f"{fd} is not an open socket: a file descriptor is in "
                          "[0, 2147483647]")
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
                                   "metrics_port": args.metrics_port,
                                   "allow_demo_keys_public": args.allow_demo_keys_public})
    if cfg.demo:
        log.warning(
            "no config file: serving the demo config (keys demo-p0, demo-p1, demo-p2, demo-admin)")
    sock = _inherited_socket(args.listen_fd) if args.listen_fd is not None else None
    loop_name = install_event_loop()
    app = create_app(settings, cfg)
    asyncio.run(_serve(app, settings, sock, loop_name))
    return 0
