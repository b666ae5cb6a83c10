"""Reply delivery and liveness: the per-pool reply-stream reader and the heartbeat.

Workers' scripts append every token batch and final result to ONE stream per (pool,
frontend process), ``keys.reply(frontend_id)``. :class:`ReplyRouter` runs one blocking
``XREAD`` loop per pool and hands each entry to the asyncio queue of the request named by
its ``id`` field, so a frontend holds O(1) Redis connections however many requests are in
flight, and an idle frontend costs Redis nothing but a parked XREAD.

:class:`Heartbeat` proves the process alive (``ZADD keys.frontends {id: now_ms}`` per
pool; claim and the lease reaper cancel the requests of a frontend silent for the pool's
``frontend_ttl_ms``), measures the offset to Redis' clock (deadlines are Redis time),
samples the ``<class>.claimed`` counters to estimate each class's service rate (for an
honest 503 ``Retry-After``), and trims reply-stream entries already read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from limiter.backoff import Backoff
from limiter.frontend.metrics import FrontendMetrics
from limiter.heartbeats import prune_stale
from limiter.keys import PoolKeys
from limiter.redis_conn import redis_now_ms

log = logging.getLogger("qos.frontend.replies")
# A reply stream's TTL, as the scripts set it on every entry (lua/include/pool_keys.lua).
REPLY_TTL_S = 600
# A reply stream's cap, as the scripts' XADD MAXLEN ~ sets it (lua/include/pool_keys.lua): a
# stream trimmed by it holds at least this many entries (`~` never trims below it).
REPLY_MAXLEN = 100_000
REPLY_BLOCK_MS = 2000  # a reply reader's XREAD BLOCK: how long an idle read waits


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _i(v: Any) -> int:
    try:
        return int(_s(v))
    except ValueError:
        return 0


@dataclass(frozen=True)
class Reply:
    """One reply-stream entry (see lua/include/notify.lua ``notify``).

    kind ``tok``: offset = tokens delivered before this batch, count, text.
    kind ``done``: the last batch (offset, count, text) plus finish reason and usage.
    kind ``err``: code ``expired`` | ``failed`` and a message."""

    kind: str
    offset: int = 0
    count: int = 0
    text: str = ""
    attempt: int = 0
    finish: str = ""
    usage_in: int = 0
    usage_out: int = 0
    code: str = ""
    message: str = ""

    @classmethod
    def parse(cls, f: dict[Any, Any]) -> Reply:
        g: dict[str, Any] = {_s(k): v for k, v in f.items()}
        return cls(kind=_s(g.get("k", "")), offset=_i(g.get("o", 0)), count=_i(g.get("n", 0)),
                   text=_s(g.get("t", b"")), attempt=_i(g.get("a", 0)), finish=_s(g.get("fin", "")),
                   usage_in=_i(g.get("in", 0)), usage_out=_i(g.get("out", 0)), code=_s(g.get("code", "")),
                   message=_s(g.get("msg", "")))


def replies_of(fields: dict[Any, Any]) -> list[tuple[str, Reply]]:
    """The (request id, reply) pairs of one reply-stream entry: one for an entry of its own
    (notify), one per request for a grouped entry (kind ``toks``: a push's token batches for
    this frontend's requests, each id -> ``fence offset count text``; lua/include/notify.lua
    notify_grouped). Raises ValueError for a grouped value that is not of that shape."""
    kind = fields.get(b"k", fields.get("k"))
    if kind not in (b"toks", "toks"):
        return [(_s(fields.get(b"id", fields.get("id", b""))), Reply.parse(fields))]
    out = []
    for k, v in fields.items():
        rid = _s(k)
        if rid == "k":
            continue
        a, o, n, t = (v if isinstance(v, bytes) else str(v).encode()).split(b" ", 3)
        out.append((rid, Reply("tok", offset=int(o), count=int(n), text=t.decode("utf-8", "replace"),
                               attempt=int(a))))
    return out


def dedup(r: Reply, forwarded: int) -> tuple[str, int]:
    """(text to forward, tokens forwarded after it) for entry ``r``.

    Entries carry token offsets; a worker resuming a stream (a new attempt) may replay
    tokens already sent. Anything whose ``offset + count`` is within what was forwarded
    is dropped, so the client never sees a token twice."""
    if r.count == 0:
        return r.text, forwarded
    if r.offset + r.count <= forwarded:
        return "", forwarded
    return r.text, r.offset + r.count


READ_COUNT = 1000  # reply-stream entries one XREAD takes at most
# The code of the error a request gets when reply entries of its may have been trimmed unread.
REPLIES_LOST = "replies_lost"


def _entries(resp: Any) -> Iterable[tuple[Any, dict[Any, Any]]]:
    """XREAD's reply as (entry id, fields), for RESP2 (list) and RESP3 (dict) clients."""
    if not resp:
        return
    streams = resp.items() if isinstance(resp, dict) else resp
    for item in streams:
        entries = item[1]
        if entries and isinstance(entries[0], list | tuple) and len(entries) == 1 and isinstance(
                entries[0][0], list | tuple):
            entries = entries[0]  # RESP3 nests one level deeper
        yield from entries


class ReplyRouter:
    """Demultiplexes each pool's reply stream to per-request queues."""

    def __init__(self, client: Any, pools: Iterable[PoolKeys], frontend_id: str, metrics: FrontendMetrics,
                 block_ms: int = REPLY_BLOCK_MS, reader: Any = None) -> None:
        # ``reader`` must allow replies block_ms late (open_redis's blocking_s), or every idle
        # read would end in a TimeoutError and a reconnect.
        self.client = client
        # The blocked reads on a client of their own (one connection per pool): on the shared
        # pool, with as many pools as connections, the readers held every connection (each
        # took its own back before a waiting command could) and the frontend never got ready.
        self.reader = client if reader is None else reader
        self.pools = list(pools)
        self.frontend_id = frontend_id
        self.metrics = metrics
        self.block_ms = block_ms
        self._queues: dict[str, asyncio.Queue[Reply]] = {}
        self._pool_of: dict[str, str] = {}  # request id -> its pool, as registered
        self._admitted: dict[str, str] = {}  # request id -> pool, once admit returned
        # registered requests whose final reply came (maybe before their admit returned)
        self._ended: set[str] = set()
        # Last entry id handed out per pool; the heartbeat trims the stream up to it.
        self.last_ids: dict[str, str] = {k.pool: "0-0" for k in self.pools}
        self.healthy = {k.pool: False for k in self.pools}
        # the last read came back short of READ_COUNT: nothing piled up behind it
        self.caught_up = {k.pool: False for k in self.pools}
        self._stopping = False

    async def stop(self) -> None:
        """Make the read loops return now.

        A flag plus a wake-up entry rather than Task.cancel(): redis-py may swallow a
        cancellation that lands inside a blocking read (redis/redis-py#2028), which would
        leave the loop running. If Redis is unreachable the loops notice within one block."""
        self._stopping = True
        for keys in self.pools:
            stream = keys.reply(self.frontend_id)
            with contextlib.suppress(Exception):
                pipe = self.client.pipeline(transaction=False)
                pipe.xadd(stream, {"k": "stop"}, maxlen=REPLY_MAXLEN, approximate=True)
                # The wake-up entry may create the stream: never leave one without a TTL.
                pipe.expire(stream, REPLY_TTL_S)
                await pipe.execute()

    def register(self, request_id: str, pool: str | None = None) -> asyncio.Queue[Reply]:
        """Call BEFORE admitting: a fast worker's first tokens may arrive before admit returns.
        ``pool``: the pool it is admitted to (whose reply entries lost it fails)."""
        q: asyncio.Queue[Reply] = asyncio.Queue()
        self._queues[request_id] = q
        if pool is not None:
            self._pool_of[request_id] = pool
        return q

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._pool_of.pop(request_id, None)
        self._admitted.pop(request_id, None)
        self._ended.discard(request_id)

    def admitted(self, request_id: str, pool: str) -> None:
        """Its record is in Redis from now on (what :meth:`admitted_in` lists), unless its
        final reply came already: a fast worker's can be read before admit's answer."""
        if request_id in self._queues and request_id not in self._ended:
            self._admitted[request_id] = pool

    def admitted_in(self, pool: str) -> list[str]:
        return [rid for rid, p in self._admitted.items() if p == pool]

    def answer_lost(self, request_id: str, reply: Reply) -> bool:
        """Hand ``reply`` (its record is gone) to an admitted request, which is then no longer
        admitted: its handler may read it late (a stream writing to a slow client), and every
        later look for lost records counted, logged and answered it again. False (nothing
        handed) when it is admitted no more (answered already, or ended); :meth:`deliver`
        settles it (an admitted request always has its queue: unregister drops both)."""
        if request_id not in self._admitted:
            return False
        self.deliver(request_id, reply)
        return True

    def deliver(self, request_id: str, reply: Reply) -> None:
        """Hand a reply made here (not read from the stream) to a waiting request."""
        if (q := self._queues.get(request_id)) is not None:
            self._settle(request_id, reply)
            q.put_nowait(reply)

    def _settle(self, request_id: str, reply: Reply) -> None:
        if reply.kind in ("done", "err"):
            # Its final state came: no longer one whose record must exist (the record
            # expires record_ttl_s after it, maybe while a slow client reads the answer),
            # nor one to admit later (a fast worker's can come before admit's answer).
            self._admitted.pop(request_id, None)
            self._ended.add(request_id)

    def broadcast(self, reply: Reply) -> None:
        """Deliver a local notice (e.g. kind ``shutdown``) to every waiting request."""
        for q in self._queues.values():
            q.put_nowait(reply)

    def dispatch(self, pool: str, fields: dict[Any, Any], to: set[str] | None = None) -> None:
        """Hand the replies of one entry to their requests (whose ids are added to ``to``)."""
        try:
            replies = replies_of(fields)
        except ValueError:  # not from a script of ours: nothing to hand anyone
            log.warning("pool %s: a reply-stream entry of an unknown shape was skipped", pool)
            self.metrics.reply_entries.labels(pool, "malformed").inc()
            return
        for rid, reply in replies:
            q = self._queues.get(rid)
            if q is None and not rid:
                continue  # our own wake-up entry (stop)
            if q is None:
                # The client is gone (its request was cancelled); the worker learns via cancels.
                self.metrics.reply_entries.labels(pool, "orphan").inc()
                continue
            self.metrics.reply_entries.labels(pool, reply.kind).inc()
            self._settle(rid, reply)
            q.put_nowait(reply)
            if to is not None:
                to.add(rid)

    def _entries_lost(self, pool: str, heard: set[str]) -> None:
        """Entries this reader had not read were trimmed (it fell more than the stream's cap
        behind). Which requests they were for is not known: a request that heard nothing in the
        read after them may have lost its final entry, and would wait out request_timeout_s
        (or, with tokens lost in the middle, be answered short). Each such request of ``pool``
        not ended yet is answered 503 replies_lost (its handler cancels it in Redis); one that
        heard something there is judged by its offsets (Generation.accept): a lost token batch
        shows as a gap before the next."""
        ids = [rid for rid, p in self._pool_of.items()
               if p == pool and rid not in heard and rid not in self._ended]
        log.error("pool %s: reply-stream entries were trimmed before this frontend read them (it fell "
                  "behind the stream's cap); %d requests in flight are answered 503 %s", pool, len(ids),
                  REPLIES_LOST)
        for rid in ids:
            self.deliver(rid, Reply("err", code=REPLIES_LOST,
                                    message="reply entries were trimmed before they were read"))

    async def run(self, keys: PoolKeys) -> None:
        """The one blocking reader of this pool's reply stream; runs until cancelled."""
        stream = keys.reply(self.frontend_id)
        # The id is new for each process, so every entry of the stream is ours to read.
        last = self.last_ids[keys.pool]
        backoff = Backoff(f"reply stream {stream}", first_s=0.05, max_s=2.0, logger=log)
        block: int | None = None  # the first read does not block: /readyz knows at once
        while not self._stopping:
            before = last
            try:
                resp = await self.reader.xread({stream: last}, count=READ_COUNT, block=block)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down or restarting: keep trying, never spin
                self.healthy[keys.pool] = self.caught_up[keys.pool] = False
                self.metrics.redis_errors.labels("xread").inc()
                await backoff.failed(exc)
                continue
            self.healthy[keys.pool] = True
            block = self.block_ms
            backoff.succeeded()
            # (entries read while stopping are still dispatched: their handlers may be waiting)
            read = 0
            heard: set[str] = set()
            for entry_id, fields in _entries(resp):
                last = _s(entry_id)
                self.dispatch(keys.pool, fields, heard)
                read += 1
            if read == READ_COUNT and before != "0-0":
                await self._check_trimmed(keys, stream, before, heard)
            # (only now: the heartbeat trims the stream up to this, `before` kept till then)
            self.last_ids[keys.pool] = last
            self.caught_up[keys.pool] = read < READ_COUNT

    async def _check_trimmed(self, keys: PoolKeys, stream: str, before: str, heard: set[str]) -> None:
        """After a full read from ``before``: were entries after it trimmed unread? The scripts
        cap the stream at ~100,000 entries (lua/include/pool_keys.lua REPLY_MAXLEN), trimming
        from its head, and the heartbeat trims it up to the last entry read but keeps that one:
        while an entry at or before ``before`` is there, nothing after it went. Only a full read
        can follow a trim past it (the stream then holds ~100,000 entries after it); a stream
        lost whole (its TTL ran out, Redis restarted empty, a flush) and written again holds
        no entry at or before ``before`` either, and may hold a full read by the next one (a
        reader held up, or backing off from the outage): it is told apart by its length, as
        a stream the cap trimmed holds at least REPLY_MAXLEN entries (``~`` never trims below
        it; the heartbeat trims only entries before ``before``, of which there are none then).
        What a stream lost whole held went with the requests' records (the heartbeat answers
        those); taken for a trim, every request that heard nothing in the read was failed.
        Asked after the read, never before: a pause between a check and the read (an event
        loop busy for seconds, as when a reader falls behind) hid the trim."""
        try:
            kept = await self.reader.xrevrange(stream, max=before, min="-", count=1)
            trimmed = not kept and await self.reader.xlen(stream) >= REPLY_MAXLEN
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the next read meets the outage; this one's entries were fine
            log.warning("pool %s: could not check the reply stream for trimmed entries: %s", keys.pool, exc)
            return
        if trimmed:
            self._entries_lost(keys.pool, heard)


class Heartbeat:
    """Liveness, Redis clock offset and measured service rates, every ``interval_s``.

    Each pool beats on its own: on a Redis Cluster a pool lives on one shard, and one shard
    out of reach (a master down, its failover not done yet) must not stop the beats, and so
    the readiness, of the pools on the others."""

    def __init__(self, client: Any, pools: Iterable[PoolKeys], frontend_id: str, classes: Iterable[str],
                 interval_s: float, trim_upto: Callable[[str], str] | None = None,
                 outage_grace_ms: dict[str, int] | None = None,
                 prune_after_ms: dict[str, int] | None = None,
                 on_entry_lost: Callable[[PoolKeys], Awaitable[None]] | None = None) -> None:
        self.client = client
        self.pools = list(pools)
        self.frontend_id = frontend_id
        self.classes = list(classes)
        self.interval_s = interval_s
        self.trim_upto = trim_upto
        self.clock_offset_ms = 0.0  # Redis time - local wall time (the last pool measured)
        self._offsets: dict[str, float] = {}  # the same per pool: a cluster's hosts' clocks differ
        self.pool_ok: dict[str, float] = {}  # pool -> time.monotonic() of its last complete beat
        # pool -> how long the scripts should remember, after we lost Redis, that we were alive
        # (``keys.outage``; two heartbeat TTLs); empty: never written
        self.outage_grace_ms = outage_grace_ms or {}
        # pool -> silence after which another frontend's entry is pruned; empty: never
        self.prune_after_ms = prune_after_ms or {}
        # Called when a beat finds its own entry gone (Redis restarted empty or was flushed, or
        # failed over to a replica that had not seen it): what Redis held may be lost.
        self.on_entry_lost = on_entry_lost
        self._last_beat_ms: dict[str, int] = {}  # pool -> Redis ms of its last complete beat
        self._in_beat: set[str] = set()  # pools whose beat started and did not complete
        self._claimed: dict[tuple[str, str], tuple[float, int]] = {}
        self._rates: dict[tuple[str, str], float] = {}
        # pool -> held while one of its beats runs: the loop's and a request's (beat_since) never
        # overlap (a beat under way reads as one interrupted to another: _in_beat)
        self._beating: dict[str, asyncio.Lock] = {}

    def redis_now_ms(self, pool: str | None = None) -> float:
        """Redis' clock now: ``pool``'s shard's (as its scripts stamp it) where measured."""
        offset = self._offsets.get(pool, self.clock_offset_ms) if pool is not None else self.clock_offset_ms
        return time.time() * 1000 + offset

    @property
    def last_ok(self) -> float:
        """time.monotonic() by which every pool had completed a beat (0: one never did)."""
        return min((self.pool_ok.get(k.pool, 0.0) for k in self.pools), default=0.0)

    def fresh(self, max_age_s: float, pool: str | None = None) -> bool:
        """Whether every pool (or ``pool``) beat within ``max_age_s``."""
        last = self.last_ok if pool is None else self.pool_ok.get(pool, 0.0)
        return last > 0 and time.monotonic() - last <= max_age_s

    def service_rate(self, pool: str, cls: str) -> float | None:
        """Claims per second of ``cls`` in ``pool`` (smoothed), or None before two samples."""
        return self._rates.get((pool, cls))

    async def beat_since(self, keys: PoolKeys, asked_at: float) -> None:
        """A beat of ``keys``' pool that completed after ``asked_at`` (time.monotonic()): this
        one, unless another completed since (the requests that ask at once share one)."""
        async with self._beating.setdefault(keys.pool, asyncio.Lock()):
            if self.pool_ok.get(keys.pool, 0.0) > asked_at:
                return
            await self._beat_pool(keys)

    async def beat_pool(self, keys: PoolKeys) -> None:
        async with self._beating.setdefault(keys.pool, asyncio.Lock()):
            await self._beat_pool(keys)

    async def _beat_pool(self, keys: PoolKeys) -> None:
        """One pool's beat. The first that completes after one that did not (Redis restarted,
        or was out of reach) first records, once per outage, when the frontends last reached
        Redis: the lifecycle scripts then do not take another frontend for dead just because
        it reconnects a moment later than this one (lua/include/liveness.lua, frontend_alive)."""
        pool = keys.pool
        last_ms = self._last_beat_ms.get(pool, 0)
        interrupted = pool in self._in_beat and last_ms > 0
        first = last_ms == 0
        self._in_beat.add(pool)
        t0 = time.time()
        redis_ms = await redis_now_ms(self.client, keys)  # (its shard's clock, on a cluster)
        # against the round trip's midpoint
        self._offsets[pool] = self.clock_offset_ms = redis_ms - (t0 + time.time()) * 500
        now_ms = int(redis_ms)
        grace = self.outage_grace_ms.get(pool)
        lost = last_ms if interrupted else None
        if interrupted and grace:
            # Our own last beat is when *we* last reached Redis, but a Redis that restarted
            # from its AOF (everysec) or an older RDB lost the last second or more of writes:
            # the other frontends' beats it kept can be older than ours by more than the TTL,
            # and against a marker of our last beat they were dead to every script until they
            # beat again (a live frontend's request admitted then was cancelled at claim, "its
            # client frontend stopped heartbeating": a fault hunt, kill -9 of an AOF Redis).
            # The newest beat Redis kept is when the frontends last reached it, as it knows.
            newest = await self.client.zrange(keys.frontends, -1, -1, withscores=True)
            if newest and int(newest[0][1]) < last_ms:
                lost = int(newest[0][1])
        if first and grace:
            # A process's first beat cannot tell whether the others lost Redis (it may have
            # started during an outage): when no frontend has beaten within the TTL, the
            # newest beat is when they did. Without the marker its own beat made the
            # frontends that lived through the outage dead to every script until they
            # beat again, and their requests were cancelled.
            newest = await self.client.zrange(keys.frontends, -1, -1, withscores=True)
            if newest and newest[0][1] < now_ms - grace / 2:
                lost = int(newest[0][1])
        pipe = self.client.pipeline(transaction=False)
        marked = lost is not None and bool(grace)
        if marked:  # before the ZADD: no script may see us fresh without it
            pipe.set(keys.outage, lost, nx=True, px=grace)
        pipe.zadd(keys.frontends, {self.frontend_id: now_ms})
        pipe.hmget(keys.stats, [f"{c}.claimed" for c in self.classes])
        last = self.trim_upto(pool) if self.trim_upto else "0-0"
        if last != "0-0":
            # Entries up to the last one read were handed out already; keep the stream small.
            pipe.xtrim(keys.reply(self.frontend_id), minid=last, approximate=False)
        res = await pipe.execute()
        self._sample_rates(pool, res[2 if marked else 1], time.monotonic())
        if res[1 if marked else 0] and not first and self.on_entry_lost is not None:
            # ZADD added us anew: only leave() removes our entry, and a pruner only one
            # silent far past every liveness rule (whose requests Redis cancelled already).
            await self.on_entry_lost(keys)
        self.pool_ok[pool] = time.monotonic()
        self._last_beat_ms[pool] = now_ms
        self._in_beat.discard(pool)
        if (after := self.prune_after_ms.get(pool)) is not None:
            # Frontends killed without leaving; never while an outage marker says an old
            # beat may still count as alive (lua/include/liveness.lua).
            await prune_stale(self.client, keys.frontends, now_ms - after, skip_while=keys.outage)

    def _sample_rates(self, pool: str, counts: list[Any], now: float) -> None:
        for cls, raw in zip(self.classes, counts, strict=True):
            n = _i(raw) if raw is not None else 0
            prev = self._claimed.get((pool, cls))
            self._claimed[(pool, cls)] = (now, n)
            if prev is None or now - prev[0] <= 0 or n < prev[1]:  # first sample or a Redis reset
                continue
            rate = (n - prev[1]) / (now - prev[0])
            old = self._rates.get((pool, cls))
            # An EWMA over a few beats: steady enough for a Retry-After, quick to follow load.
            self._rates[(pool, cls)] = rate if old is None else 0.5 * old + 0.5 * rate

    async def leave(self, pools: Iterable[PoolKeys] | None = None) -> None:
        """On clean shutdown: stop counting as alive (nothing of ours is in flight by then),
        in every pool (of ``pools``) whose server answers: the pools at the same time, each on
        its own (one shard out of reach left every pool after it in the list counting us alive)."""

        async def leave_pool(keys: PoolKeys) -> None:
            # The reply stream goes too: nothing reads it any more (a late entry from a
            # worker creates it again, with its TTL).
            pipe = self.client.pipeline(transaction=False)
            pipe.zrem(keys.frontends, self.frontend_id)
            pipe.delete(keys.reply(self.frontend_id))
            await pipe.execute()

        await asyncio.gather(*(leave_pool(k) for k in (self.pools if pools is None else pools)),
                             return_exceptions=True)


def drain_estimate_s(depth: int, rate: float | None, fallback_s: float) -> int:
    """Seconds until ``depth`` queued requests are served at ``rate``/s, for Retry-After.

    With no measured rate (nothing served lately) there is nothing honest to extrapolate
    from; the caller's fallback (the class's max queue wait) bounds it instead."""
    if rate is not None and rate > 0.01:
        return max(1, min(300, math.ceil((depth + 1) / rate)))
    return max(1, min(300, math.ceil(fallback_s)))
