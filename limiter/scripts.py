"""The script registry: loads ``lua/*.lua`` once and exposes typed async wrappers.

Each wrapper is one Redis round trip (EVALSHA; redis-py's registered scripts reload
themselves on NOSCRIPT, e.g. after a Redis restart). Script replies become dataclasses;
error replies become exceptions from :mod:`limiter.errors`.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from limiter.config import PoolConfig, QosConfig
from limiter.errors import (
    InvalidArgument,
    LeaseLost,
    PolicyMissing,
    QueueFull,
    RedisUnavailable,
    ScriptError,
    StaleLeader,
    TenantBusy,
    Throttled,
)
from limiter.keys import PoolKeys, check_name

SCRIPT_NAMES = (
    "admit", "claim", "renew_leases", "push_tokens", "complete", "cancel_request",
    "reap_expired", "init_pool", "set_rates", "acquire_leader", "release_leader", "release",
)
_INCLUDE = re.compile(r"^--!include (\S+)\s*$", re.MULTILINE)


def lua_dir() -> Path:
    """The installed copy (``limiter/lua`` in the wheel) or the source tree's ``lua/``."""
    installed = Path(str(resources.files("limiter"))) / "lua"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parent.parent / "lua"


@cache
def script_source(name: str) -> str:
    """A script with its ``--!include`` lines replaced by ``lua/include/<file>``."""
    base = lua_dir()
    text = (base / f"{name}.lua").read_text()
    return _INCLUDE.sub(lambda m: (base / "include" / m.group(1)).read_text(), text)


@cache
def lifecycle_keys(keys: PoolKeys) -> tuple[str, ...]:
    """The fixed KEYS list of every request-lifecycle script (lua/include/pool_keys.lua).

    Cached per pool: it is on every hot path and never changes."""
    return (
        keys.policy, keys.pool_bucket, keys.deadlines, keys.leases, keys.cancels, keys.served,
        keys.wake, keys.inflight, keys.tenant_inflight, keys.stats, keys.samples, keys.frontends,
        keys.request_prefix, keys.tokens_prefix, keys.bucket_prefix, keys.queue_prefix,
        keys.reply_prefix, keys.outage,
    )


def policy_document(cfg: QosConfig, pool: PoolConfig, capacity: float | None = None) -> dict[str, Any]:
    """The init_pool JSON for a pool: class rates are shares of the capacity."""
    cap = pool.capacity_tokens_s if capacity is None else capacity
    classes = []
    for c in cfg.classes:
        rate = c.share * cap
        ceil = c.ceil_share * cap
        classes.append({
            "name": c.name, "rate": rate, "burst": rate * c.burst_s, "ceil": ceil,
            "ceil_burst": ceil * c.burst_s, "weight": c.weight, "out_weight": c.out_weight,
            "queue_cap": c.queue_cap, "max_wait_ms": c.max_wait_ms, "floor": c.floor,
        })
    return {
        "pool": pool.name, "capacity": cap, "pool_burst": cap * pool.pool_burst_s,
        "lease_ms": pool.lease_ms, "max_attempts": pool.max_attempts,
        "frontend_ttl_ms": pool.frontend_ttl_ms, "floor_half_life_ms": pool.floor_half_life_ms,
        "record_ttl_s": pool.record_ttl_s, "floor_quantum": pool.floor_quantum_tokens,
        "classes": classes,
    }


def pack_token_ids(ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def unpack_token_ids(blob: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(blob) // 4}I", blob))


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# --- results ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Admitted:
    depth: int
    cost: float
    borrowed: bool
    deadline_ms: int
    duplicate_state: str | None = None  # set when the id had been admitted before


@dataclass(frozen=True)
class Claimed:
    request_id: str
    cls: str
    tenant: str
    attempt: int
    payload: bytes
    enq_ms: int
    input_tokens: int
    max_tokens: int
    frontend: str
    delivered: int  # tokens already delivered by earlier attempts
    generated: list[int]  # their ids, to re-prefill when resuming
    claimed_ms: int  # first claim time: queue wait = claimed_ms - enq_ms
    first_ms: int  # when an earlier attempt delivered the first token (0 = none yet)


@dataclass(frozen=True)
class ClaimResult:
    now_ms: int
    requests: list[Claimed]


@dataclass(frozen=True)
class RenewResult:
    lost: list[str]
    stop: list[str]


@dataclass(frozen=True)
class ReapResult:
    expired: int
    requeued: int
    failed: int
    cancelled: int


class Scripts:
    """Typed wrappers around the Lua scripts, bound to one redis-py async client
    (``redis.asyncio.Redis`` or ``RedisCluster``)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._scripts = {name: client.register_script(script_source(name)) for name in SCRIPT_NAMES}

    async def _run(self, name: str, keys: Sequence[str], args: list[Any]) -> Any:
        try:
            return await self._scripts[name](keys=keys, args=args)
        except ResponseError as exc:
            raise _map_error(str(exc)) from exc
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise RedisUnavailable(f"Redis unavailable: {exc}") from exc

    async def load_all(self) -> None:
        """Load every script now (readiness check; also after a Redis restart)."""
        try:
            for s in self._scripts.values():
                s.sha = await self.client.script_load(s.script)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise RedisUnavailable(f"Redis unavailable: {exc}") from exc

    # --- pool setup and control -----------------------------------------------------------
    async def init_pool(self, keys: PoolKeys, policy: dict[str, Any], reset_rates: bool = False) -> int:
        mode = "reset_rates" if reset_rates else "keep_rates"
        return int(await self._run("init_pool", [keys.policy], [json.dumps(policy), mode]))

    async def set_rates(self, keys: PoolKeys, controller_id: str, fence: int, decision: dict[str, Any],
                        fields: dict[str, float]) -> int:
        args: list[Any] = [controller_id, fence, json.dumps(decision, separators=(",", ":"))]
        for f, v in fields.items():
            args += [f, repr(float(v))]
        return int(await self._run("set_rates", [keys.policy, keys.leader, keys.decisions], args))

    async def acquire_leader(self, keys: PoolKeys, controller_id: str, ttl_ms: int) -> tuple[int, str]:
        """Returns (fence, '') when this controller leads, else (0, holder)."""
        fence, who = await self._run("acquire_leader", [keys.leader, keys.fence], [controller_id, ttl_ms])
        return int(fence), ("" if int(fence) else _s(who))

    async def release_leader(self, keys: PoolKeys, controller_id: str, fence: int) -> bool:
        return bool(await self._run("release_leader", [keys.leader], [controller_id, fence]))

    # --- request lifecycle ----------------------------------------------------------------
    async def admit(self, keys: PoolKeys, *, request_id: str, tenant: str, cls: str, input_tokens: int,
                    max_tokens: int, tenant_rate: float, tenant_burst: float, tenant_max_inflight: int,
                    max_wait_ms: int, frontend_id: str, payload: bytes) -> Admitted:
        """Charge and enqueue, or raise Throttled / QueueFull / TenantBusy (nothing charged)."""
        reply = await self._run("admit", lifecycle_keys(keys), [
            request_id, tenant, cls, input_tokens, max_tokens, repr(float(tenant_rate)),
            repr(float(tenant_burst)), tenant_max_inflight, max_wait_ms, frontend_id, payload])
        status = _s(reply[0])
        if status == "queued":
            return Admitted(int(reply[1]), float(_s(reply[2])), bool(int(reply[3])), int(reply[4]))
        if status == "duplicate":
            return Admitted(0, 0.0, False, 0, duplicate_state=_s(reply[1]))
        if status == "throttled":
            return _raise(Throttled(_s(reply[2]), int(reply[1])))
        if status == "queue_full":
            return _raise(QueueFull(cls, int(reply[1])))
        if status == "tenant_busy":
            return _raise(TenantBusy(tenant, int(reply[1])))
        raise ScriptError(f"admit: unexpected reply {reply!r}")

    async def claim(self, keys: PoolKeys, worker_id: str, max_requests: int, token_budget: int = 0,
                    lease_ms: int = 0, above_class: str = "") -> ClaimResult:
        """``above_class``: only claim classes ranked strictly above it ('' = any class)."""
        reply = await self._run("claim", lifecycle_keys(keys), [worker_id, max_requests, token_budget,
                                                              lease_ms, above_class])
        out = []
        for e in reply[1:]:
            out.append(Claimed(
                request_id=_s(e[0]), cls=_s(e[1]), tenant=_s(e[2]), attempt=int(e[3]), payload=bytes(e[4]),
                enq_ms=int(e[5]), input_tokens=int(e[6]), max_tokens=int(e[7]), frontend=_s(e[8]),
                delivered=int(e[9]), generated=unpack_token_ids(bytes(e[10])), claimed_ms=int(e[11]),
                first_ms=int(e[12])))
        return ClaimResult(int(reply[0]), out)

    async def renew_leases(self, keys: PoolKeys, worker_id: str, held: Sequence[tuple[str, int]],
                           lease_ms: int = 0) -> RenewResult:
        if not held:
            return RenewResult([], [])
        args: list[Any] = [worker_id, lease_ms] + [f"{check_name('request id', rid)}:{a}" for rid, a in held]
        lost, stop = await self._run("renew_leases", lifecycle_keys(keys), args)
        return RenewResult([_s(x) for x in lost], [_s(x) for x in stop])

    async def push_tokens(self, keys: PoolKeys, *, request_id: str, worker_id: str, attempt: int,
                          offset: int, token_ids: Sequence[int], text: str, lease_ms: int = 0) -> bool:
        """Deliver tokens; returns True when the client asked to cancel. Raises LeaseLost."""
        reply = await self._run("push_tokens", lifecycle_keys(keys), [
            request_id, worker_id, attempt, offset, len(token_ids), pack_token_ids(token_ids),
            text.encode(), lease_ms])
        if _s(reply[0]) == "lost":
            raise LeaseLost(f"{request_id}: {_s(reply[1])}")
        return bool(int(reply[1]))

    async def complete(self, keys: PoolKeys, *, request_id: str, worker_id: str, attempt: int, outcome: str,
                       usage_in: int, token_ids: Sequence[int] = (), text: str = "",
                       finish_reason: str = "stop", message: str = "", sample: bytes = b"") -> float:
        """Finish a request; returns the refunded cost. Raises LeaseLost."""
        reply = await self._run("complete", lifecycle_keys(keys), [
            request_id, worker_id, attempt, outcome, usage_in, len(token_ids), pack_token_ids(token_ids),
            text.encode(), finish_reason, message, sample])
        if _s(reply[0]) == "lost":
            raise LeaseLost(f"{request_id}: {_s(reply[1])}")
        return float(_s(reply[1]))

    async def release(self, keys: PoolKeys, *, request_id: str, worker_id: str, attempt: int) -> str:
        """Hand a leased request back to its queue (a draining worker); returns 'requeued' or
        'cancelled' (its client is gone). Raises LeaseLost."""
        reply = await self._run("release", lifecycle_keys(keys), [request_id, worker_id, attempt])
        if _s(reply[0]) == "lost":
            raise LeaseLost(f"{request_id}: {_s(reply[1])}")
        return _s(reply[0])

    async def cancel(self, keys: PoolKeys, request_id: str, tenant: str, reason: str = "client_gone") -> str:
        """Returns cancelled | expired | cancelling | running | final:<state> | not_found."""
        reply = await self._run("cancel_request", lifecycle_keys(keys), [request_id, tenant, reason])
        status = _s(reply[0])
        return f"final:{_s(reply[1])}" if status == "final" else status

    async def reap(self, keys: PoolKeys, limit: int = 1000) -> ReapResult:
        e, r, f, c = await self._run("reap_expired", lifecycle_keys(keys), [limit])
        return ReapResult(int(e), int(r), int(f), int(c))


def _raise(exc: Exception) -> Any:
    raise exc


def _map_error(message: str) -> Exception:
    code, _, rest = message.partition(" ")
    if code == "BADARG":
        field = rest.partition(":")[0]
        return InvalidArgument(field.strip(), rest)
    if code == "NOPOLICY":
        m = re.search(r"\{([^}]*)\}", rest)
        return PolicyMissing(m.group(1) if m else rest)
    if code == "STALE":
        return StaleLeader(rest)
    if "LOADING" in message or "BUSY" in message:
        return RedisUnavailable(message)
    return ScriptError(message)
