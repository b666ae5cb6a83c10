"""The openai engine against a small fake OpenAI-compatible upstream (a real aiohttp server
on 127.0.0.1 speaking the streaming format, with a final usage chunk)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp import web

from limiter.prompt import render_chat
from tests.redis_server import free_port
from tests.worker_helpers import worker
from worker.upstream import parse_chat


class FakeUpstream:
    """Answers with the prompt (or last user message) reversed, 3 characters per chunk.
    Prompts containing FAIL get HTTP 400, MIDERR an error chunk, SLOW 40 ms per chunk."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.active = 0
        self.max_active = 0
        self.disconnects = 0
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app)
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL" in prompt:
            return web.json_response({"error": {"message": "model is overloaded", "type": "server_error",
                                                "code": 400}}, status=400)
        answer = prompt[::-1]
        pieces = [answer[i: i + 3] for i in range(0, len(answer), 3)]
        finish = "stop"
        if len(pieces) > body["max_tokens"]:
            pieces, finish = pieces[: body["max_tokens"]], "length"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.active += 1
        self.max_active = max(self.max_active, self.active)

        async def send(obj: Any) -> None:
            await resp.write(f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode())

        try:
            for n, p in enumerate(pieces):
                if "SLOW" in prompt:
                    await asyncio.sleep(0.04)
                if "MIDERR" in prompt and n == 2:
                    await send({"error": {"message": "CUDA out of memory"}})
                    return resp
                choice = ({"index": 0, "delta": {"content": p}, "finish_reason": None} if chat
                          else {"index": 0, "text": p, "finish_reason": None})
                await send({"id": "x", "choices": [choice]})
            last = {"index": 0, "delta": {}, "finish_reason": finish} if chat else {
                "index": 0, "text": "", "finish_reason": finish}
            await send({"id": "x", "choices": [last]})
            if (body.get("stream_options") or {}).get("include_usage"):
                await send({"id": "x", "choices": [], "usage": {"prompt_tokens": 7,
                                                                "completion_tokens": len(pieces)}})
            await send("[DONE]")
        except (ConnectionError, asyncio.CancelledError):  # the worker closed the stream
            self.disconnects += 1
            raise
        finally:
            self.active -= 1
        return resp


@pytest.fixture
async def env(worker_env):
    up = FakeUpstream()
    await up.start()
    yield (*worker_env, up)
    await up.runner.cleanup()


def test_parse_chat_inverts_render_chat() -> None:
    msgs = [("system", "be brief"), ("user", "hi\nthere"), ("assistant", "hello"), ("user", "again")]
    assert parse_chat(render_chat(msgs)) == [{"role": r, "content": c} for r, c in msgs]
    assert parse_chat("plain completion prompt") is None


async def test_streams_completion_and_chat_with_usage_priority_and_limits(env) -> None:
    cfg, c, up = env
    async with worker(cfg, engine="openai", upstream_url=up.url, flush_tokens=4):
        plain = await c.admit("Grüße aus Köln, hello world", cls="P2", max_tokens=100, seed=None)
        cut = await c.admit("0123456789abcdefghij", cls="P0", max_tokens=10)
        chat_prompt = render_chat([("system", "sys"), ("user", "chat with me")])
        chat = await c.admit(chat_prompt, max_tokens=50, kind="chat")
        await c.wait(timeout=20)
    a = c.answers[plain]
    assert a.text == "Grüße aus Köln, hello world"[::-1] and a.done["fin"] == "stop"
    assert a.tokens == len(a.text.encode()) == int(a.done["out"])  # byte-level ids: honest counts
    assert c.answers[cut].text == "jihgfedcba" and c.answers[cut].done["fin"] == "length"
    assert c.answers[cut].tokens == 10
    assert c.answers[chat].text == "em htiw tahc"
    by_prompt = {b.get("prompt") or b["messages"][-1]["content"]: b for b in up.bodies}
    b = by_prompt["Grüße aus Köln, hello world"]
    assert b["stream"] and b["stream_options"] == {"include_usage": True} and b["priority"] == 2
    assert isinstance(b["seed"], int) and b["max_tokens"] == 100
    assert by_prompt["0123456789abcdefghij"]["priority"] == 0
    assert by_prompt["chat with me"]["messages"][0] == {"role": "system", "content": "sys"}
    samples = {s["request_id"]: s for s in await c.samples()}
    s = samples[plain]
    assert s["engine"] == "openai" and s["upstream_completion_tokens"] == 9
    assert s["upstream_prompt_tokens"] == 7
    assert s["output_tokens"] == a.tokens and s["outcome"] == "ok" and s["ttft_ms"] > 0


async def test_upstream_errors_fail_the_request_with_a_clear_message(env) -> None:
    cfg, c, up = env
    async with worker(cfg, engine="openai", upstream_url=up.url):
        bad = await c.admit("please FAIL", max_tokens=20)
        mid = await c.admit("a MIDERR b c d e f g h", max_tokens=50)
        await c.wait(timeout=20)
    assert "HTTP 400" in c.answers[bad].error["msg"] and "overloaded" in c.answers[bad].error["msg"]
    assert "CUDA out of memory" in c.answers[mid].error["msg"]
    assert (await c.record(bad))["state"] == "failed" and (await c.record(mid))["state"] == "failed"
    async with worker(cfg, engine="openai", upstream_url=f"http://127.0.0.1:{free_port()}"):
        gone = await c.admit("anyone there?", max_tokens=20)
        await c.wait([gone], timeout=20)
    assert "unreachable" in c.answers[gone].error["msg"]


async def test_max_inflight_bounds_the_upstream_and_cancel_closes_the_stream(env) -> None:
    cfg, c, up = env
    async with worker(cfg, engine="openai", upstream_url=up.url, max_inflight=2):
        ids = [await c.admit(f"SLOW request number {i}", max_tokens=100) for i in range(4)]
        victim = await c.admit("SLOW " + "x" * 200, max_tokens=500)
        await c.wait(ids, timeout=20)
        await c.wait_tokens(victim, 3)
        assert await c.scripts.cancel(c.keys, victim, "t1") == "cancelling"
        deadline = time.monotonic() + 5
        while (await c.record(victim))["state"] != "cancelled":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        while not up.disconnects:  # the upstream notices at its next write
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
    assert up.max_active == 2
    assert all(c.answers[r].done["fin"] == "stop" for r in ids)
