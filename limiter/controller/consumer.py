"""Reading a pool's latency-sample stream through the controllers' consumer group.

Only the *leader* reads (a standby would otherwise take, through the group, samples the
leader's windows need). Entries are acknowledged only after they were fed to the leader's
SLO window, and only while it still leads; so a sample is in exactly one leader's window:

* on becoming leader: first :meth:`replay_own` -- our own pending entries (``XREADGROUP ...
  0``: delivered to an earlier incarnation with the same ``--id`` that died before XACK);
* then :meth:`autoclaim` -- ``XAUTOCLAIM`` of entries another consumer (the dead leader) left
  pending longer than ``claim_idle_ms`` (default: one lease), repeated every ``claim_idle_ms``
  while leading, so entries of a leader that died *just* before are picked up too;
* then :meth:`read_new` -- ``XREADGROUP ... >`` with ``BLOCK``: no busy loop while idle.

A sample that cannot be used (no ``d`` field, undecodable msgpack, missing or negative
fields, unknown class) is counted by its offending field, logged and acknowledged with the
others: it must neither stop the controller nor come back forever, nor skew the window.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import NoPermissionError, ResponseError

from limiter.controller.metrics import ControllerMetrics
from limiter.errors import InvalidArgument
from limiter.keys import SAMPLES_GROUP, PoolKeys
from limiter.samples import Sample, unpack_sample

log = logging.getLogger("qos.controller")
PRUNE_LIMIT = 64  # idle consumers deleted at most per term start (bounded work)
_LOG_EVERY_S = 10.0  # at most one bad-sample log line per this many seconds (a flood must not drown logs)


@dataclass
class Batch:
    """Entries read at once: decoded samples and every id to acknowledge (bad ones included)."""

    samples: list[Sample] = field(default_factory=list)
    sample_ids: list[bytes] = field(default_factory=list)  # the entry id of each sample
    ids: list[bytes] = field(default_factory=list)
    bad: int = 0


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class SampleConsumer:
    def __init__(self, client: Any, keys: PoolKeys, consumer: str, classes: list[str],
                 metrics: ControllerMetrics, batch: int = 500, claim_idle_ms: int = 3000) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.classes = classes
        self.metrics = metrics
        self.batch = batch
        self.claim_idle_ms = claim_idle_ms
        self._last_log = -_LOG_EVERY_S
        self._unlogged = 0

    async def ensure_group(self) -> None:
        """Create the group at the stream's end if missing (history from before the first
        controller ever is not evidence about the current rates); an existing group keeps
        its position, so a restarted fleet resumes where the last leader stopped."""
        try:
            await self.client.xgroup_create(self.keys.samples, SAMPLES_GROUP, id="$", mkstream=True)
            log.info("%s: created consumer group %s", self.keys.samples, SAMPLES_GROUP)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # --- reading ----------------------------------------------------------------------------
    async def read_new(self, block_ms: int) -> Batch:
        reply = await self.client.xreadgroup(SAMPLES_GROUP, self.consumer, {self.keys.samples: ">"},
                                             count=self.batch, block=block_ms)
        return self.decode(_entries(reply))

    async def replay_own(self) -> Batch:
        """Our pending entries (delivered to us before, never acknowledged), oldest first."""
        out, start = Batch(), "0"
        while True:
            reply = await self.client.xreadgroup(SAMPLES_GROUP, self.consumer, {self.keys.samples: start},
                                                 count=self.batch)
            entries = _entries(reply)
            if not entries:
                break
            _merge(out, self.decode(entries))
            start = _s(entries[-1][0])
        if out.ids:
            self.metrics.claimed.labels(self.keys.pool, "replayed").inc(len(out.ids))
            log.info("%s: replayed %d of our own pending samples", self.keys.pool, len(out.ids))
        return out

    async def autoclaim(self) -> Batch:
        """Take over entries other consumers left pending longer than ``claim_idle_ms``."""
        out, cursor = Batch(), "0-0"
        for _ in range(10_000):  # bounded: a PEL cannot outgrow the stream's MAXLEN
            reply = await self.client.xautoclaim(self.keys.samples, SAMPLES_GROUP, self.consumer,
                                                 self.claim_idle_ms, start_id=cursor, count=self.batch)
            cursor = _s(reply[0])
            _merge(out, self.decode(reply[1]))
            if len(reply) > 2 and reply[2]:  # deleted from the stream: XAUTOCLAIM dropped them from the PEL
                log.info("%s: %d pending samples were trimmed before anyone read them", self.keys.pool,
                         len(reply[2]))
            if cursor in ("0-0", "0"):
                break
        if out.ids:
            self.metrics.claimed.labels(self.keys.pool, "autoclaimed").inc(len(out.ids))
            log.info("%s: claimed %d samples another controller left pending", self.keys.pool, len(out.ids))
        return out

    async def prune_consumers(self, limit: int = PRUNE_LIMIT) -> int:
        """Delete up to ``limit`` other consumers of the group that hold no pending entry and
        have been idle longer than ``claim_idle_ms``: each controller process reads under an
        id of its own (``<host>-<pid>`` by default), so every restart added one for good.
        Safe at any time: a consumer is created again by its next read. Returns how many."""
        gone = 0
        try:
            for c in await self.client.xinfo_consumers(self.keys.samples, SAMPLES_GROUP):
                name = _s(c.get("name", c.get(b"name", b"")))
                pending = int(c.get("pending", c.get(b"pending", 0)))
                idle = int(c.get("idle", c.get(b"idle", 0)))
                if gone >= limit or name == self.consumer or pending or idle <= self.claim_idle_ms:
                    continue
                await self.client.xgroup_delconsumer(self.keys.samples, SAMPLES_GROUP, name)
                gone += 1
        except NoPermissionError as exc:
            # An ACL line from before this (docs/reliability.md) lacks XINFO CONSUMERS / XGROUP
            # DELCONSUMER: housekeeping, not a reason to stop reading samples.
            log.warning("%s: cannot remove idle consumers (%s); add +xinfo|consumers "
                        "+xgroup|delconsumer to the qos user's ACL", self.keys.pool, exc)
        if gone:
            log.info("%s: removed %d idle consumers of %s with nothing pending", self.keys.pool, gone,
                     SAMPLES_GROUP)
        return gone

    async def ack(self, ids: list[bytes]) -> None:
        if ids:
            await self.client.xack(self.keys.samples, SAMPLES_GROUP, *ids)

    # --- decoding ---------------------------------------------------------------------------
    def decode(self, entries: list[tuple[bytes, dict[bytes, bytes] | None]]) -> Batch:
        out = Batch()
        for entry_id, fields in entries:
            out.ids.append(entry_id)
            if not fields:  # a pending entry whose data was trimmed away (redis-py: {}): nothing to judge
                continue
            try:
                out.samples.append(self._decode_one(fields))
                out.sample_ids.append(entry_id)
            except InvalidArgument as exc:
                out.bad += 1
                self._bad(entry_id, exc.field, str(exc))
        return out

    def _decode_one(self, fields: dict[bytes, bytes]) -> Sample:
        raw = fields.get(b"d", fields.get("d"))  # type: ignore[call-overload]
        if raw is None:
            raise InvalidArgument("d", "entry has no 'd' field")
        return unpack_sample(raw, self.classes)

    def _bad(self, entry_id: bytes, what: str, message: str) -> None:
        self.metrics.bad_samples.labels(self.keys.pool, what).inc()
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            more = f" ({self._unlogged} more since the last report)" if self._unlogged else ""
            log.warning("%s: bad sample %s skipped and acknowledged: %s%s", self.keys.pool, _s(entry_id),
                        message, more)
            self._last_log, self._unlogged = now, 0
        else:
            self._unlogged += 1


def _entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
    """The entries of an XREADGROUP reply on one stream (RESP2 list or RESP3 dict)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [e for v in reply.values() for e in (v[0] if v and isinstance(v[0], list) else v)]
    return [e for _stream, entries in reply for e in entries]


def _merge(into: Batch, other: Batch) -> None:
    into.samples += other.samples
    into.sample_ids += other.sample_ids
    into.ids += other.ids
    into.bad += other.bad
