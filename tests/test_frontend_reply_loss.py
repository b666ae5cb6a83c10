"""Reply entries lost before this frontend read them: its reader fell past the reply stream's
cap (the scripts' XADD MAXLEN ~100,000, lua/include/notify.lua) and entries were trimmed
unread. No client gets a wrong answer for a whole one, nor waits out request_timeout_s for
a final entry that is gone: each request that may have lost an entry is answered 503
``replies_lost`` (in-band once its stream opened), counted, and cancelled in Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from limiter.frontend.replies import REPLY_MAXLEN
from limiter.frontend.runtime import Frontend
from limiter.localstack.sse import sse_chunks
from limiter.scripts import Claimed, Scripts
from tests.support.frontend_helpers import POOL, auth, fe_of, frontend, make_cfg
from tests.support.helpers import redis_ms, wait_until

WORKER = "w-gap"
STREAMED = {"model": "tiny", "prompt": "x", "max_tokens": 12, "stream": True}


class ReaderGate:
    """Holds the frontend's reply reader before its next XREAD, as a reader that fell behind
    would be (an event loop busy for seconds, a paused process): the scripts meanwhile write
    on, and trim, its reply stream. The reader itself is the frontend's own."""

    def __init__(self, fe: Frontend, monkeypatch: Any) -> None:
        self.fe = fe
        self.open = asyncio.Event()
        self.open.set()
        self.parked = False
        real = fe.router.reader.xread

        async def xread(*args: Any, **kwargs: Any) -> Any:
            if not self.open.is_set():
                self.parked = True
                await self.open.wait()
                self.parked = False
            return await real(*args, **kwargs)

        monkeypatch.setattr(fe.router.reader, "xread", xread)

    async def close(self, aredis: Any) -> None:
        self.open.clear()
        # an entry that names no request ends the read under way (as the stop's wake-up does)
        await aredis.xadd(POOL.reply(self.fe.frontend_id), {"k": "wake"})
        await wait_until(lambda: self.parked, "the reply reader to stop before its next read")


async def claim_one(scripts: Scripts) -> Claimed:
    end = time.monotonic() + 15
    while not (got := await scripts.claim(POOL, WORKER, 1)).requests:
        assert time.monotonic() < end, "still waiting after 15 s for: the request to be queued"
        await asyncio.sleep(0.01)
    return got.requests[0]


async def push(scripts: Scripts, c: Claimed, offset: int, text: str) -> None:
    await scripts.push_tokens(POOL, request_id=c.request_id, worker_id=WORKER, fence=c.fence, offset=offset,
                              token_ids=[ord(ch) for ch in text], text=text)


async def rest_of(chunks: Any, what: str) -> tuple[str, dict[str, Any] | None, bool]:
    """(text, the in-band error or None, whether [DONE] came) of the rest of a stream."""
    text, error = "", None
    try:
        async with asyncio.timeout(30):
            async for chunk in chunks:
                if chunk is None:
                    return text, error, True
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                text += chunk["choices"][0]["text"]
    except TimeoutError:
        raise AssertionError(f"still waiting after 30 s for: {what} (got {text!r} so far)") from None
    return text, error, False


def lost_counted(fe: Frontend) -> float:
    return fe.metrics.registry.get_sample_value("qos_frontend_replies_lost_total", {"pool": "tiny"}) or 0


async def open_stream(client: Any, scripts: Scripts, aredis: Any) -> tuple[Claimed, Any, Any]:
    """A streamed request, claimed by the test's worker, its first text ("abc") read by its
    client: (its claim, the response, its chunks)."""
    await aredis.zadd(POOL.workers, {WORKER: await redis_ms(aredis)})
    sent = asyncio.create_task(client.post("/v1/completions", json=STREAMED, headers=auth()))
    c = await claim_one(scripts)
    await push(scripts, c, 0, "abc")
    r = await sent  # (the headers go out with the first text)
    assert r.status == 200, await r.text()
    chunks = sse_chunks(r.content)
    first = await anext(chunks)
    assert first is not None and first["choices"][0]["text"] == "abc"
    return c, r, chunks


class Held(NamedTuple):
    """A frontend whose reply reader is held back, with one streamed request open."""

    fe: Frontend
    gate: ReaderGate
    scripts: Scripts
    claimed: Claimed
    chunks: Any  # the request's SSE chunks, its first text read
    stream: str  # the frontend's reply stream


@contextlib.asynccontextmanager
async def reader_held_back(redis_server: Any, aredis: Any, monkeypatch: Any) -> AsyncIterator[Held]:
    """A frontend, a streamed request of it claimed by the test's worker with its first text
    read, then the frontend's reply reader held before its next read (:class:`ReaderGate`)."""
    scripts = Scripts(aredis)
    async with frontend(make_cfg(redis_server.url)) as client:
        fe = fe_of(client)
        gate = ReaderGate(fe, monkeypatch)
        c, _resp, chunks = await open_stream(client, scripts, aredis)
        await gate.close(aredis)
        yield Held(fe, gate, scripts, c, chunks, POOL.reply(fe.frontend_id))


async def test_a_final_reply_trimmed_unread_is_an_error_at_once_not_a_wait_for_the_timeout(
        redis_server, sync_redis, aredis, monkeypatch):
    """The request's final entry was trimmed from the reply stream before the reader got to
    it: before, the client heard nothing more and waited request_timeout_s (600 s). The
    reader sees that the last entry it read is gone after a full read, and the requests of
    the pool that heard nothing in that read are answered at once."""
    async with reader_held_back(redis_server, aredis, monkeypatch) as (fe, gate, scripts, c, chunks, stream):
        await scripts.complete(POOL, request_id=c.request_id, worker_id=WORKER, fence=c.fence, outcome="ok",
                               usage_in=2, token_ids=[ord(ch) for ch in "def"], text="def")
        final_id = (await aredis.xrevrange(stream, count=1))[0][0]
        # Other requests' replies (whose clients are gone) fill the stream past its cap, as the
        # scripts write them.
        for _ in range(REPLY_MAXLEN // 10_000 + 1):
            pipe = aredis.pipeline(transaction=False)
            for _ in range(10_000):
                pipe.xadd(stream, {"id": "r-gone", "k": "tok", "o": 0, "n": 1, "t": "x"},
                          maxlen=REPLY_MAXLEN, approximate=True)
            await pipe.execute()
        assert not await aredis.xrange(stream, "-", final_id), "the final entry should have been trimmed"
        gate.open.set()
        text, error, done = await rest_of(chunks, "the stream's end after the trim")
        assert (text, done) == ("", False), "nothing after the lost entry, and no [DONE]"
        assert error is not None and error["code"] == "replies_lost", error
        assert "127.0.0.1" not in error["message"] and stream not in error["message"]
        assert lost_counted(fe) == 1


async def test_a_token_batch_lost_unread_fails_the_request_rather_than_skip_its_text(
        redis_server, sync_redis, aredis, monkeypatch):
    """An entry of a request's lost before it was read, and a later one read: before, its text
    after the hole went to the client as if whole ("abc" + "ghi" for "abcdefghi": a warning in
    the log, nothing else). The hole is seen by the offsets: the request fails, in-band, is
    counted and is cancelled in Redis (its worker stops)."""
    async with reader_held_back(redis_server, aredis, monkeypatch) as (fe, gate, scripts, c, chunks, stream):
        await push(scripts, c, 3, "def")
        await push(scripts, c, 6, "ghi")
        lost = [eid for eid, f in await aredis.xrange(stream) if f.get(b"t") == b"def"]
        assert len(lost) == 1
        await aredis.xdel(stream, *lost)  # (a trim takes a whole node: see the test above)
        gate.open.set()
        text, error, done = await rest_of(chunks, "the stream's end after the lost batch")
        assert (text, done) == ("", False), "no text after the hole, and no [DONE]"
        assert error is not None and error["code"] == "replies_lost", error
        assert lost_counted(fe) == 1
        await wait_until(lambda: sync_redis.sismember(POOL.cancels, c.request_id),
                         "the request to be cancelled in Redis")


async def test_a_reply_stream_lost_whole_and_written_again_past_a_full_read_fails_no_request(
        redis_server, sync_redis, aredis, monkeypatch):
    """The reply stream's key went whole (it expired after REPLY_TTL_S without an entry, Redis
    restarted empty or was flushed) and was written again, more than a read's worth
    (READ_COUNT), before the reader's next read: no entry at or before where the reader was is
    there, yet nothing was trimmed (a stream trimmed by its cap holds ~100,000 entries). The
    request, whose entries all came after, gets its whole answer, not 503 replies_lost."""
    from limiter.frontend.replies import READ_COUNT

    async with reader_held_back(redis_server, aredis, monkeypatch) as (fe, gate, scripts, c, chunks, stream):
        await aredis.delete(stream)  # (its TTL ran out, or Redis lost it)
        pipe = aredis.pipeline(transaction=False)
        for _ in range(READ_COUNT + 10):  # other requests' replies (their clients gone)
            pipe.xadd(stream, {"id": "r-gone", "k": "tok", "o": 0, "n": 1, "t": "x"},
                      maxlen=REPLY_MAXLEN, approximate=True)
        await pipe.execute()
        await scripts.complete(POOL, request_id=c.request_id, worker_id=WORKER, fence=c.fence, outcome="ok",
                               usage_in=2, token_ids=[ord(ch) for ch in "def"], text="def")
        gate.open.set()
        text, error, done = await rest_of(chunks, "the stream's end")
        assert error is None, error
        assert (text, done) == ("def", True)
        assert lost_counted(fe) == 0
