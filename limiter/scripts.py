"""The script registry: loads ``lua/*.lua`` once and exposes typed async wrappers.

Each wrapper is one EVALSHA (a script Redis lost, e.g. after a restart, is loaded again
and called once more). The calls made during one turn of the event loop travel in one
pipeline (:mod:`limiter.script_batcher`). Script replies become dataclasses; error replies
become exceptions from :mod:`limiter.errors`.
"""

from __future__ import annotations

import contextlib
import json
import re
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, ResponseError

from limiter.config import PoolConfig, QosConfig
from limiter.errors import (
    InvalidArgument,
    LeaseLost,
    Overloaded,
    PolicyMissing,
    QueueFull,
    RedisUnavailable,
    ScriptError,
    StaleLeader,
    TenantBusy,
    Throttled,
)
from limiter.keys import PoolKeys, check_name
from limiter.redis_conn import (
    CONNECTION_ERRORS,
    cluster_misconfigured,
    map_redis_errors,
    shard_of,
    store_refused,
)
from limiter.script_batcher import ScriptBatcher

SCRIPT_NAMES = (
    "admit", "claim", "renew_leases", "push_tokens", "complete", "cancel_request",
    "reap_expired", "init_pool", "set_rates", "acquire_leader", "release_leader", "release",
    "publish_compliance",
)
_INCLUDE = re.compile(r"^--!include (\S+)\s*$", re.MULTILINE)
_FLAGS = re.compile(r"^--!flags (\S+)\s*$", re.MULTILINE)
# A helper: from a top-level `local function name(` to the first `end` at column 0 (the
# layout every file keeps; tests/test_lua_layout.py checks it).
_TOP_FUNCTION = re.compile(r"^local function (\w+)\(.*?^end\n", re.MULTILINE | re.DOTALL)
_WORD = re.compile(r"\w+")
# What a script may do under Redis 7's `#!lua` flags: scripts that only move requests to a
# final state may run when Redis is out of memory (they free it); none may touch another slot.
KNOWN_FLAGS = ("allow-oom",)
REAP_LIMIT = 16  # reap_expired's most entries of each kind per call (bounded work)
PUSH_KEYS = 4  # push_tokens' keys: the head of the lifecycle key list (lua/include/pool_keys.lua)
PUSH_LIMIT = 64  # push_tokens' most requests per call (bounded work; lua/push_tokens.lua)
CLAIM_LIMIT = 1024  # claim's most requests per call (lua/claim.lua)
RENEW_LIMIT = 4096  # renew_leases' most entries per call (lua/renew_leases.lua)
MESSAGE_LIMIT = 4096  # complete's most bytes of a finish message (lua/complete.lua)
# Scripts that take several calls' arguments in one call: the batcher merges such calls of
# one event-loop turn, up to this many a call. lua/admit.lua takes up to ADMIT_LIMIT requests
# (12 arguments each), lua/complete.lua up to COMPLETE_LIMIT (13 each); merged, at most 16:
# a script holds the whole shard while it runs, and 16 admits are 1-4 ms on this project's
# machine (a call of one request's fixed part, ~25 us, is 94 % paid off at 16 already).
ADMIT_LIMIT = 64
ADMIT_MERGE = 16
COMPLETE_LIMIT = 64
COMPLETE_MERGE = 16
MERGE_LIMITS = {"admit": ADMIT_MERGE, "complete": COMPLETE_MERGE}
MAX_PAYLOAD_BYTES = 8 << 20  # admit.lua's most bytes of a request's packed payload


def lua_dir() -> Path:
    """The installed copy (``limiter/lua`` in the wheel) or the source tree's ``lua/``."""
    installed = Path(str(resources.files("limiter"))) / "lua"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parent.parent / "lua"


def _resolve(name: str, text: str, include_dir: Path, done: list[str], stack: list[str]) -> str:
    """``text`` with each ``--!include f`` replaced by ``f`` (itself resolved first, depth
    first), every file once per script (``done``: the files already pasted), so each helper
    comes before its first user. ``stack`` is the chain being resolved: an include of a file
    on it is a cycle, refused with the chain named."""

    def expand(m: re.Match[str]) -> str:
        inc = m.group(1)
        if inc in stack:
            raise ScriptError(f"lua include cycle: {' -> '.join([*stack, inc])}")
        if inc in done:
            return ""
        path = include_dir / inc
        if not path.is_file():
            raise ScriptError(f"{name}: --!include {inc}: no such file in {include_dir}")
        body = _resolve(inc, path.read_text(), include_dir, done, [*stack, inc])
        done.append(inc)
        return body

    return _INCLUDE.sub(expand, text)


def load_script(name: str, directory: Path, shebang: bool = True) -> str:
    """The script ``directory/name.lua`` as Redis runs it: its includes (from
    ``directory/include``) resolved recursively, each helper file naming what it needs, and,
    for servers that support it (Redis >= 7), a ``#!lua`` first line with the script's
    ``--!flags``. With a shebang Redis refuses, in a cluster, any key outside the slot of the
    declared keys: a lost hash tag fails at once, not after a reshard."""
    text = (directory / f"{name}.lua").read_text()
    flags = [f for m in _FLAGS.finditer(text) for f in m.group(1).split(",")]
    for f in flags:
        if f not in KNOWN_FLAGS:
            raise ScriptError(f"{name}.lua: unknown --!flags value {f!r} (known: {', '.join(KNOWN_FLAGS)})")
    body = drop_unused_helpers(_resolve(name, text, directory / "include", [], [name]))
    if not shebang:
        return body
    return ("#!lua flags=" + ",".join(flags) if flags else "#!lua") + "\n" + body


def drop_unused_helpers(body: str) -> str:
    """``body`` without the top-level helpers nothing else in it names (and then those only
    they named, and so on). An include brings all of a file's helpers, and EVALSHA runs the
    whole script body on every call: each helper is a closure made anew each time. Measured
    (issue 17): admit's ~38 helpers cost ~5 us a call of Redis time, ~2 us of it the unused
    ones. A name is kept when it appears anywhere else, a comment included (a mention keeps
    a helper: the rule only ever keeps too much)."""
    while True:
        uses = Counter(_WORD.findall(body))
        unused = [m for m in _TOP_FUNCTION.finditer(body) if uses[m.group(1)] == 1]
        if not unused:
            return body
        for m in reversed(unused):
            body = body[:m.start()] + body[m.end():]


@cache
def script_source(name: str, shebang: bool = True) -> str:
    """The installed script ``name`` as Redis runs it (:func:`load_script`), read once."""
    return load_script(name, lua_dir(), shebang)


@cache
def lifecycle_keys(keys: PoolKeys) -> tuple[str, ...]:
    """The fixed KEYS list of every request-lifecycle script (lua/include/pool_keys.lua).

    Cached per pool: it is on every hot path and never changes."""
    return (
        keys.policy, keys.request_prefix, keys.tokens_prefix, keys.reply_prefix,  # push_keys: these
        keys.queued, keys.deadlines, keys.leases, keys.cancels, keys.served,
        keys.wake, keys.inflight, keys.tenant_inflight, keys.stats, keys.samples, keys.frontends,
        keys.outage, keys.workers, keys.worker_kv,
        keys.bucket_prefix, keys.queue_prefix, keys.backlog_prefix, keys.vtime_prefix,
    )


@cache
def push_keys(keys: PoolKeys) -> tuple[str, ...]:
    """The head of :func:`lifecycle_keys` that ``push_tokens`` uses (policy, request, token and
    reply prefixes), all it is passed: every key a call carries costs Redis ~1k instructions,
    and a worker pushes every few steps."""
    return lifecycle_keys(keys)[:PUSH_KEYS]


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
            "fair": 1 if c.fair else 0,
        })
    return {
        "pool": pool.name, "capacity": cap,
        "lease_ms": pool.lease_ms, "max_attempts": pool.max_attempts,
        "frontend_ttl_ms": pool.frontend_ttl_ms, "floor_half_life_ms": pool.floor_half_life_ms,
        "record_ttl_s": pool.record_ttl_s, "floor_quantum": pool.floor_quantum_tokens,
        "ceil_ahead": pool.ceiling_ahead_tokens, "classes": classes,
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
    est_wait_ms: int  # admit's estimate of the wait before a worker takes it
    deadline_ms: int
    duplicate_state: str | None = None  # set when the id had been admitted before


@dataclass(frozen=True)
class Claimed:
    request_id: str
    cls: str
    tenant: str
    fence: int  # this lease's token: every write for the request carries it; never repeats
    payload: bytes
    enq_ms: int
    input_tokens: int
    max_tokens: int
    frontend: str
    delivered: int  # tokens already delivered by earlier attempts
    generated: list[int]  # their ids, to re-prefill when resuming
    claimed_ms: int  # first claim time: queue wait = claimed_ms - enq_ms
    first_ms: int  # when an earlier attempt delivered the first token (0 = none yet)
    attempt: int = 1  # 1 for the first claim, counting lease expiries (bounded by max_attempts)
    # claim picked it by its class's starvation floor (tier 1): the worker keeps its slot
    by_floor: bool = False


@dataclass(frozen=True)
class ClaimResult:
    now_ms: int
    requests: list[Claimed]
    # Requests were still queued after the call (claim announced them again): an empty
    # claim with a backlog must back off, one without only consumed a stale wake marker.
    backlog: bool = False


@dataclass(frozen=True)
class TokenBatch:
    """One request's share of a ``push_tokens`` call: ``count`` model tokens after the
    ``offset`` already delivered; ``token_ids`` are what a resuming worker primes itself with
    (one per token for the step engines; the openai engine: the text's bytes)."""

    request_id: str
    fence: int
    offset: int
    token_ids: Sequence[int]
    text: str
    count: int


@dataclass(frozen=True)
class Pushed:
    """What ``push_tokens`` answered for one request: ``status`` 'ok' (delivered), 'lost' (not
    leased to this worker with this fence), 'offset' (nothing written: Redis had ``delivered``
    tokens, not the batch's offset -- an earlier push whose reply was lost did land) or
    'max_tokens' (nothing written: the batch would take the request past the ``max_tokens``
    its record allows). Whether its client cancelled is not in it: the worker asks
    :meth:`~worker.runtime.WorkerRuntime.cancelled` for everything it holds (one
    ``SMISMEMBER`` every ``flush_ms``), and ``renew_leases`` reports it too."""

    status: str
    delivered: int = 0
    max_tokens: int = 0


_PUSHED = Pushed("ok")  # the reply of most requests of most pushes: made once


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
    full: bool = False  # a sweep read the call's limit of entries (stale ones too): there may be more


class Scripts:
    """Typed wrappers around the Lua scripts, bound to one redis-py async client
    (``redis.asyncio.Redis`` or ``RedisCluster``).

    Scripts carry a ``#!lua`` line (Redis >= 7). A server that cannot parse it (an older
    Redis, or the embedded fakeredis of ``qos up``) gets the same scripts without it: the
    first compile error of that kind switches this registry over, once. ``lua``: load the
    scripts from this directory instead of the installed ones (a benchmark comparing two
    versions of the Lua layer).

    The calls made in one event-loop turn share one pipeline, and the admits of one pool
    among them are one call (:mod:`limiter.script_batcher`); ``merge=False`` sends each admit
    as a call of its own in that pipeline (a benchmark's comparison), ``batch=False`` each
    call on its own."""

    def __init__(self, client: Any, shebang: bool = True, lua: Path | None = None,
                 batch: bool = True, merge: bool = True) -> None:
        self.client = client
        self.lua = lua
        self.batcher = ScriptBatcher(client) if batch else None
        # Another version's script (given with ``lua``) may take one request a call (admit.lua
        # before 2026-12-03, complete.lua before 2026-12-04): merged, the first request would
        # be served and every other caller told no.
        self.merge_limits = {name: limit for name, limit in MERGE_LIMITS.items()
                             if merge and (lua is None or "MAX_ITEMS" in (lua / f"{name}.lua").read_text())}
        self._register(shebang)

    def _register(self, shebang: bool) -> None:
        self.shebang = shebang
        self._scripts = {name: self.client.register_script(
            load_script(name, self.lua, shebang) if self.lua else script_source(name, shebang))
            for name in SCRIPT_NAMES}

    def _no_shebang_support(self, exc: ResponseError, shebang: bool | None = None) -> bool:
        """``exc`` is a server refusing the ``#!lua`` line of a script sent with one
        (``shebang``: whether the call's script had it; default: this registry's now)."""
        return (self.shebang if shebang is None else shebang) and "near '#'" in str(exc)

    async def _call(self, name: str, keys: Sequence[str], args: list[Any]) -> Any:
        script = self._scripts[name]
        try:
            if self.batcher is not None:
                return await self.batcher.evalsha(script.sha, keys, args, self.merge_limits.get(name, 0))
            return await self.client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            # Redis lost its script cache (a restart): loaded again where the keys live
            await self._load(script.script, keys[0] if keys else None)
        try:
            return await self.client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            # A cluster's slot migrating (a reshard): the key was redirected (ASK) to the
            # importing node, which never ran the script, and the slot map still names the
            # source, where the load above went (every tick of a reshard failed here). The
            # importing node is one of the primaries the client knows when it already serves
            # slots; a node added with none is not in redis-py's map, and its ASK handling
            # (8.2) fails before any NOSCRIPT (redis-py #4015). Not EVAL: the ACL has none.
            if not await self._load_on_every_primary(script.script):
                raise
            return await self.client.evalsha(script.sha, len(keys), *keys, *args)

    async def _load_on_every_primary(self, source: str) -> bool:
        """SCRIPT LOAD on each primary of a cluster that answers (one out of reach must not
        fail the pools of the others); False for a single server."""
        if not isinstance(self.client, RedisCluster):
            return False
        for node in self.client.get_primaries():
            with contextlib.suppress(ResponseError, *CONNECTION_ERRORS):
                await self.client.execute_command("SCRIPT LOAD", source, target_nodes=node)
        return True

    async def _server(self, key: str | None) -> dict[str, Any]:
        """The keyword that sends a keyless command to the server holding ``key``: on a
        cluster, its shard only (redis-py sends SCRIPT LOAD to every primary, and one primary
        out of reach, a shard down, failed the load for the pools on the others); else none."""
        node = await shard_of(self.client, key) if key is not None else None
        return {} if node is None else {"target_nodes": node}

    async def _load(self, source: str, key: str | None) -> str:
        """SCRIPT LOAD on the server holding ``key``; the script's SHA1."""
        sha = await self.client.execute_command("SCRIPT LOAD", source, **await self._server(key))
        return sha.decode() if isinstance(sha, bytes) else str(sha)

    def shas(self) -> list[str]:
        """The SHA1s the server knows this registry's scripts by (with or without ``#!lua``)."""
        return [s.sha for s in self._scripts.values()]

    async def _run(self, name: str, keys: Sequence[str], args: list[Any]) -> Any:
        with map_redis_errors():
            try:
                shebang = self.shebang
                try:
                    return await self._call(name, keys, args)
                except ResponseError as exc:
                    # Calls sent together all meet the refusal: the first switches the
                    # registry over, and each sends its own call again without the line.
                    if not self._no_shebang_support(exc, shebang):
                        raise
                    if self.shebang:
                        self._register(False)
                    return await self._call(name, keys, args)
            except ResponseError as exc:
                if isinstance(exc, CONNECTION_ERRORS):  # CLUSTERDOWN, TRYAGAIN: an outage
                    raise
                if (wrong := cluster_misconfigured(exc)) is not None:
                    raise wrong from exc
                if store_refused(exc):
                    # At maxmemory (noeviction) Redis refuses the scripts without allow-oom, a
                    # server a failover made a replica refuses every write, one short of its
                    # min-replicas-to-write too: nothing ran, and it is the store's state, not
                    # the request's. An outage (503), not a bug (500).
                    raise RedisUnavailable(f"Redis refused the script: {exc}") from exc
                raise _map_error(str(exc)) from exc

    async def load_all(self, keys: PoolKeys | None = None) -> None:
        """Load every script now (a process's start, a readiness check, after a Redis
        restart). ``keys``: on the server holding that pool only (on a cluster, its shard:
        a pool's role must start while another pool's shard is down)."""
        key = keys.policy if keys is not None else None
        with map_redis_errors():
            try:
                if self.shebang:  # SCRIPT LOAD does not always compile: run a probe once
                    try:  # (EVALSHA, not EVAL: the documented ACL user may not run EVAL)
                        probe = await self._load("#!lua\nreturn 1", key)
                        await self.client.execute_command("EVALSHA", probe, 0, **await self._server(key))
                    except ResponseError as exc:
                        if self._no_shebang_support(exc):
                            self._register(False)
                for s in self._scripts.values():
                    try:
                        s.sha = await self._load(s.script, key)
                    except ResponseError as exc:
                        if not self._no_shebang_support(exc):
                            raise
                        self._register(False)
                        return await self.load_all(keys)
            except ResponseError as exc:
                if isinstance(exc, CONNECTION_ERRORS):
                    raise
                raise _map_error(str(exc)) from exc

    # --- pool setup and control -----------------------------------------------------------
    async def init_pool(self, keys: PoolKeys, policy: dict[str, Any], reset_rates: bool = False) -> int:
        mode = "reset_rates" if reset_rates else "keep_rates"
        return int(await self._run("init_pool", lifecycle_keys(keys), [json.dumps(policy), mode]))

    async def set_rates(self, keys: PoolKeys, controller_id: str, fence: int, decision: dict[str, Any],
                        fields: dict[str, float]) -> int:
        args: list[Any] = [controller_id, fence, json.dumps(decision, separators=(",", ":"))]
        for f, v in fields.items():
            args += [f, repr(float(v))]
        return int(await self._run("set_rates", [keys.policy, keys.leader, keys.decisions], args))

    async def publish_compliance(self, keys: PoolKeys, ttl_ms: int,
                                 fields: dict[str, str | float | int]) -> int:
        """Replace the pool's compliance hash (``fields``, lua/publish_compliance.lua) and its
        expiry in one call."""
        args: list[Any] = [ttl_ms]
        for f, v in fields.items():
            args += [f, repr(float(v)) if isinstance(v, float) else v]
        return int(await self._run("publish_compliance", [keys.compliance], args))

    async def acquire_leader(self, keys: PoolKeys, controller_id: str, ttl_ms: int) -> tuple[int, str]:
        """Returns (fence, '') when this controller leads, else (0, holder)."""
        fence, holder, _taken = await self.take_leader(keys, controller_id, ttl_ms)
        return fence, holder

    async def take_leader(self, keys: PoolKeys, controller_id: str, ttl_ms: int) -> tuple[int, str, bool]:
        """:meth:`acquire_leader`, and whether the lease was taken anew rather than renewed: a
        new leadership even when its fence repeats an earlier one (Redis lost the counter)."""
        fence, who = await self._run("acquire_leader", [keys.leader, keys.fence], [controller_id, ttl_ms])
        fence = int(fence)
        return fence, ("" if fence else _s(who)), bool(fence) and int(who) == 2

    async def release_leader(self, keys: PoolKeys, controller_id: str, fence: int) -> bool:
        return bool(await self._run("release_leader", [keys.leader], [controller_id, fence]))

    # --- request lifecycle ----------------------------------------------------------------
    async def admit(self, keys: PoolKeys, *, request_id: str, tenant: str, cls: str, input_tokens: int,
                    max_tokens: int, tenant_rate: float, tenant_burst: float, tenant_max_inflight: int,
                    max_wait_ms: int, frontend_id: str, payload: bytes,
                    tenant_weight: float = 1.0) -> Admitted:
        """Queue a request, or raise Throttled / Overloaded / QueueFull / TenantBusy (nothing
        charged or queued)."""
        reply = await self._run("admit", lifecycle_keys(keys), [
            request_id, tenant, cls, input_tokens, max_tokens, repr(float(tenant_rate)),
            repr(float(tenant_burst)), tenant_max_inflight, max_wait_ms, frontend_id, payload,
            repr(float(tenant_weight))])
        status = _s(reply[0])
        if status == "queued":
            return Admitted(int(reply[1]), float(_s(reply[2])), int(reply[3]), int(reply[4]))
        if status == "duplicate":
            return Admitted(0, 0.0, 0, 0, duplicate_state=_s(reply[1]))
        if status == "throttled":
            return _raise(Throttled(_s(reply[2]), int(reply[1]), cls))
        if status == "overloaded":
            return _raise(Overloaded(cls, int(reply[1]), int(reply[2]), int(reply[3])))
        if status == "queue_full":
            return _raise(QueueFull(cls, int(reply[1])))
        if status == "tenant_busy":
            return _raise(TenantBusy(tenant, int(reply[1])))
        raise ScriptError(f"admit: unexpected reply {reply!r}")

    async def claim(self, keys: PoolKeys, worker_id: str, max_requests: int, kv_room: int = 0,
                    lease_ms: int = 0, above_class: str = "", kv_total: int = 0,
                    avoid_tenants: Sequence[str] = (), avoid_from: str = "") -> ClaimResult:
        """Claim up to ``max_requests`` that fit ``kv_room`` free KV tokens (0 = no limit).
        ``above_class``: only classes ranked strictly above it ('' = any class); ``kv_total``:
        the worker's whole KV room (0 = unknown), so a request no live worker can hold fails;
        ``avoid_tenants``: at most 16 tenants whose requests are skipped in class
        ``avoid_from`` and below. At most :data:`CLAIM_LIMIT` a call: a worker with more room
        (an openai worker's max_inflight may be up to 100,000) claims the rest next time."""
        max_requests = min(max_requests, CLAIM_LIMIT)
        avoid = ",".join(check_name("tenant", t) for t in avoid_tenants)
        reply = await self._run("claim", lifecycle_keys(keys), [worker_id, max_requests, kv_room, lease_ms,
                                                              above_class, kv_total, avoid, avoid_from])
        out = []
        for e in reply[2:]:
            out.append(Claimed(
                request_id=_s(e[0]), cls=_s(e[1]), tenant=_s(e[2]), fence=int(e[3]), payload=bytes(e[4]),
                enq_ms=int(e[5]), input_tokens=int(e[6]), max_tokens=int(e[7]), frontend=_s(e[8]),
                delivered=int(e[9]), generated=unpack_token_ids(bytes(e[10])), claimed_ms=int(e[11]),
                first_ms=int(e[12]), attempt=int(e[13]), by_floor=len(e) > 14 and int(e[14]) == 1))
        return ClaimResult(int(reply[0]), out, bool(int(reply[1])))

    async def renew_leases(self, keys: PoolKeys, worker_id: str, held: Sequence[tuple[str, int]],
                           lease_ms: int = 0) -> RenewResult:
        """``held``: (request id, fence) of every request the worker runs (in calls of at most
        :data:`RENEW_LIMIT`: an openai worker may hold up to max_inflight, <= 100,000)."""
        entries = [f"{check_name('request id', rid)}:{f}" for rid, f in held]
        out = RenewResult([], [])
        for i in range(0, len(entries), RENEW_LIMIT):
            args: list[Any] = [worker_id, lease_ms, *entries[i:i + RENEW_LIMIT]]
            lost, stop = await self._run("renew_leases", lifecycle_keys(keys), args)
            out.lost.extend(_s(x) for x in lost)
            out.stop.extend(_s(x) for x in stop)
        return out

    async def push_tokens_many(self, keys: PoolKeys, worker_id: str, batches: Sequence[TokenBatch],
                               lease_ms: int = 0, *, grouped: bool = False) -> list[Pushed]:
        """Deliver tokens of up to :data:`PUSH_LIMIT` requests in one call (one reply per
        batch, in order). Raises InvalidArgument for an argument of any of them (nothing
        written for any); one request's state (lost, offset, max_tokens) is its reply.

        ``grouped``: every request's frontend reads grouped entries (its payload's
        ``grouped_tokens``): one reply-stream entry per frontend for the call, not one per
        request (lua/push_tokens.lua)."""
        if not batches:
            return []
        if len(batches) > PUSH_LIMIT:
            raise InvalidArgument("batches", f"{len(batches)} requests, at most {PUSH_LIMIT} per call")
        args: list[Any] = [worker_id, lease_ms, len(batches), int(grouped)]
        for b in batches:
            # n_ids '' = one id per token (the step engines): one number less for the script to check
            n_ids = "" if len(b.token_ids) == b.count else len(b.token_ids)
            args += [b.request_id, b.fence, b.offset, b.count, pack_token_ids(b.token_ids), b.text.encode(),
                     n_ids]
        replies = await self._run("push_tokens", push_keys(keys), args)
        out = []
        for r in replies:
            if not isinstance(r, list):  # delivered: the one reply that is not a table
                if _s(r) != "ok":
                    raise ScriptError(f"push_tokens: unexpected reply {r!r}")
                out.append(_PUSHED)
                continue
            status = _s(r[0])
            if status == "offset":
                out.append(Pushed("offset", delivered=int(r[1])))
            elif status == "lost":
                out.append(Pushed("lost"))
            elif status == "max_tokens":
                out.append(Pushed("max_tokens", max_tokens=int(r[1])))
            else:
                raise ScriptError(f"push_tokens: unexpected reply {r!r}")
        return out

    async def push_tokens(self, keys: PoolKeys, *, request_id: str, worker_id: str, fence: int,
                          offset: int, token_ids: Sequence[int], text: str, lease_ms: int = 0,
                          count: int | None = None, grouped: bool = False) -> None:
        """Deliver tokens of one request. Raises LeaseLost, InvalidArgument 'offset' when Redis
        has another token count, and InvalidArgument 'count' when the batch is past the
        request's max_tokens.

        ``count`` is the model tokens in the batch (default: one per id); ``token_ids`` are
        what a resuming worker primes itself with (the openai engine: the text's bytes)."""
        n = len(token_ids) if count is None else count
        (r,) = await self.push_tokens_many(keys, worker_id, [TokenBatch(request_id, fence, offset, token_ids,
                                                                        text, n)], lease_ms,
                                             grouped=grouped)
        if r.status == "lost":
            raise LeaseLost(f"{request_id}: request is not leased to this worker with this fence")
        if r.status == "offset":
            raise InvalidArgument("offset", f"{offset} but {r.delivered} tokens were delivered")
        if r.status == "max_tokens":
            raise InvalidArgument("count", f"{request_id}: {offset + n} tokens exceed max_tokens "
                                           f"{r.max_tokens}")

    async def complete(self, keys: PoolKeys, *, request_id: str, worker_id: str, fence: int, outcome: str,
                       usage_in: int, token_ids: Sequence[int] = (), text: str = "",
                       finish_reason: str = "stop", message: str = "", sample: bytes = b"",
                       count: int | None = None, offset: int | None = None) -> float:
        """Finish a request; returns the unused reservation it gives back. Raises LeaseLost.
        ``count``: the last batch's model tokens (default: one per id, as in push_tokens).
        ``offset``: the tokens delivered before this batch, checked (InvalidArgument 'offset'
        on a mismatch: an earlier push whose reply was lost did land). ``message`` is cut to
        the :data:`MESSAGE_LIMIT` bytes complete takes, at a character's boundary."""
        n = len(token_ids) if count is None else count
        cut = message.encode(errors="replace")[:MESSAGE_LIMIT].decode(errors="ignore")
        reply = await self._run("complete", lifecycle_keys(keys), [
            request_id, worker_id, fence, outcome, usage_in, n, pack_token_ids(token_ids),
            text.encode(), finish_reason, cut, sample, len(token_ids), "" if offset is None else offset])
        if _s(reply[0]) == "lost":
            raise LeaseLost(f"{request_id}: {_s(reply[1])}")
        return float(_s(reply[1]))

    async def release(self, keys: PoolKeys, *, request_id: str, worker_id: str, fence: int,
                      spent: bool = False) -> str:
        """Hand a leased request back to its queue (a draining worker); returns 'requeued',
        'cancelled' (its client is gone) or 'failed' (its class is no longer configured, or
        ``spent`` -- the attempt counts: the model server broke on it -- was its last).
        Raises LeaseLost."""
        reply = await self._run("release", lifecycle_keys(keys), [request_id, worker_id, fence,
                                                                  "1" if spent else "0"])
        if _s(reply[0]) == "lost":
            raise LeaseLost(f"{request_id}: {_s(reply[1])}")
        return _s(reply[0])

    async def cancel(self, keys: PoolKeys, request_id: str, tenant: str, reason: str = "client_gone") -> str:
        """Returns cancelled | expired | cancelling | running | final:<state> | not_found."""
        reply = await self._run("cancel_request", lifecycle_keys(keys), [request_id, tenant, reason])
        status = _s(reply[0])
        return f"final:{_s(reply[1])}" if status == "final" else status

    async def reap(self, keys: PoolKeys, limit: int = REAP_LIMIT) -> ReapResult:
        """One bounded janitor pass (at most ``limit`` <= 16 entries of each kind)."""
        e, r, f, c, more = (int(x) for x in await self._run("reap_expired", lifecycle_keys(keys), [limit]))
        return ReapResult(e, r, f, c, full=bool(more))

    async def reap_all(self, keys: PoolKeys, max_calls: int = 50) -> ReapResult:
        """Janitor passes until one comes back short (at most ``max_calls``): each call is
        bounded, and Redis serves others between them."""
        e = r = f = c = 0
        for _ in range(max_calls):
            res = await self.reap(keys)
            e, r, f, c = e + res.expired, r + res.requeued, f + res.failed, c + res.cancelled
            if not res.full:
                return ReapResult(e, r, f, c)
        return ReapResult(e, r, f, c, full=True)


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
