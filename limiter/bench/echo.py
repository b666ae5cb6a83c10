"""A bare aiohttp "model server": the overhead benchmark's baseline.

``POST /v1/completions`` with ``stream: true`` answers at once with ``max_tokens`` placeholder
tokens in SSE chunks of ``chunk_tokens`` (16, as the worker's push batching groups them),
a finish chunk, a usage chunk and ``[DONE]`` -- the same bytes a client gets from the full
path, with no admission, no queue, no worker and no Redis. ``GET /readyz`` answers 200.

Run as its own process (``python -m limiter.bench.echo --port N``) so that, like the
frontend, it does not share the load generator's event loop.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from aiohttp import web

CHUNK_TOKENS = 16


def _sse(obj: Any) -> bytes:
    data = obj if isinstance(obj, bytes) else json.dumps(obj, separators=(",", ":")).encode()
    return b"data: " + data + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    n = int(body.get("max_tokens") or 16)
    prompt = str(body.get("prompt") or "")
    rid = f"cmpl-echo{id(request):x}"
    created = int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": body.get("model", "echo")}
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for start in range(0, n, CHUNK_TOKENS):
        k = min(CHUNK_TOKENS, n - start)
        await resp.write(_sse(base | {"choices": [{"index": 0, "text": "x" * k, "finish_reason": None}]}))
    await resp.write(_sse(base | {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": len(prompt.encode()) + 1, "completion_tokens": n,
                 "total_tokens": len(prompt.encode()) + 1 + n}
        await resp.write(_sse(base | {"choices": [], "usage": usage}))
    await resp.write(_sse(b"[DONE]"))
    await resp.write_eof()
    return resp


async def readyz(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/readyz", readyz)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(argv)
    web.run_app(make_app(), host=args.host, port=args.port, access_log=None, print=lambda *_: None)


if __name__ == "__main__":
    main()
