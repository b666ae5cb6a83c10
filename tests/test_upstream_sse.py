"""worker.upstream's Server-Sent Events parser: the events of a model server's stream, however
its bytes are cut into reads (the worker handles, and pushes, what one read completed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.upstream import MalformedStream, SseParser, parse_chunk

# data lines: any text without line breaks (an event of several data lines joins them with "\n")
line_text = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=12)
events = st.lists(st.lists(line_text, min_size=1, max_size=3), max_size=6)


def encode(evs: list[list[str]], crlf: list[bool], extras: bool) -> bytes:
    """The events as a server writes them: ``data:`` lines (with or without the space after
    the colon), each event ended by a blank line; with ``extras``, the fields a parser skips
    (a comment, ``event:``, ``id:``) between them."""
    out = b""
    for i, ev in enumerate(evs):
        end = b"\r\n" if crlf[i % len(crlf)] else b"\n"
        if extras:
            out += b": keep-alive" + end + b"event: chunk" + end
        for j, line in enumerate(ev):
            # one space after the colon is not part of the data (so a line that starts with one keeps it)
            bare = j % 2 == 1 and not line.startswith(" ")
            out += (b"data:" if bare else b"data: ") + line.encode() + end
        if extras:
            out += b"id: " + str(i).encode() + end
        out += end
    return out


def parse(raw: bytes, cuts: list[int]) -> list[list[str]]:
    """Feed ``raw`` cut at ``cuts``; the batches each feed returned, then close()'s."""
    parser, batches, start = SseParser(), [], 0
    for cut in [*sorted({c % (len(raw) + 1) for c in cuts}), len(raw)]:
        batches.append(parser.feed(raw[start:cut]))
        start = cut
    batches.append(parser.close())
    return batches


@settings(max_examples=300, deadline=None)
@given(events, st.lists(st.booleans(), min_size=1, max_size=4), st.booleans(),
       st.lists(st.integers(0, 10_000), max_size=8))
def test_every_cut_of_the_bytes_gives_the_same_events_in_order(evs, crlf, extras, cuts) -> None:
    """Cut anywhere (inside a line, between \\r and \\n, inside a UTF-8 character), the
    stream gives the events the server wrote, each once, in order."""
    raw = encode(evs, crlf, extras)
    batches = parse(raw, cuts)
    assert [e for b in batches for e in b] == ["\n".join(ev) for ev in evs]
    assert batches[-1] == []  # every event was ended by its blank line: nothing left for close()


def test_a_read_returns_every_event_it_completed_and_keeps_the_rest() -> None:
    p = SseParser()
    assert p.feed(b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: {"c"') == ['{"a":1}', '{"b":2}']
    assert p.feed(b":3}\n") == []  # the line ended, the event not yet
    assert p.feed(b"\ndata: [DONE]\n\n") == ['{"c":3}', "[DONE]"]
    assert p.close() == []


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
