"""``qos status`` and ``qos top``: what a running deployment is doing, read from Redis alone.

Both work against any deployment (they need only the config's pools and classes and the
Redis URL), never write, and use :func:`limiter.status.snapshot`, the same view the
frontend's admin endpoint serves. ``qos status --json`` is the scripting interface; its
schema is documented in README.md ("qos status --json").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from typing import Any

from redis.exceptions import RedisClusterException, RedisError
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from limiter import config as config_mod
from limiter.cli import common_args, load_config
from limiter.config import QosConfig
from limiter.console import stdout_console
from limiter.errors import ConfigError, InvalidName, QosError, RedisUnavailable
from limiter.keys import PoolKeys
from limiter.redis_conn import map_redis_errors, open_redis
from limiter.status import UNREACHABLE, each_pool, snapshot


def add_parser(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("status", help="one snapshot of queues, rates, buckets, workers (from Redis)")
    st.add_argument("--json", action="store_true", help="print the snapshot as JSON (schema in README)")
    st.add_argument("--decisions", type=int, default=5, help="recent controller decisions per pool")
    common_args(st)
    st.set_defaults(func=run_status)
    top = sub.add_parser("top", help="a live terminal view of the deployment (from Redis)")
    top.add_argument("--interval", type=float, default=1.0, help="refresh period in seconds")
    top.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (0 = until Ctrl-C)")
    common_args(top)
    top.set_defaults(func=run_top)


async def full_snapshot(client: Any, cfg: QosConfig, decisions: int) -> dict[str, Any]:
    """The status snapshot plus each worker's live stats and the last controller decisions.
    Raises RedisUnavailable (no answer) or QosError (Redis refused: a database index out of
    range, cluster mode against a standalone server...), never redis-py's own tracebacks."""
    try:
        with map_redis_errors():
            return await _full_snapshot(client, cfg, decisions)
    except (RedisError, RedisClusterException) as exc:
        raise QosError(f"Redis refused the status read: {exc}") from exc


async def _full_snapshot(client: Any, cfg: QosConfig, decisions: int) -> dict[str, Any]:
    snap = await snapshot(client, cfg)
    pools = snap["pools"]
    reachable = [p for p in cfg.pools if "unreachable" not in pools[p.name]]
    added = await each_pool(reachable, lambda p: _add_workers_and_decisions(
        client, PoolKeys(p.name), pools[p.name], decisions))
    for name, result in added.items():
        if isinstance(result, RedisUnavailable):  # its shard went since the snapshot read it: that pool alone
            pools[name] = {"model": pools[name]["model"], "unreachable": UNREACHABLE}
    return snap


async def _add_workers_and_decisions(client: Any, keys: PoolKeys, pool: dict[str, Any],
                                     decisions: int) -> None:
    # one round trip for the pool: a read per worker, one after another, took a round trip
    # each (3,000 workers at 1 ms: past the status read's bound, found by a review)
    pipe = client.pipeline(transaction=False)
    read: list[dict[str, Any]] = []
    for worker_id, info in pool["workers"].items():
        try:
            key = keys.worker(worker_id)
        except InvalidName:  # not a name a worker could have (written by hand): no hash to read
            info["note"] = "not a valid worker id"
            continue
        pipe.hgetall(key)
        read.append(info)
    if decisions > 0:
        pipe.xrevrange(keys.decisions, count=decisions)
    replies = await pipe.execute() if len(pipe) else []
    for info, raw in zip(read, replies[:len(read)], strict=True):
        if not raw:
            # Its stats hash expired (no beat for its heartbeat_ttl_s: killed, or its host
            # gone); the set keeps it until a live worker prunes it at twice that. Shown as
            # any other, it read as a worker at work with a growing "last seen" (a newcomer's walk).
            info["note"] = "silent: no heartbeat within its TTL (stopped or unreachable)"
            continue
        fields = {_s(k): _s(v) for k, v in raw.items()}
        info.update({k: v if k in TEXT_FIELDS else _num(v) for k, v in fields.items()})
    rows = replies[len(read)] if decisions > 0 else []
    pool["decisions"] = [_decision(entry) for _id, entry in rows]


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# A worker's heartbeat fields that are text whatever they look like (a host named "1e3")
TEXT_FIELDS = frozenset({"host", "engine", "pool", "device", "state", "upstream", "upstream_state"})


def _num(v: str) -> Any:
    """A heartbeat field's number, or its text: also where it is not finite (``--json`` would
    print NaN, which is not JSON)."""
    for conv in (int, float):
        try:
            n = conv(v)
        except ValueError:
            continue
        return n if math.isfinite(n) else v
    return v


def _decision(entry: dict[Any, Any]) -> dict[str, Any]:
    e = {_s(k): _s(v) for k, v in entry.items()}
    try:
        body = json.loads(e.get("d", "{}"))
    except json.JSONDecodeError:
        body = {"raw": e.get("d")}
    return {"version": _num(e.get("version", "0")), "controller": e.get("controller"), "decision": body}


MAX_DECISIONS = 1000  # --decisions: what one status read fetches per pool at most


async def _status(args: argparse.Namespace) -> int:
    if not 0 <= args.decisions <= MAX_DECISIONS:  # -3 showed none; a huge one was Redis' own error
        raise ConfigError("--decisions", f"must be in [0, {MAX_DECISIONS}], got {args.decisions}")
    cfg = load_config(args, tokenizer_files=False)  # counts no tokens
    client = open_redis(cfg.redis)
    try:
        snap = await full_snapshot(client, cfg, args.decisions)
    finally:
        await client.aclose()
    if args.json:
        print(json.dumps(snap, indent=2, sort_keys=True))
    else:
        stdout_console().print(render(snap, cfg.redis.url))
    return 0


def run_status(args: argparse.Namespace) -> int:
    return asyncio.run(_status(args))




def _fmt(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def _percent(v: Any) -> str:
    """A 0-1 fraction as a percentage (kv use: 0.97 showed as "1", full, and 0.3 as "0")."""
    return f"{v * 100:.1f} %" if isinstance(v, int | float) and not isinstance(v, bool) else _fmt(v)


def _last_reasons(pool: dict[str, Any]) -> tuple[dict[str, str], str]:
    """Each class's reason in the newest decision record, and that record's age label."""
    for row in pool.get("decisions") or []:
        body = row["decision"]
        if isinstance(body, dict) and isinstance(body.get("classes"), dict):
            reasons = {k: str(v.get("reason")) for k, v in body["classes"].items() if isinstance(v, dict)}
            return reasons, f"v{row['version']}"
    return {}, "-"


def render(snap: dict[str, Any], redis_url: str | None = None) -> Group:
    parts: list[Any] = []
    for name, pool in snap["pools"].items():
        if "unreachable" in pool:
            line = f"pool {name} (model {pool['model']}) — {pool['unreachable']}"
            parts.append(Text(line, style="bold red"))
            continue
        conf = pool.get("capacity_confidence")
        source = pool.get("capacity_source") or "-"
        age = pool.get("compliance_age_s")
        measured = (f"measured {_fmt(pool.get('measured_capacity'))} from {source}"
                    + ("" if conf is None else f", confidence {conf * 100:.0f} %")
                    + ("" if age is None else f", {age:.0f} s old"))
        reasons, version = _last_reasons(pool)
        where = f" in {config_mod.redacted_url(redis_url)}" if redis_url else ""
        unset = "" if pool.get("initialised", True) else (
            f" — NOT INITIALISED{where} (no role set it up there: a `qos up` stack's private Redis is the "
            "URL its ready line prints, for --redis-url)")
        t = Table(
            title=f"pool {name} (model {pool['model']}) — capacity {_fmt(pool['capacity'])} tok/s "
            f"({measured}), policy v{_fmt(pool['policy_version'])}{unset}"
        )
        for col in ("class", "rate", "ceil", "burst", "tokens", "fill", "queued", "inflight", "compliance",
                    f"last decision ({version})"):
            t.add_column(col, justify="right")
        for cls, c in pool["classes"].items():
            fill = None if not c["burst"] or c["tokens"] is None else c["tokens"] / c["burst"]
            comp = None if c["compliance"] is None else f"{c['compliance'] * 100:.1f} %"
            t.add_row(
                cls,
                _fmt(c["rate"]),
                _fmt(c.get("ceil")),
                _fmt(c["burst"]),
                _fmt(c["tokens"]),
                "-" if fill is None else f"{fill * 100:.0f} %",
                str(c["queued"]),
                str(c["inflight"]),
                comp or "-",
                reasons.get(cls, "-"),
            )
        parts.append(t)
        if pool.get("redis_eviction"):
            parts.append(Text(pool["redis_eviction"], style="bold red"))
        w = Table(title=f"workers of {name}")
        for col in ("worker", "last seen s", "engine", "batch", "tokens/s", "capacity", "step budget",
                    "kv use"):
            w.add_column(col, justify="right")
        for wid, info in sorted(pool["workers"].items()):
            engine = "SILENT" if "note" in info else str(info.get("engine", "-")) + (
                " (SIMULATED)" if str(info.get("simulated")) in ("1", "True") else ""
            ) + (" (upstream down)" if info.get("upstream_state") == "open" else "")
            w.add_row(
                wid,
                _fmt(info.get("last_seen_s"), 1),
                engine,
                _fmt(info.get("batch_size")),
                _fmt(info.get("tokens_s")),
                _fmt(info.get("capacity_tokens_s")),
                f"{_fmt(info.get('token_budget'))} / {_fmt(info.get('token_budget_max'))}",
                _percent(info.get("kv_use")),
            )
        parts.append(w)
        if pool.get("decisions"):
            d = Table(title=f"recent decisions of {name}")
            d.add_column("version", justify="right")
            d.add_column("controller")
            d.add_column("reasons")
            for row in pool["decisions"]:
                body = row["decision"]
                reasons = body.get("reasons") if isinstance(body, dict) else None
                if reasons is None and isinstance(body, dict):
                    classes = body.get("classes")
                    reasons = {k: v.get("reason") for k, v in classes.items()
                               if isinstance(v, dict)} if isinstance(classes, dict) else None
                d.add_row(str(row["version"]), str(row["controller"]), json.dumps(reasons)[:80])
            parts.append(d)
    return Group(*parts)


async def _top(args: argparse.Namespace) -> int:
    if not 0.1 <= args.interval <= 3600:  # 0, -1 or nan polled Redis flat out
        raise ConfigError("--interval", f"must be in [0.1, 3600] seconds, got {args.interval}")
    if args.iterations < 0:  # -1 ran for ever, as 0 does by design
        raise ConfigError("--iterations", f"must be 0 (until Ctrl-C) or more, got {args.iterations}")
    cfg = load_config(args, tokenizer_files=False)  # counts no tokens
    client = open_redis(cfg.redis)
    n = 0
    last: dict[str, Any] | None = None
    down_since = ""  # the time of day Redis stopped answering, while it does not
    try:
        with Live(console=stdout_console(), refresh_per_second=4, screen=False) as live:
            while args.iterations <= 0 or n < args.iterations:
                started = time.monotonic()
                # A live view rides through an outage (a failover, a restart): it quit at the
                # first read that found no Redis, when the operator was watching for just that
                try:
                    last, down_since = await full_snapshot(client, cfg, 5), ""
                    live.update(render(last, cfg.redis.url))
                except RedisUnavailable as exc:
                    # (its reason too: a wrong password or TLS certificate is a ConnectionError)
                    down_since = down_since or time.strftime("%H:%M:%S")
                    note = Text(f"Redis unavailable since {down_since}: retrying every {args.interval:g} s"
                                + (" (the last view below)" if last else "") + f"\n{exc}", style="bold red")
                    live.update(Group(note, render(last, cfg.redis.url)) if last else note)
                n += 1
                await asyncio.sleep(max(0.0, args.interval - (time.monotonic() - started)))
    finally:
        await client.aclose()
    return 1 if down_since else 0  # scripted (--iterations): whether its last read found Redis


def run_top(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_top(args))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 0
