"""``qos config``: check a file, print an example, hash a key."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from limiter import config as config_mod
from limiter.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="validate a config file, print an example, hash an API key")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = csub.add_parser("check", help="validate FILE; prints the first bad field with its path")
    check.add_argument("file")
    check.set_defaults(func=_check)
    ex = csub.add_parser("example", help="print a commented example config (the fields most deployments set)")
    ex.set_defaults(func=lambda a: print(example_text(), end=""))
    hk = csub.add_parser("hash-key", help="print the sha256 of an API key, for tenants[].key_sha256")
    hk.add_argument("key", nargs="?", default="-",
                    help="the key; '-' or none: read from standard input (out of the shell's history "
                         "and the process list)")
    hk.set_defaults(func=_hash_key)


def _stdin_line() -> str:
    """One line of standard input as its bytes (surrogates for what is not UTF-8)."""
    line = sys.stdin.buffer.readline() if hasattr(sys.stdin, "buffer") else sys.stdin.readline().encode(
        "utf-8", "surrogateescape")
    return line.rstrip(b"\r\n").decode("utf-8", "surrogateescape")


def _hash_key(args: argparse.Namespace) -> int:
    # stdin's bytes as they are (its text layer decodes strictly under a UTF-8 locale: a key
    # that is not UTF-8 was a traceback), as hash_key takes them
    key = args.key if args.key != "-" else _stdin_line()
    if not key:
        print("qos config hash-key: no key given (an argument, or one line on standard input)",
              file=sys.stderr)
        return 2
    print(config_mod.hash_key(key))
    return 0


def example_text() -> str:
    return (Path(__file__).parent / "qos.example.toml").read_text()


def check_role_sections(cfg: config_mod.QosConfig) -> None:
    """Validate ``[frontend]``, ``[worker]`` and ``[controller]`` as each role would at start
    (unknown keys, types, ranges; errors name ``<role>.<field>``), so that a typo shows here
    and not only when that role starts."""
    from limiter.controller.settings import load_settings as controller_settings
    from limiter.frontend.settings import load_settings as frontend_settings
    from worker.settings import load_settings as worker_settings

    frontend_settings(cfg)
    try:
        worker_settings(cfg)
    except ConfigError as exc:
        # The engine is often each worker's flag (`qos worker --engine openai --upstream-url ...`,
        # `qos up --engine openai`), not in [worker]: checked as a torch worker, a pool only the
        # openai engine can serve was refused although every worker started with it took it.
        if "engine" in cfg.worker or not exc.path.startswith("pools["):
            raise
        try:
            worker_settings(cfg, {"engine": "openai",
                                  "upstream_url": cfg.worker.get("upstream_url") or "http://upstream.invalid"})
        except ConfigError:
            raise exc from None
    controller_settings(cfg)


def _check(args: argparse.Namespace) -> int:
    if not args.file.strip():  # load() reads an empty path as none: the demo config was checked
        raise ConfigError(repr(args.file), "no file named: give the path of the config file to check")
    cfg = config_mod.load(args.file, {})
    check_role_sections(cfg)
    print(f"{args.file}: ok ({len(cfg.pools)} pools, {len(cfg.classes)} classes, {len(cfg.tenants)} tenants)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(0)
