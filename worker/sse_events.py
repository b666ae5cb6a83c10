"""The events of a model server's Server-Sent Events stream, as its bytes come.

The openai engine (:mod:`worker.upstream`) reads a model server's answer with
:func:`sse_batches`: every event whose bytes had come when the worker read, so chunks the
server sent while the worker was busy are handled, and pushed, together. The parser follows
the event-stream format of the HTML standard ("Server-sent events", parsing an event
stream), for the one field the worker needs:

* lines end in ``\\r\\n``, ``\\n`` or a lone ``\\r`` (a ``\\r`` at the end of a read waits
  for the next one, which may begin with its ``\\n``);
* a byte order mark at the start of the stream is not part of the first line;
* a line ``field:value`` sets ``field`` (one space after the colon is not part of the
  value); a line with no colon is a field with an empty value; a line starting with a
  colon is a comment; only ``data`` is kept, other fields (``event``, ``id``, ``retry``)
  are skipped;
* a blank line ends an event: its ``data`` lines joined with newlines (no event without
  one). An event left open when the stream ends is still returned by :meth:`SseParser.close`
  (the standard drops it; a server cut off after its last chunk lost nothing then).

A line longer than :data:`MAX_SSE_LINE`, or an event whose data lines hold more, is refused
(:class:`MalformedStream`), after the events before it: a worker must not buffer without
bound what a broken server sends. A stream whose bytes keep coming without an event
(comments only, a keep-alive a proxy sends while the answer is stuck) is given up after
``idle_s`` (:class:`StreamIdle`): the socket's read timeout never fired on it, and the
request waited for its client's own timeout.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson

MAX_SSE_LINE = 1 << 20  # bytes; a chunk of a model server's stream is well under a kilobyte
# (but the first of a completion echoing its prompt with logprobs: echo_line_bytes)
_BOM = b"\xef\xbb\xbf"  # U+FEFF in UTF-8
_LINE_END = re.compile(rb"\r\n|\r|\n")
ECHO_ENTRY_BYTES = 128  # a logprob entry's most bytes in a chunk: a token, its float, JSON's marks


def echo_line_bytes(prompt: str | tuple[int, ...], top: int) -> int:
    """The longest line of a stream that echoes ``prompt`` (its text, or its token ids) with
    its tokens' logprobs and ``top`` alternatives a token: vLLM sends every prompt token's in
    the first chunk, at most one a byte of the prompt's text (and a BOS), each in the token
    list and with its alternatives and itself in its top entry (a token-id prompt's text
    too: an entry's bytes hold its token's)."""
    tokens = len(prompt) if isinstance(prompt, tuple) else len(prompt.encode("utf-8", "surrogatepass")) + 1
    return MAX_SSE_LINE + tokens * (top + 2) * ECHO_ENTRY_BYTES


class MalformedStream(ValueError):
    """The upstream's event stream cannot be parsed (a line past :data:`MAX_SSE_LINE`)."""


class StreamIdle(TimeoutError):
    """Bytes came, but no event, for longer than the stream's idle bound: read as a timeout."""


class SseParser:
    """The ``data`` payloads of an event stream (module docstring), from its bytes as they come.

    :meth:`feed` returns the events its bytes completed; :meth:`close`, at the end of the
    stream, what was left open. A line longer than ``max_line`` raises
    :class:`MalformedStream` from the next call, so the events completed before it are
    still returned."""

    def __init__(self, max_line: int = MAX_SSE_LINE) -> None:
        self.max_line = max_line
        self._partial = b""  # the start of a line whose end has not come yet
        self._data: list[str] = []  # the data lines of the event being read
        self._started = False  # the stream's first bytes were seen (its byte order mark gone)
        self._data_chars = 0  # the characters of the open event's data lines

    def _check(self) -> None:
        if len(self._partial) > self.max_line:
            raise MalformedStream(f"a line of more than {self.max_line} bytes")
        # An event's data lines are as bounded as a line: a server that ends its chunks with
        # one newline, not two, made one event of the whole stream, kept until it ended.
        if self._data_chars > self.max_line:
            raise MalformedStream(f"an event of more than {self.max_line} bytes of data")

    def feed(self, raw: bytes) -> list[str]:
        self._check()
        buf = self._partial + raw
        if not self._started:
            if len(buf) < len(_BOM) and _BOM.startswith(buf):
                self._partial = buf  # maybe the start of a byte order mark: wait for more
                return []
            self._started = True
            buf = buf.removeprefix(_BOM)
        # A lone \r ends a line too; one at the end of the read may be the first half of \r\n.
        held = b"\r" if buf.endswith(b"\r") else b""
        if held:
            buf = buf[:-1]
        lines = _LINE_END.split(buf) if b"\r" in buf else buf.split(b"\n")
        self._partial = lines.pop() + held
        out: list[str] = []
        for line in lines:
            self._line(line, out)
        return out

    def close(self) -> list[str]:
        self._check()
        out: list[str] = []
        partial = self._partial.removesuffix(b"\r")
        if not self._started:
            partial = partial.removeprefix(_BOM)
        self._partial = b""
        if partial:
            self._line(partial, out)
        if self._data:
            out.append("\n".join(self._data))
            self._data, self._data_chars = [], 0
        return out

    def _line(self, raw: bytes, out: list[str]) -> None:
        if not raw:
            if self._data:
                out.append("\n".join(self._data))
                self._data, self._data_chars = [], 0
            return
        line = raw.decode("utf-8", "replace")
        field, colon, value = line.partition(":")
        if field == "data":  # a comment (":...") has the empty field name
            self._data.append(value.removeprefix(" ") if colon else "")
            self._data_chars += len(self._data[-1]) + 1


def parse_chunk(data: str) -> Any:
    """One chunk's JSON. orjson first: the worker parses every chunk of every stream, and it
    takes a quarter of the standard library's time for a chunk (2.1 against 7.8 us for a
    210-byte one); what orjson refuses, the standard library tries too, which also reads the
    ``NaN`` and ``Infinity`` a server built on Python's json may write. Raises ValueError."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


async def sse_batches(content: aiohttp.StreamReader, idle_s: float | None = None,
                      wake_at: Callable[[], float | None] | None = None,
                      max_line: int = MAX_SSE_LINE) -> AsyncIterator[list[str]]:
    """The ``data`` payloads of an event stream, a batch per read: every event whose bytes had
    come when the worker read (``readany`` takes all that is buffered). Raises
    :class:`MalformedStream`, and :class:`StreamIdle` when reads went on for more than
    ``idle_s`` seconds without an event (None: no bound; a silent server is the socket read
    timeout's). ``wake_at``, asked before each read: a monotonic time by which the caller
    wants control back (None: none); a read still waiting then yields an empty batch, and
    the stream goes on where it was (the bytes not yet come stay for the next read).
    ``max_line``: the longest line taken (:class:`SseParser`)."""
    parser = SseParser(max_line)
    last = time.monotonic()
    while True:
        wake = wake_at() if wake_at is not None else None
        if wake is None:
            raw = await content.readany()
        else:
            try:
                async with asyncio.timeout(max(0.0, wake - time.monotonic())):
                    raw = await content.readany()
            except TimeoutError:
                yield []
                continue
        if not raw:
            break
        if events := parser.feed(raw):
            last = time.monotonic()
            yield events
        elif idle_s is not None and time.monotonic() - last > idle_s:
            raise StreamIdle(f"bytes but no event for more than {idle_s:g} s (comments only?)")
    if events := parser.close():
        yield events
