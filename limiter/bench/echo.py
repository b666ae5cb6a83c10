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
as vLLM does. ``--step-ms`` paces it as a continuous-batching server: a decode step every
that many milliseconds, at which every open stream writes its next chunk (0, the default:
all at once).

Run as its own process (``python -m limiter.bench.echo --port N``) so that, like the
frontend, it does not share the load generator's event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

CHUNK_TOKENS = 16
CHUNK_TOKENS_KEY = web.AppKey("chunk_tokens", int)


class Steps:
    """A model server's decode steps: :meth:`next` returns at the next one, for every
    stream that waits on it together (one step gives every sequence its next token)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._tick: asyncio.Future[None] | None = None

    async def next(self) -> None:
        if self._tick is None:
            self._tick = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._tick)  # a stream that goes away must not cancel the step

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            tick, self._tick = self._tick, None
            if tick is not None:
                tick.set_result(None)


STEPS_KEY = web.AppKey("steps", Steps)


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
    steps = request.app.get(STEPS_KEY)
    for start in range(0, n, step):
        if steps is not None:
            await steps.next()
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


def make_app(chunk_tokens: int = CHUNK_TOKENS, step_ms: float = 0.0) -> web.Application:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, not {chunk_tokens}")
    if not 0 <= step_ms <= 10_000:
        raise ValueError(f"step_ms must be in [0, 10000], not {step_ms}")
    app = web.Application()
    app[CHUNK_TOKENS_KEY] = chunk_tokens
    if step_ms > 0:
        app[STEPS_KEY] = steps = Steps(step_ms / 1e3)

        async def stepping(_app: web.Application) -> AsyncIterator[None]:
            task = asyncio.create_task(steps.run())
            yield
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        app.cleanup_ctx.append(stepping)
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
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="a decode step every this many ms, every stream's next chunk at each "
                        "(default 0: at once)")
    args = p.parse_args(argv)
    if args.chunk_tokens < 1:
        p.error(f"--chunk-tokens must be at least 1, not {args.chunk_tokens}")
    if not 0 <= args.step_ms <= 10_000:
        p.error(f"--step-ms must be in [0, 10000], not {args.step_ms}")
    web.run_app(make_app(args.chunk_tokens, args.step_ms), host=args.host, port=args.port, access_log=None,
                print=lambda *_: None)


if __name__ == "__main__":
    main()
