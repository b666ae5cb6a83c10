"""Every Redis key the system uses is built here, and nowhere else.

All keys of one pool share the hash tag ``{pool}`` so that every Lua script touches a
single slot and runs unchanged on Redis Cluster, while different pools spread over
shards. Per-entity keys (one request, one tenant's bucket, one frontend's reply stream)
are derived inside scripts from the ``*_prefix`` keys below, which carry the same tag.

The layout is part of the operator interface (``redis-cli`` answers "how deep is each
queue, what are the rates, how full are the buckets"); README.md documents it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from limiter.errors import InvalidName

# Names that become part of a key: pools, classes, tenants, workers, frontends,
# request ids. No braces (hash tags), colons (key separators), spaces or globs.
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# A class name is also part of hash fields (<class>.cost, <class>.<state>, <class>:<tenant>,
# next to <class> and the served ledger's .ts): without dots no class's field can be another
# class's (classes 'a' and 'a.cost' once shared the field a.cost).
CLASS_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
ROOT = "qos"
# Consumer group of the controllers on each pool's samples stream (``XINFO GROUPS``). Only
# the leading controller reads through it; see docs/controller.md.
SAMPLES_GROUP = "controller"
SAMPLES_MAXLEN = 100_000  # the samples stream's approximate cap (the scripts use the same)
# The policy hash's msgpack copy of its own fields, which the scripts read instead of them
# (lua/include/policy.lua PACKED_FIELD): binary, so readers of the fields leave it out.
PACKED_POLICY_FIELD = "~packed"


def policy_text(raw: Mapping[Any, Any]) -> dict[str, str]:
    """An ``HGETALL`` of the policy hash as text, field -> value, without the packed copy."""
    out = {}
    for k, v in raw.items():
        field = k.decode() if isinstance(k, bytes) else str(k)
        if field != PACKED_POLICY_FIELD:
            out[field] = v.decode() if isinstance(v, bytes) else str(v)
    return out


def check_name(kind: str, value: object) -> str:
    """Return ``value`` if it is a safe key component (a class name: also a safe hash field),
    else raise :class:`InvalidName`."""
    if kind == "class":
        if not isinstance(value, str) or not CLASS_NAME_RE.fullmatch(value):
            raise InvalidName(kind, f"class name {value!r} must match {CLASS_NAME_RE.pattern} "
                              "(letters, digits, '_', '-')")
        return value
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise InvalidName(
            kind, f"{kind} name {value!r} must match {NAME_RE.pattern} (letters, digits, '_', '.', '-')"
        )
    return value


@dataclass(frozen=True)
class PoolKeys:
    """Key names for one pool (one model deployment)."""

    pool: str

    def __post_init__(self) -> None:
        check_name("pool", self.pool)

    @property
    def base(self) -> str:
        return f"{ROOT}:{{{self.pool}}}:"

    # --- fixed keys -----------------------------------------------------------------
    @property
    def policy(self) -> str:
        """HASH: class order, per-class rate/burst/ceil/weights/caps, capacity, version, and
        ``~packed``, a msgpack copy of those fields (:data:`PACKED_POLICY_FIELD`)."""
        return self.base + "policy"

    @property
    def queued(self) -> str:
        """HASH ``<class>`` -> queued requests, ``<class>.cost`` -> their reserved weighted cost,
        ``<class>:<tenant>`` -> that tenant's share of it."""
        return self.base + "queued"

    @property
    def deadlines(self) -> str:
        """ZSET request id -> max-queue-wait deadline (ms) of queued requests."""
        return self.base + "deadlines"

    @property
    def leases(self) -> str:
        """ZSET request id -> lease deadline (ms) of claimed requests."""
        return self.base + "leases"

    @property
    def cancels(self) -> str:
        """SET of leased request ids whose client went away; workers stop them."""
        return self.base + "cancels"

    @property
    def served(self) -> str:
        """HASH class -> decayed claimed cost, plus ts: the starvation floors' ledger, and the
        measured service rate admission estimates waits from."""
        return self.base + "served"

    @property
    def wake(self) -> str:
        """LIST of wake-up markers that idle workers BLPOP on."""
        return self.base + "wake"

    @property
    def inflight(self) -> str:
        """HASH class -> number of leased requests."""
        return self.base + "inflight"

    @property
    def tenant_inflight(self) -> str:
        """HASH tenant -> number of admitted, unfinished requests."""
        return self.base + "tenant_inflight"

    @property
    def stats(self) -> str:
        """HASH of counters ``<class>.<event>`` (admitted, claimed, expired, ...), plus ``seq``
        (admission order) and ``lease_fence`` (the last lease token claim handed out)."""
        return self.base + "stats"

    @property
    def samples(self) -> str:
        """STREAM of msgpack latency samples, one per finished request (field ``d``); the
        controllers read it through the consumer group :data:`SAMPLES_GROUP`."""
        return self.base + "samples"

    @property
    def decisions(self) -> str:
        """STREAM of controller decisions (JSON), for ``XRANGE``."""
        return self.base + "decisions"

    @property
    def leader(self) -> str:
        """STRING ``<controller id>:<fence>`` with a PX lease: the active controller."""
        return self.base + "leader"

    @property
    def fence(self) -> str:
        """STRING counter: fencing token, incremented on each new leadership."""
        return self.base + "fence"

    @property
    def compliance(self) -> str:
        """HASH class -> SLO compliance (0..1), plus the capacity estimate and its basis in fields
        that start with a dot (``.capacity``, ``.capacity_source``, ...: no class name has a dot,
        so a class named ``capacity`` cannot collide with them), written by the leading
        controller every tick (it expires unless rewritten)."""
        return self.base + "compliance"

    @property
    def frontends(self) -> str:
        """ZSET frontend id -> last heartbeat (ms)."""
        return self.base + "frontends"

    @property
    def outage(self) -> str:
        """STRING: Redis ms of the frontends' last heartbeat before they lost Redis, set by the
        first frontend that beats again (PX 2 x frontend_ttl_ms). While it exists, a frontend
        that was alive then is not taken for dead for being late with its first beat."""
        return self.base + "outage"

    @property
    def workers(self) -> str:
        """ZSET worker id -> last heartbeat (ms)."""
        return self.base + "workers"

    @property
    def worker_kv(self) -> str:
        """HASH worker id -> its whole KV room in tokens (from its claims): a request that no
        live worker can hold is failed instead of waiting for ever."""
        return self.base + "worker_kv"

    # --- prefixes for per-entity keys (scripts append a validated name) --------------
    @property
    def request_prefix(self) -> str:
        return self.base + "req:"

    @property
    def tokens_prefix(self) -> str:
        return self.base + "gen:"

    @property
    def bucket_prefix(self) -> str:
        return self.base + "bucket:"

    @property
    def queue_prefix(self) -> str:
        return self.base + "queue:"

    @property
    def backlog_prefix(self) -> str:
        return self.base + "backlog:"

    @property
    def vtime_prefix(self) -> str:
        return self.base + "vtime:"

    @property
    def reply_prefix(self) -> str:
        return self.base + "out:"

    # --- per-entity keys ----------------------------------------------------------------
    def request(self, request_id: str) -> str:
        """HASH: one request's record (state, class, tenant, costs, lease, timings)."""
        return self.request_prefix + check_name("request id", request_id)

    def tokens(self, request_id: str) -> str:
        """STRING: generated token ids, uint32 little-endian, for resuming a stream."""
        return self.tokens_prefix + check_name("request id", request_id)

    def queue(self, cls: str, tenant: str) -> str:
        """ZSET request id -> admission sequence number (``stats`` ``seq``, not a time): one
        tenant's FIFO in one class. A requeued request keeps its number, so it goes back to
        the head."""
        return self.queue_prefix + check_name("class", cls) + ":" + check_name("tenant", tenant)

    def backlog(self, cls: str) -> str:
        """ZSET tenant -> virtual token counter (in a class with ``fair = false``: the sequence
        number of the tenant's oldest queued request): the tenants of a class with queued
        requests; claim serves the smallest score first (lua/include/queue.lua)."""
        return self.backlog_prefix + check_name("class", cls)

    def vtime(self, cls: str) -> str:
        """HASH tenant -> virtual token counter while the tenant has nothing queued, and
        ``:last``, the counter of the last tenant to go idle."""
        return self.vtime_prefix + check_name("class", cls)

    def class_bucket(self, cls: str) -> str:
        """HASH tokens, ts (+ ledger): a class's guarantee bucket (rate, burst), charged at claim."""
        return self.bucket_prefix + "class:" + check_name("class", cls)

    def ceil_bucket(self, cls: str) -> str:
        """HASH tokens, ts (+ ledger): a class's ceiling bucket (ceil, ceil_burst), charged as
        the class is served while the ceiling binds (below the pool's capacity): a request's
        prompt and some output charged ahead at claim (or, claimed before the ceiling bound, at
        its first renewal since), its output at renewals (lua/include/ceiling.lua)."""
        return self.bucket_prefix + "ceil:" + check_name("class", cls)

    def tenant_bucket(self, tenant: str) -> str:
        """HASH tokens, ts (+ ledger): a tenant's quota bucket in this pool, charged at admission."""
        return self.bucket_prefix + "tenant:" + check_name("tenant", tenant)

    def reply(self, frontend_id: str) -> str:
        """STREAM: token deltas and final results for one frontend process."""
        return self.reply_prefix + check_name("frontend", frontend_id)

    def worker(self, worker_id: str) -> str:
        """HASH: one worker's live stats (batch size, tokens/s, KV use), with a TTL."""
        return self.base + "worker:" + check_name("worker", worker_id)

    def pattern(self) -> str:
        """SCAN pattern matching every key of this pool."""
        return f"{ROOT}:{{{self.pool}}}:*"
