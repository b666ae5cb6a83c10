"""A bare aiohttp "model server": the overhead benchmark's baseline.

``POST /v1/completions`` with ``stream: true`` answers at once with ``max_tokens`` placeholder
tokens in SSE chunks of ``--chunk-tokens`` (default 16, as the worker's push batching groups
them), a finish chunk, a usage chunk and ``[DONE]`` -- the same bytes a client gets from the
full path, with no admission, no queue, no worker and no Redis. ``GET /readyz`` answers 200.

It is also the model server behind the ``openai`` engine in ``qos bench overhead --engine
openai`` (the QoS path in front of a server, measured against that server alone), so it
answers what that engine asks of vLLM: every chunk carries the running ``usage`` when
``stream_options.continuous_usage_stats`` is set, and ``GET /v1/models`` (the engine's probe
after an upstream failure) names the one model. ``--chunk-tokens 1`` streams one token a chunk,
as vLLM does.

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
CHUNK_TOKENS_KEY = web.AppKey("chunk_tokens", int)


def _sse(obj: Any) -> bytes:
    data = obj if isinstance(obj, bytes) else json.dumps(obj, separators=(",", ":")).encode()
    return b"data: " + data + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    n = int(body.get("max_tokens") or 16)
    prompt = str(body.get("prompt") or "")
    options = body.get("stream_options") or {}
    rid = f"cmpl-echo{id(request):x}"
    created = int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": body.get("model", "echo")}
    prompt_tokens = len(prompt.encode()) + 1

    def usage(completion: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    step = request.app[CHUNK_TOKENS_KEY]
    for start in range(0, n, step):
        k = min(step, n - start)
        chunk = base | {"choices": [{"index": 0, "text": "x" * k, "finish_reason": None}]}
        if options.get("continuous_usage_stats"):
            chunk["usage"] = usage(start + k)
        await resp.write(_sse(chunk))
    await resp.write(_sse(base | {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
    if options.get("include_usage"):
        await resp.write(_sse(base | {"choices": [], "usage": usage(n)}))
    await resp.write(_sse(b"[DONE]"))
    await resp.write_eof()
    return resp


async def readyz(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def models(_request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "echo", "object": "model"}]})


def make_app(chunk_tokens: int = CHUNK_TOKENS) -> web.Application:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, not {chunk_tokens}")
    app = web.Application()
    app[CHUNK_TOKENS_KEY] = chunk_tokens
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/readyz", readyz)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS,
                   help=f"tokens per SSE chunk (default {CHUNK_TOKENS}; 1 = one a chunk, as vLLM streams)")
    args = p.parse_args(argv)
    if args.chunk_tokens < 1:
        p.error(f"--chunk-tokens must be at least 1, not {args.chunk_tokens}")
    web.run_app(make_app(args.chunk_tokens), host=args.host, port=args.port, access_log=None,
                print=lambda *_: None)


if __name__ == "__main__":
    main()
