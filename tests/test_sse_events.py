"""worker.sse_events: the events of a model server's Server-Sent Events stream, however
its bytes are cut into reads (the worker handles, and pushes, what one read completed)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.sse_events import MalformedStream, SseParser, parse_chunk

# data lines: any text without line breaks (an event of several data lines joins them with "\n")
line_text = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=12)
events = st.lists(st.lists(line_text, min_size=1, max_size=3), max_size=6)


# Every line end the format allows. A lone \r followed by a line ended by \n would read as one
# \r\n: a stream mixes \n and \r\n, or uses \r alone (ENDS[2]).
ENDS = (b"\n", b"\r\n", b"\r")
line_ends = st.one_of(st.lists(st.integers(0, 1), min_size=1, max_size=4), st.just([2]))


def encode(evs: list[list[str]], ends: list[int], extras: bool, bom: bool = False) -> bytes:
    """The events as a server writes them: ``data:`` lines (with or without the space after
    the colon; an empty line of data as a bare ``data``), each event ended by a blank line,
    lines ended by ``ENDS[ends[i]]`` in turn; with ``extras``, the fields a parser skips (a
    comment, ``event:``, ``id:``, a bare ``retry``) between them; with ``bom``, a byte order
    mark first."""
    out = b"\xef\xbb\xbf" if bom else b""
    n = 0

    def end() -> bytes:
        nonlocal n
        n += 1
        return ENDS[ends[n % len(ends)]]

    for i, ev in enumerate(evs):
        if extras:
            out += b": keep-alive" + end() + b"event: chunk" + end() + b"retry" + end()
        for j, line in enumerate(ev):
            if not line and j % 2 == 0:
                out += b"data" + end()  # no colon: the field with an empty value
                continue
            # one space after the colon is not part of the data (so a line that starts with one keeps it)
            bare = j % 2 == 1 and not line.startswith(" ")
            out += (b"data:" if bare else b"data: ") + line.encode() + end()
        if extras:
            out += b"id: " + str(i).encode() + end()
        out += end()
    return out


def parse(raw: bytes, cuts: list[int]) -> list[list[str]]:
    """Feed ``raw`` cut at ``cuts``; the batches each feed returned, then close()'s."""
    parser, batches, start = SseParser(), [], 0
    for cut in [*sorted({c % (len(raw) + 1) for c in cuts}), len(raw)]:
        batches.append(parser.feed(raw[start:cut]))
        start = cut
    batches.append(parser.close())
    return batches


@settings(max_examples=400, deadline=None)
@given(events, line_ends, st.booleans(), st.booleans(), st.lists(st.integers(0, 10_000), max_size=8))
def test_every_cut_of_the_bytes_gives_the_same_events_in_order(evs, ends, extras, bom, cuts) -> None:
    """Lines ended by \\n and \\r\\n in any mix, or by a lone \\r; a byte order mark or none;
    cut anywhere (inside a line, between \\r and \\n, inside the mark or a UTF-8 character),
    the stream gives the events the server wrote, each once, in order."""
    raw = encode(evs, ends, extras, bom)
    batches = parse(raw, cuts)
    assert [e for b in batches for e in b] == ["\n".join(ev) for ev in evs]
    if not raw.endswith(b"\r"):  # a \r last may be half a \r\n until the stream ends
        assert batches[-1] == []  # every event was ended by its blank line: nothing left for close()


def test_a_read_returns_every_event_it_completed_and_keeps_the_rest() -> None:
    p = SseParser()
    assert p.feed(b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: {"c"') == ['{"a":1}', '{"b":2}']
    assert p.feed(b":3}\n") == []  # the line ended, the event not yet
    assert p.feed(b"\ndata: [DONE]\n\n") == ['{"c":3}', "[DONE]"]
    assert p.close() == []


def test_the_format_s_corners_one_by_one() -> None:
    """The byte order mark only at the start (split over reads); a lone \\r as a line end,
    the event it ends handed on once the next read shows no \\n follows; a bare ``data``
    line; comments and other fields skipped."""
    p = SseParser()
    assert p.feed(b"\xef") == [] and p.feed(b"\xbb") == []
    assert p.feed(b"\xbfdata: a\r\r") == []  # the last \r may still be half a \r\n
    assert p.feed(b"data\r: c\rretry\rid: 7\r") == ["a"]
    assert p.feed(b"data:\xef\xbb\xbfb\r\r") == []  # a mark later on is data
    assert p.close() == ["\n\ufeffb"]  # the bare data line, then that one
    q = SseParser()
    assert q.feed(b"data\n\ndata: x\r") == [""]
    assert q.feed(b"\n\r\n") == ["x"]  # \r then \n: one line end, then a blank line
    assert q.close() == []
    r = SseParser()
    assert r.feed(b"data: y\r") == []
    assert r.close() == ["y"]  # cut off after a line's \r: the line ended there


def test_close_returns_what_a_stream_left_open() -> None:
    p = SseParser()
    assert p.feed(b"data: one\n\ndata: two\ndata: three") == ["one"]
    assert p.close() == ["two\nthree"]  # the last line had no newline, the event no blank line
    assert p.close() == []


def test_a_line_past_the_limit_is_refused_after_the_events_before_it() -> None:
    p = SseParser(max_line=16)
    assert p.feed(b"data: ok\n\ndata: " + b"y" * 20) == ["ok"]  # what came before is handed on
    with pytest.raises(MalformedStream, match="more than 16 bytes"):
        p.feed(b"yyy")
    q = SseParser(max_line=16)
    q.feed(b"data: " + b"y" * 20)
    with pytest.raises(MalformedStream):
        q.close()  # the stream ended inside it


def test_many_short_lines_are_not_a_long_line() -> None:
    p = SseParser(max_line=16)
    raw = b"".join(b"data: %d\n\n" % i for i in range(1000))
    assert len(p.feed(raw)) == 1000 and p.close() == []


def test_a_chunk_parses_as_the_standard_library_reads_it() -> None:
    chunk = '{"id":"x","choices":[{"index":0,"text":"h\\u00e9","finish_reason":null}],"usage":{"n":3}}'
    assert parse_chunk(chunk) == {"id": "x", "choices": [{"index": 0, "text": "hé", "finish_reason": None}],
                                  "usage": {"n": 3}}
    # what orjson refuses and Python's json writes (a server built on it) still reads
    assert parse_chunk('{"logprob": -Infinity, "x": NaN}')["logprob"] == float("-inf")
    for bad in ("", "{", "data: {}", "[DONE"):
        with pytest.raises(ValueError):
            parse_chunk(bad)


class _Reads:
    """A stream's reads, as aiohttp's ``readany`` returns them (b"" at the end)."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = list(reads)

    async def readany(self) -> bytes:
        return self.reads.pop(0) if self.reads else b""


async def test_bytes_without_an_event_past_the_idle_bound_are_a_timeout(monkeypatch) -> None:
    """A server (or a proxy) that sends keep-alive comments and nothing else: the socket's read
    timeout never fires, and the request waited for its client's timeout. Past ``idle_s``
    without an event the stream is a timeout; an event resets the bound. The clock is the
    test's: one second a read."""
    from worker import sse_events
    from worker.sse_events import StreamIdle, sse_batches

    clock = iter(range(1000))
    monkeypatch.setattr(sse_events.time, "monotonic", lambda: float(next(clock)))
    ka = b": keep-alive\n\n"
    got: list[list[str]] = []
    with pytest.raises(StreamIdle):
        async for batch in sse_batches(_Reads([ka, b"data: a\n\n", ka, ka, ka, ka, b"data: b\n\n"]), 3.5):
            got.append(batch)
    assert got == [["a"]]  # three comment reads after it were within the bound, the fourth not
    got = [b async for b in sse_batches(_Reads([ka, ka, ka, ka, ka, b"data: a\n\n"]))]
    assert got == [["a"]]  # no bound: comments are skipped for as long as they come


async def test_a_read_that_gives_way_at_the_callers_time_loses_no_byte() -> None:
    """``wake_at``: a read still waiting at the caller's time yields an empty batch (the
    openai worker then pushes tokens held for batching) and the stream goes on where it was:
    an event cut in two by the pause, and the bytes that come after, are read whole."""
    from unittest import mock

    from worker.sse_events import sse_batches

    reader = aiohttp.StreamReader(mock.Mock(_reading_paused=False), 1 << 16, loop=asyncio.get_running_loop())
    reader.feed_data(b"data: a\n\ndata: b")
    got: list[list[str]] = []
    async for batch in sse_batches(reader, wake_at=lambda: time.monotonic() + 0.01):
        got.append(batch)
        if batch == []:  # the server paused mid-event: the rest of it comes now
            reader.feed_data(b"c\n\ndata: d\n\n")
            reader.feed_eof()
    assert got == [["a"], [], ["bc", "d"]]


def test_an_event_whose_data_lines_pass_the_limit_is_refused() -> None:
    """Each line short, but no blank line ever ends the event: its data is bounded as a line."""
    p = SseParser(max_line=16)
    assert p.feed(b"data: ok\n\n" + b"data: abcd\n" * 4) == ["ok"]
    with pytest.raises(MalformedStream, match="event of more than 16 bytes"):
        p.feed(b"data: abcd\n")
    q = SseParser(max_line=16)
    assert q.feed(b"data: abcd\n" * 3 + b"\n") == ["abcd\nabcd\nabcd"]  # within it: as before
    assert q.feed(b"data: abcd\n" * 3 + b"\n") == ["abcd\nabcd\nabcd"]  # the count starts again
