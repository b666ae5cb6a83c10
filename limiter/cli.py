"""The ``qos`` command: one entry point, a subcommand per role and tool.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``; the module
sets ``func`` on its parser. Every subcommand takes ``--config`` (env QOS_CONFIG) and
``--redis-url`` (env QOS_REDIS_URL).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import stat
import sys

from limiter import config as config_mod
from limiter.errors import ConfigError, QosError

# Subcommand modules, in help order. Each defines add_parser(subparsers).
SUBCOMMANDS = (
    "limiter.localstack.up",
    "limiter.config_cli",
    "limiter.ops_cli",
    "limiter.bench.cli",
    "limiter.frontend.cli",
    "worker.cli",
    "limiter.controller.cli",
)


def common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=os.environ.get("QOS_CONFIG"),
                        help="TOML config file (env QOS_CONFIG); default: the demo config")
    parser.add_argument("--redis-url", default=os.environ.get("QOS_REDIS_URL"),
                        help="Redis URL (env QOS_REDIS_URL), overrides the config's redis.url")


# Every name logging itself takes (WARN, FATAL and NOTSET too: they worked before the check).
LOG_LEVELS = tuple(logging.getLevelNamesMapping())


def _log_level(value: str) -> str:
    level = value.strip().upper()
    if level not in LOG_LEVELS:  # logging.basicConfig's ValueError was a traceback
        raise argparse.ArgumentTypeError(f"{value!r} is not a log level: one of {', '.join(LOG_LEVELS)} "
                                          "(the default comes from QOS_LOG_LEVEL)")
    return level


def log_level_arg(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` of a role (default: env QOS_LOG_LEVEL, else INFO), checked as parsed:
    argparse also checks a string default, so a bad QOS_LOG_LEVEL is a usage error (exit 2)."""
    parser.add_argument("--log-level", type=_log_level, default=os.environ.get("QOS_LOG_LEVEL", "INFO"),
                        help=f"one of {', '.join(LOG_LEVELS)} (env QOS_LOG_LEVEL; default INFO)")


def load_config(args: argparse.Namespace, *, tokenizer_files: bool = True) -> config_mod.QosConfig:
    """The config named by --config, with env overrides, then --redis-url on top.
    ``tokenizer_files`` False for a role that counts no tokens (config.validate)."""
    env = dict(os.environ)
    if getattr(args, "redis_url", None):
        env["QOS_REDIS_URL"] = args.redis_url
    return config_mod.load(getattr(args, "config", None), env, tokenizer_files=tokenizer_files)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qos", description="Request-level QoS for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"qos: config error: {exc}", file=sys.stderr)
        return 2
    except QosError as exc:
        print(f"qos: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if not _stdout_is_a_pipe():  # a socket of the command's own, not its reader: a real error
            raise
        # The reader went away (`qos status --json | head`): no traceback, and none from the
        # flush at exit either (stdout now goes nowhere); the shell's status for SIGPIPE.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _stdout_is_a_pipe() -> bool:
    try:
        mode = os.fstat(sys.stdout.fileno()).st_mode
    except (OSError, ValueError):  # no real file behind it
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


if __name__ == "__main__":
    sys.exit(main())
