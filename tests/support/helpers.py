"""Small helpers shared by the Redis-level tests."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import re
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from limiter.config import QosConfig, demo_config
from limiter.keys import PoolKeys
from limiter.scripts import Admitted, Scripts, policy_document

_ids = itertools.count(1)


async def wait_until(pred: Callable[[], Any], what: str, timeout: float = 15.0, every: float = 0.01) -> Any:
    """Poll ``pred`` (a quick, synchronous check) without blocking the event loop until it is
    true; fail naming ``what`` after ``timeout`` s. The deadline is generous on purpose: it
    bounds a hang, it does not measure speed (a busy CI machine is slow, not wrong)."""
    end = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() > end:
            raise AssertionError(f"still waiting after {timeout} s for: {what}")
        await asyncio.sleep(every)
    return value
ALIVE = 4102444800000  # a heartbeat in 2100


async def wait_for(check: Callable[[], Awaitable[Any]], what: str, timeout: float = 30.0,
                   every: float = 0.01) -> Any:
    """:func:`wait_until` for a check that must be awaited (a Redis read): await ``check``
    until it answers something true; fail naming ``what`` after ``timeout`` s (a bound on a
    hang, not a speed)."""
    end = time.monotonic() + timeout
    while not (value := await check()):
        if time.monotonic() > end:
            raise AssertionError(f"still waiting after {timeout} s for: {what}")
        await asyncio.sleep(every)
    return value


def three_classes(**extra: dict[str, Any]) -> list[dict[str, Any]]:
    """The classes P0/P1/P2 at the demo's 0.6/0.35/0.05 shares as TOML-shaped tables (for
    :func:`limiter.localstack.toml_writer.toml_dumps`), ``extra[name]``'s fields added."""
    return [{"name": n, "share": s, **extra.get(n, {})} for n, s in (("P0", 0.6), ("P1", 0.35), ("P2", 0.05))]


def class_cfg(**class_overrides: dict[str, Any]) -> QosConfig:
    """The demo config with some fields of some classes replaced: ``P2={"queue_cap": 3}``."""
    cfg = demo_config()
    classes = tuple(dataclasses.replace(c, **class_overrides.get(c.name, {})) for c in cfg.classes)
    return dataclasses.replace(cfg, classes=classes)


async def init_pool(scripts: Scripts, cfg: QosConfig, capacity: float | None = None) -> PoolKeys:
    """Pool 'tiny' of ``cfg`` (rates reset, at ``capacity`` when given) with a live frontend 'fe1'."""
    keys = PoolKeys("tiny")
    await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny"), capacity), reset_rates=True)
    await scripts.client.zadd(keys.frontends, {"fe1": ALIVE})
    return keys


async def admit(scripts: Scripts, keys: PoolKeys, *, cls: str = "P1", tenant: str = "t1",
                input_tokens: int = 100, max_tokens: int = 10, tenant_rate: float = 1e9,
                tenant_burst: float = 1e9, max_inflight: int = 0, max_wait_ms: int = 0,
                request_id: str | None = None, frontend: str = "fe1", tenant_weight: float = 1.0) -> Admitted:
    rid = request_id or f"req-{next(_ids)}"
    return await scripts.admit(
        keys, request_id=rid, tenant=tenant, cls=cls, input_tokens=input_tokens, max_tokens=max_tokens,
        tenant_rate=tenant_rate, tenant_burst=tenant_burst, tenant_max_inflight=max_inflight,
        max_wait_ms=max_wait_ms, frontend_id=frontend, payload=b"{}", tenant_weight=tenant_weight)


def ceil_mark(record: dict[str, Any]) -> tuple[int | None, int | None]:
    """A record's ``ceil_out`` (lua/include/record.lua parse_ceil_out): the output tokens its
    binding ceiling was charged as delivered, and where a renewal marked it late, the output
    it had delivered then (None: its claim marked it; both None: no mark)."""
    raw = record.get("ceil_out")
    if raw is None:
        return None, None
    charged, _, late = str(raw).partition("@")
    return int(charged), int(late) if late else None


def charge_of(record: dict[str, Any]) -> float:
    """What a finished request's record says it must have been charged (``cost - refund +
    overrun``), the ledger's rule: its true usage when its worker completed it (usage_in,
    usage_out; beyond its reservation too, when the model server counted more prompt than
    the frontend did); otherwise (an expiry, a cancel, a refusal, a lease given up) its prompt
    and the tokens delivered when it ended held by a worker (``ended`` leased) or an attempt
    had delivered some, nothing when it ended queued with none. Absent fields may be missing
    or None."""
    w_in, w_out, cost = float(record["w_in"]), float(record["w_out"]), float(record["cost"])
    out = int(record.get("out_tokens") or 0)
    if record.get("usage_in") is not None:
        used = int(record["usage_in"]) * w_in + int(record["usage_out"]) * w_out
    elif out or record.get("ended") == "leased":
        used = int(record["input_tokens"]) * w_in + out * w_out
    else:
        return 0.0
    return used if record.get("usage_in") is not None else min(used, cost)


async def redis_ms(client: Any) -> int:
    """The Redis server's clock, in ms (what the scripts read with TIME)."""
    sec, usec = await client.time()
    return int(sec) * 1000 + int(usec) // 1000


def dump_all(client: Any) -> dict[bytes, tuple[bytes, bool]]:
    """Every key's DUMP (type, value, encoding) and whether it has a TTL: byte-for-byte state.

    A key that expires while the snapshot is taken (listed by KEYS, gone by its DUMP or
    PTTL) is left out, as if it had gone a moment earlier. Kept, it read as a key without a
    TTL whose value was None, and a comparison with a later snapshot (where it is gone) said
    that state changed: the model test failed so on a loaded machine, where an example can
    outlast the 30 s TTL of its first finished records."""
    out = {}
    for key in sorted(client.keys("*")):
        value, ttl = client.dump(key), client.pttl(key)
        if value is None or ttl == -2:  # -2: no such key (any more); -1: no TTL
            continue
        out[key] = (value, ttl != -1)  # a TTL of 0 ms left is still a TTL
    return out


def logical_state(client: Any) -> dict[bytes, tuple[Any, bool]]:
    """Every key's contents and whether it has a TTL, compared as data: what :func:`dump_all`
    gives where DUMP's bytes may differ for the same contents (a hash restored by RESTORE is
    rehashed as it is read, and its DUMP then lists its fields in another order)."""
    out: dict[bytes, tuple[Any, bool]] = {}
    for key in sorted(client.keys("*")):
        kind = client.type(key).decode()
        if kind == "hash":
            value: Any = sorted(client.hgetall(key).items())
        elif kind == "zset":
            value = client.zrange(key, 0, -1, withscores=True)
        elif kind == "set":
            value = sorted(client.smembers(key))
        elif kind == "list":
            value = client.lrange(key, 0, -1)
        elif kind == "stream":
            value = client.xrange(key)
        else:
            value = client.get(key)
        ttl = client.pttl(key)
        if ttl == -2:  # gone meanwhile (its TTL ran out)
            continue
        out[key] = (value, ttl != -1)
    return out


def tenant_figures(p99_ms: float, work: int) -> dict[str, Any]:
    """One tenant's figures as ``qos bench tenants`` reports them: one request, served, with
    this TTFT and this much work in the window."""
    return {"sent": 1, "completed": 1, "rejected_429": 0, "rejected_503": 0, "ttft_p50_ms": p99_ms,
            "ttft_p99_ms": p99_ms, "work_in_window": work}


_MONITOR_LINE = re.compile(r'^[\d.]+ \[\d+ (\S+)[^\]]*\] (.*)$', re.S)
_MONITOR_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"', re.S)
_MONITOR_ESCAPE = re.compile(r'\\(x[0-9a-fA-F]{2}|.)', re.S)
_ESCAPED = {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b"}


def _unescape(arg: str) -> str:
    """One MONITOR argument as Redis quoted it (``sdscatrepr``: \\xHH, \\n, \\", \\\\)."""
    def one(m: re.Match[str]) -> str:
        e = m.group(1)
        return chr(int(e[1:], 16)) if len(e) == 3 else _ESCAPED.get(e, e)
    return _MONITOR_ESCAPE.sub(one, arg)


async def script_command_args(redis_server: Any, run: Callable[[], Awaitable[Any]]) -> list[list[str]]:
    """Every command a script ran inside Redis while ``run()`` ran, as MONITOR shows it, each
    as its list of arguments (``["HSET", "qos:{tiny}:...", ...]``; an argument with a space
    stays one): what a script touches and how often."""
    seen: list[list[str]] = []
    ready = threading.Event()

    def watch() -> None:
        with redis_server.client().monitor() as m:
            ready.set()
            while True:
                raw = m.connection.read_response()
                text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
                line = _MONITOR_LINE.match(text)
                if line is None:  # the +OK MONITOR answers with
                    continue
                args = [_unescape(a) for a in _MONITOR_ARG.findall(line.group(2))]
                if line.group(1) == "lua":
                    seen.append(args)
                elif args[:2] == ["ECHO", "monitor-done"] or args[:2] == ["echo", "monitor-done"]:
                    return

    def done() -> None:
        client = redis_server.client()
        client.echo("monitor-done")
        client.close()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    assert await asyncio.to_thread(ready.wait, 15), "MONITOR did not start"
    await run()
    await asyncio.to_thread(done)
    await asyncio.to_thread(t.join, 15)
    assert not t.is_alive(), "MONITOR did not see the end marker"
    return seen


async def script_commands(redis_server: Any, run: Callable[[], Awaitable[Any]]) -> list[str]:
    """:func:`script_command_args`, each command as one line ("HSET qos:{tiny}:... ...")."""
    return [" ".join(args) for args in await script_command_args(redis_server, run)]


def refused_by_name(monkeypatch: Any, capsys: Any, module: Any, runs: str, argv: list[str],
                    named: str, stream: str = "err") -> None:
    """``qos <argv>`` exits 2 with ``named`` in its output (``stream``: 'err' or 'out') and
    never calls ``module.runs`` (the run that would start the stack)."""
    from limiter import cli

    started: list[object] = []
    monkeypatch.setattr(module, runs, lambda *a, **k: started.append(a))
    assert cli.main(argv) == 2
    got = getattr(capsys.readouterr(), stream)
    assert named in got, got
    assert started == []
