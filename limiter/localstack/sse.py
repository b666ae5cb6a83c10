"""Reading an OpenAI-style server-sent event stream: the one reader the load generator, the
benchmarks and the tests share.

Each event is a ``data: <json>`` line; the stream ends with ``data: [DONE]``. Other lines
(blank separators, comments) carry nothing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

DONE = "[DONE]"


def sse_data(raw: bytes | str) -> dict[str, Any] | str | None:
    """One line of the stream: its JSON chunk, :data:`DONE` for the end marker, or None
    for a line that is not a ``data:`` event."""
    line = (raw.decode() if isinstance(raw, bytes) else raw).strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return DONE if data == DONE else json.loads(data)


async def sse_chunks(lines: AsyncIterable[bytes]) -> AsyncIterator[dict[str, Any] | None]:
    """The JSON chunks of a response body (e.g. aiohttp's ``resp.content``), then None once
    for ``[DONE]``. A stream that ends without yielding None was cut short."""
    async for raw in lines:
        chunk = sse_data(raw)
        if chunk == DONE:
            yield None
            return
        if chunk is not None:
            yield chunk
