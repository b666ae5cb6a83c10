"""``qos controller``: the closed loop that rewrites class rates from SLO compliance.

Run two or more (different ``--id``) for failover: one leads each pool, the others stand
by. Flags override the config's ``[controller]`` table; both are validated together, so an
error names ``controller.<field>``. See docs/controller.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from limiter.cli import common_args, load_config, log_level_arg
from limiter.controller.settings import load_settings
from limiter.event_loop import install_event_loop


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("controller", help="run a controller: SLO windows -> new class rates "
                       "(one leader per pool, any number of standbys)")
    a = p.add_argument
    a("--id", dest="controller_id", help="controller id, unique per process (default <hostname>-<pid>); "
      "also its consumer name in the samples group: a restart with the same id replays its pending samples")
    a("--pool", dest="pools", action="extend", nargs="+", metavar="NAME",
      help="pool(s) to control (repeatable; default: every configured pool)")
    a("--tick", dest="tick_s", type=float, help="seconds between decisions (default 1)")
    a("--lease", dest="lease_s", type=float, help="leader lease in seconds (default 3)")
    a("--metrics-port", type=int, help="Prometheus /metrics and /healthz port (0 = off, the default)")
    a("--metrics-host", help="metrics listen address (default 0.0.0.0)")
    log_level_arg(p)
    common_args(p)
    p.set_defaults(func=run)


_FIELDS = ("controller_id", "pools", "tick_s", "lease_s", "metrics_port", "metrics_host")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args, tokenizer_files=False)  # counts no tokens
    settings = load_settings(cfg, {f: getattr(args, f) for f in _FIELDS})
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[{settings.controller_id}]: %(message)s")
    from limiter.controller.service import serve

    install_event_loop()
    return asyncio.run(serve(settings, cfg))
