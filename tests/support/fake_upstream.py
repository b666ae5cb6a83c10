"""A small OpenAI-compatible upstream for the openai engine's tests: a real aiohttp server on
127.0.0.1 speaking vLLM's streaming format (usage on the last chunk, per-chunk usage when
asked), its ``POST /tokenize``, and a way to die mid-answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from tests.support.redis_server import free_port


def words(text: str) -> int:
    """The fake model's tokenizer for prompts: one token per whitespace-separated word."""
    return len(text.split())


def fake_prompt_tokens(body: dict[str, Any]) -> int:
    """What the fake server counts for a request body (and answers on /tokenize): its words
    plus BOS; a chat adds a 2-token template per message, and the words of its tools' and
    tool calls' JSON, as a template renders them."""
    if "messages" in body:
        calls = [m["tool_calls"] for m in body["messages"] if m.get("tool_calls")]
        rendered = [json.dumps(x) for x in (body.get("tools"), *calls) if x]
        return 1 + sum(words(m.get("content") or "") + 2 for m in body["messages"]) + \
            sum(words(r) for r in rendered)
    if isinstance(body["prompt"], list):  # token ids: one token each (no BOS added, as vLLM)
        return len(body["prompt"])
    return 1 + words(body["prompt"])


def fake_decode(ids: list[int]) -> str:
    """The fake model's text of token ids: a character each, its byte's (ids past 255 wrap):
    ASCII as the byte tokenizer of deploy/make_bytetok.py reads it."""
    return "".join(chr(t % 256) for t in ids)


class FakeUpstream:
    """Answers with the prompt (or last user message) reversed in tokens of 3 characters, one
    token per chunk (two with PAIRS in the prompt); ``max_tokens`` in those tokens; usage on
    the last chunk (and, asked with ``continuous_usage_stats``, the running usage on every
    chunk), vLLM's ``POST /tokenize``. Prompts containing FAIL get HTTP 400 (PRIOFAIL: naming
    ``priority``), MIDERR an error
    chunk, HUGE a 2 MiB line that never ends, SLOW 40 ms per chunk.

    How the chunks leave, for tests of what the worker does with them as they come: with
    ``gate`` set, each one after the first, and the finish chunk, waits for a
    ``gate.release()`` (the test releases it once it saw the chunk before delivered: the
    chunks come apart, whatever the machine's speed); with ``burst``, the whole answer
    (chunks, finish, usage, ``[DONE]``) goes in one write, so it comes in one read."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.tokenized: list[dict[str, Any]] = []
        self.tokenize_queries: list[str] = []  # the query each /tokenize call came with
        self.tokenize_gate: asyncio.Event | None = None  # set: /tokenize answers once it is set
        self.active = 0
        self.max_active = 0
        self.disconnects = 0
        self.transports: set[Any] = set()
        self.peers: list[Any] = []  # the client address of each streamed request, in order
        self.status: int | None = None  # answer every request with this HTTP status (e.g. 503)
        # the next stream ends after this many chunks with finish_reason "abort" (vLLM: the
        # engine aborted it, e.g. POST /pause in its default mode), usage and [DONE]
        self.abort_after: int | None = None
        self.gate: asyncio.Semaphore | None = None
        self.burst = False
        self.overshoot = 0  # send this many tokens past max_tokens (a server that does not honour it)
        # a prompt containing a key is answered by its handler, (request, body, n-th call) ->
        # response: a test's own misbehaving server (see sse_chunk)
        self.scripts: dict[str, Any] = {}
        self.health_status: int | None = None  # GET /health's answer (None: no such endpoint, 404)
        # while set and not yet released, every generation request waits (its headers sent,
        # nothing after them): an engine that hung behind a live API server
        self.hold: asyncio.Event | None = None
        self.hold_health = False  # GET /health waits on ``hold`` too
        self.health_calls = 0  # GET /health asked
        self.tokenize_redirect: str | None = None  # /tokenize answers 307 to this location
        # GET /tokenizer_info's answer (None: not served, 404, as vLLM without
        # --enable-tokenizer-info-endpoint); every /detokenize body is kept in ``detokenized``
        self.tokenizer_info: dict[str, Any] | None = None
        self.detokenized: list[dict[str, Any]] = []
        self.calls: dict[str, int] = {}
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.get_tokenizer_info)
        self.runner = web.AppRunner(app)
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        if self.hold_health and self.hold is not None:
            await self.hold.wait()
        if self.health_status is None:
            raise web.HTTPNotFound()
        return web.Response(status=self.health_status)

    async def models(self, request: web.Request) -> web.Response:
        if self.status is not None:
            return web.json_response({"error": {"message": "busy"}}, status=self.status)
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized.append(body)
        self.tokenize_queries.append(request.query_string)
        if self.tokenize_gate is not None:
            await self.tokenize_gate.wait()
        if self.tokenize_redirect is not None:
            raise web.HTTPTemporaryRedirect(self.tokenize_redirect)
        if self.status is not None:
            return web.json_response({"error": {"message": "busy"}}, status=self.status)
        n = fake_prompt_tokens(body)
        return web.json_response({"count": n, "max_model_len": 4096, "tokens": list(range(n))})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.detokenized.append(body)
        if self.status is not None:
            return web.json_response({"error": {"message": "busy"}}, status=self.status)
        if not isinstance(body.get("tokens"), list):
            return web.json_response({"object": "error", "message": "tokens: field required"}, status=400)
        return web.json_response({"prompt": fake_decode(body["tokens"])})

    async def get_tokenizer_info(self, request: web.Request) -> web.Response:
        if self.tokenizer_info is None:
            raise web.HTTPNotFound()
        return web.json_response(self.tokenizer_info)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.hold is not None and not self.hold.is_set():
            resp = await sse_response(request)
            await self.hold.wait()
            return resp
        if self.status is not None:
            return web.json_response({"error": {"message": "server busy"}}, status=self.status)
        chat = "messages" in body
        prompt = (body["messages"][-1]["content"] or "") if chat else body["prompt"]
        if isinstance(prompt, list):  # a token-id prompt: its text, a letter a token
            prompt = fake_decode(prompt)
        # a script is chosen by any message of a chat (a resume's last one is the answer so far)
        every = " ".join(str(m.get("content")) for m in body["messages"]) if chat else prompt
        for key, script in self.scripts.items():
            if key in every:
                n = self.calls[key] = self.calls.get(key, 0) + 1
                return await script(request, body, n)
        if "PRIOFAIL" in prompt and body.get("priority"):  # vLLM without priority scheduling
            message = f"Got priority {body['priority']} but Priority scheduling is not enabled."
            return web.json_response({"error": {"message": message, "type": "BadRequestError", "code": 400}},
                                     status=400)
        if "FAIL" in prompt and "PRIOFAIL" not in prompt:
            message = "This model's maximum context length is 64 tokens"  # vLLM's words
            return web.json_response({"error": {"message": message, "type": "BadRequestError", "code": 400}},
                                     status=400)
        answer = prompt[::-1]
        tokens = [answer[i: i + 3] for i in range(0, len(answer), 3)]
        finish = "stop"
        if len(tokens) > body["max_tokens"] + self.overshoot:
            tokens, finish = tokens[: body["max_tokens"] + self.overshoot], "length"
        per = 2 if "PAIRS" in prompt else 1
        pieces = ["".join(tokens[i: i + per]) for i in range(0, len(tokens), per)]
        so = body.get("stream_options") or {}
        prompt_tokens = fake_prompt_tokens(body)

        def usage(done: int) -> dict[str, int]:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                    "total_tokens": prompt_tokens + done}

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.transports.add(request.transport)
        self.peers.append(request.transport.get_extra_info("peername"))
        self.active += 1
        self.max_active = max(self.max_active, self.active)

        held: list[bytes] = []  # burst: everything, written at the end in one go

        async def send(obj: Any) -> None:
            raw = f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode()
            if self.burst:
                held.append(raw)
            else:
                await resp.write(raw)

        async def flush() -> None:
            if held:
                await resp.write(b"".join(held))

        async def gate(n: int) -> None:
            if n and self.gate is not None:
                await self.gate.acquire()

        try:
            for n, p in enumerate(pieces):
                if "SLOW" in prompt:
                    await asyncio.sleep(0.04)
                await gate(n)
                if self.abort_after is not None and n == self.abort_after:
                    self.abort_after = None
                    last = {"index": 0, "delta": {}, "finish_reason": "abort"} if chat else {
                        "index": 0, "text": "", "finish_reason": "abort"}
                    await send({"id": "x", "choices": [last]})
                    if so.get("include_usage"):
                        await send({"id": "x", "choices": [], "usage": usage(n * per)})
                    await send("[DONE]")
                    await flush()
                    return resp
                if "HUGE" in prompt and n == 1:  # a line that never ends
                    await resp.write(b"data: " + b"y" * (2 << 20))
                    return resp
                if "MIDERR" in prompt and n == 2:
                    await send({"error": {"message": "CUDA out of memory"}})
                    await flush()
                    return resp
                choice = ({"index": 0, "delta": {"content": p}, "finish_reason": None} if chat
                          else {"index": 0, "text": p, "finish_reason": None})
                if body.get("logprobs") is not None and body.get("logprobs") is not False:
                    choice["logprobs"] = fake_logprobs(body, tokens[n * per: (n + 1) * per], n * per)
                if n == 0 and not chat and body.get("echo"):  # vLLM: the prompt, before the first text
                    choice["text"] = prompt + p
                    if "logprobs" in choice:
                        choice["logprobs"] = echo_logprobs({**body, "prompt": prompt}, choice["logprobs"])
                chunk: dict[str, Any] = {"id": "x", "choices": [choice]}
                if so.get("include_usage") and so.get("continuous_usage_stats"):
                    chunk["usage"] = usage(min(len(tokens), (n + 1) * per))
                await send(chunk)
            last = {"index": 0, "delta": {}, "finish_reason": finish} if chat else {
                "index": 0, "text": "", "finish_reason": finish}
            await gate(len(pieces))
            await send({"id": "x", "choices": [last]})
            if so.get("include_usage"):
                await send({"id": "x", "choices": [], "usage": usage(len(tokens))})
            await send("[DONE]")
            await flush()
        except (ConnectionError, asyncio.CancelledError):  # the worker closed the stream
            self.disconnects += 1
            raise
        finally:
            self.active -= 1
            self.transports.discard(request.transport)
        return resp

    async def kill(self) -> None:
        """As if the server process died: open connections are cut mid-answer (no final
        chunk, no [DONE]) and nothing listens any more."""
        for t in list(self.transports):
            if t is not None:
                t.abort()
        await self.runner.cleanup()


def fake_logprob(k: int) -> float:
    """The fake server's logprob for the answer's ``k``-th token (from 0)."""
    return -round(0.125 * (k + 1), 3)


def fake_logprobs(body: dict[str, Any], tokens: list[str], first: int) -> dict[str, Any]:
    """A choice's ``logprobs`` for ``tokens`` (the answer's ``first``-th on) as vLLM streams
    them: a chat's ``content`` entries with ``bytes`` and ``top_logprobs`` alternatives (the
    token itself, then ``alt1``...), or a completion's arrays; ``text_offset`` counted from
    this server's own start."""
    if "messages" in body:
        top = body.get("top_logprobs") or 0
        return {"content": [
            {"token": t, "logprob": fake_logprob(first + i), "bytes": list(t.encode()),
             "top_logprobs": [{"token": a, "logprob": fake_logprob(first + i) - j, "bytes": list(a.encode())}
                              for j, a in enumerate([t, *(f"alt{j}" for j in range(1, top))][:top])]}
            for i, t in enumerate(tokens)]}
    top = body["logprobs"]
    start = 3 * first  # (every token of the fake's answer is 3 characters but the last)
    alts = [{a: fake_logprob(first + i) - j for j, a in enumerate([t, *(f"alt{j}" for j in range(1, top))])}
            if top else None for i, t in enumerate(tokens)]
    return {"tokens": tokens, "token_logprobs": [fake_logprob(first + i) for i in range(len(tokens))],
            "top_logprobs": alts,
            "text_offset": [start + 3 * i for i in range(len(tokens))]}


def fake_prompt_logprob(k: int) -> float | None:
    """The fake server's logprob for the prompt's ``k``-th token (a character): none for the
    first, which nothing came before (vLLM's null)."""
    return None if k == 0 else -round(0.5 + 0.01 * k, 3)


def echo_logprobs(body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """A completion's first ``logprobs`` with ``echo`` as vLLM sends them: the prompt's tokens
    (here its characters) first, then the answer's (``answer``), offsets from the prompt's
    start."""
    prompt, top = body["prompt"], body["logprobs"]
    n = len(prompt)
    alts = [None if k == 0 or not top else
            {c: fake_prompt_logprob(k), **{f"alt{j}": -9.0 - j for j in range(1, top)}}
            for k, c in enumerate(prompt)]
    return {"tokens": [*prompt, *answer["tokens"]],
            "token_logprobs": [*(fake_prompt_logprob(k) for k in range(n)), *answer["token_logprobs"]],
            "top_logprobs": [*alts, *answer["top_logprobs"]],
            "text_offset": [*range(n), *(n + o for o in answer["text_offset"])]}


def sse_chunk(text: str | None = None, finish: str | None = None,
              completion_tokens: int | None = None) -> bytes:
    """One completions SSE event: ``text``, a ``finish_reason``, the running usage."""
    c: dict[str, Any] = {"id": "x", "object": "text_completion", "model": "tiny",
                         "choices": [{"index": 0, "text": text or "", "finish_reason": finish}]}
    if completion_tokens is not None:
        c["usage"] = {"prompt_tokens": 5, "completion_tokens": completion_tokens,
                      "total_tokens": 5 + completion_tokens}
    return ("data: " + json.dumps(c) + "\n\n").encode()


def chat_chunk(content: str | None = None, reasoning: str | None = None, field: str = "reasoning",
               finish: str | None = None, completion_tokens: int | None = None,
               prompt_tokens: int = 5) -> bytes:
    """One chat SSE event as vLLM sends it with a reasoning parser: the answer's ``content``
    and (apart) the model's thinking under ``field``, a ``finish_reason``, the running usage
    (``prompt_tokens`` and ``completion_tokens``)."""
    delta: dict[str, Any] = {}
    if reasoning is not None:
        delta[field] = reasoning
    if content is not None:
        delta["content"] = content
    c: dict[str, Any] = {"id": "x", "object": "chat.completion.chunk", "model": "tiny",
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if completion_tokens is not None:
        c["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}
    return ("data: " + json.dumps(c) + "\n\n").encode()


def tool_chunk(calls: list[dict[str, Any]], finish: str | None = None,
               completion_tokens: int | None = None) -> bytes:
    """One chat SSE event as vLLM sends it with a tool parser: ``delta.tool_calls``, each
    ``{index, id?, type?, function: {name?, arguments?}}``; a ``finish_reason``, the running
    usage."""
    c: dict[str, Any] = {"id": "x", "object": "chat.completion.chunk", "model": "tiny",
                         "choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": finish}]}
    if completion_tokens is not None:
        c["usage"] = {"prompt_tokens": 5, "completion_tokens": completion_tokens,
                      "total_tokens": 5 + completion_tokens}
    return ("data: " + json.dumps(c) + "\n\n").encode()


async def end_stream(resp: web.StreamResponse, last: bytes) -> web.StreamResponse:
    """Write a scripted stream's last chunk and ``[DONE]`` (one write); returns ``resp``."""
    await resp.write(last + b"data: [DONE]\n\n")
    return resp


def hangs(end: asyncio.Event, after: bytes | None = None) -> Any:
    """A server script that sends its headers and nothing after them until ``end`` is set (an
    engine hung behind a live API server); with ``after``, its first call alone hangs and the
    later ones answer ``after`` and ``[DONE]``."""

    async def script(request: web.Request, body: dict[str, Any], n: int) -> web.StreamResponse:
        resp = await sse_response(request)
        if after is None or n == 1:
            await end.wait()
            return resp
        return await end_stream(resp, after)

    return script


def answers_then_holds_its_body(end_body: asyncio.Event, peers: list[Any] | None = None) -> Any:
    """A server script that answers "ok", finish and ``[DONE]``, then keeps the body open
    until ``end_body`` is set (a server, or a proxy before it, slow to end its body); each
    call's client address goes to ``peers``."""

    async def script(request: web.Request, body: dict[str, Any], n: int) -> web.StreamResponse:
        if peers is not None:
            assert request.transport is not None
            peers.append(request.transport.get_extra_info("peername"))
        resp = await sse_response(request)
        await resp.write(sse_chunk("ok", finish="stop", completion_tokens=1))
        await resp.write(b"data: [DONE]\n\n")
        await end_body.wait()
        return resp

    return script


def breaks_once(first: list[bytes], read: asyncio.Event, then: list[bytes]) -> Any:
    """A server script whose first call writes ``first``, waits for ``read`` (the test saw it
    pushed) and breaks the connection; each later call writes ``then`` and ends the stream."""

    async def script(request: web.Request, body: dict[str, Any], n: int) -> web.StreamResponse:
        resp = await sse_response(request)
        if n == 1:
            for chunk in first:
                await resp.write(chunk)
            await read.wait()
            assert request.transport is not None
            request.transport.abort()
            return resp
        for chunk in then[:-1]:
            await resp.write(chunk)
        return await end_stream(resp, then[-1])

    return script


async def sse_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return resp
