"""The openai engine on the wire: an error body read whole, an upstream URL with a query, a
character split over two chunks as JSON surrogate escapes (each found by a review, 2026-12-06)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from limiter.prompt import ChatMessage
from tests.support.fake_upstream import end_stream, sse_chunk, sse_response
from tests.support.helpers import wait_until
from tests.support.worker_helpers import start_worker, stop_worker, worker


@pytest.fixture
def env(worker_env, fake_upstream):
    return (*worker_env, fake_upstream)


async def _answer(env: tuple[Any, ...], name: str, script: Any, *, suffix: str = "", **admit: Any) -> Any:
    """One request whose prompt is ``name`` through an openai worker whose upstream answers
    it with ``script``; the request's answer (its text, or its error)."""
    cfg, c, up = env
    up.scripts[name] = script
    async with worker(cfg, engine="openai", upstream_url=up.url + suffix):
        rid = await c.admit(name, **{"max_tokens": 8, **admit})
        await c.wait([rid], timeout=20)
    return c.answers[rid]


def _split_json_error(status: int, message: str) -> Any:
    """A server script answering ``status`` with an OpenAI-style JSON error whose body comes
    in two writes (a proxy that forwards the body as it comes, or a body over two TCP
    segments): the worker reads it in two reads."""

    async def script(request: web.Request, body: dict[str, Any], n: int) -> web.StreamResponse:
        raw = json.dumps({"error": {"message": message, "type": "BadRequestError", "code": status}}).encode()
        resp = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        half = len(raw) // 2
        await resp.write(raw[:half])
        await asyncio.sleep(0.05)
        await resp.write(raw[half:])
        await resp.write_eof()
        return resp

    return script


async def test_an_error_body_that_comes_in_two_reads_is_read_whole(env) -> None:
    """_error_text read the error body with one ``content.read(limit)``, which returns what
    has come so far, not the body: a body in two reads was cut, its JSON failed to parse and
    the client read the reason phrase ("Bad Request") instead of the server's message."""
    message = "This model's maximum context length is 64 tokens"
    answer = await _answer(env, "SPLIT400", _split_json_error(400, message))
    assert answer.error["msg"] == f"the model server refused the request (HTTP 400): {message}"


async def test_a_priority_refusal_that_comes_in_two_reads_is_sent_again_without_it(env) -> None:
    """vLLM left first come, first served refuses a non-zero priority; the worker recognises
    the refusal by its text. With the body in two reads the text was "Bad Request": every
    request of a class but the top one was refused (its client answered 400) instead of
    being sent again without `priority`."""

    async def script(request: web.Request, body: dict[str, Any], n: int) -> web.StreamResponse:
        if body.get("priority"):
            return await _split_json_error(400, f"Got priority {body['priority']} but Priority "
                                                "scheduling is not enabled.")(request, body, n)
        resp = await sse_response(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}], '
                         b'"usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\ndata: [DONE]\n\n')
        return resp

    answer = await _answer(env, "PRIOSPLIT", script, cls="P2")
    assert answer.error is None, answer.error
    assert answer.text == "ok"


@pytest.mark.parametrize("suffix", ["/v1?api-key=k", "?api-key=k"])
async def test_an_upstream_url_with_a_query_reaches_the_servers_endpoints_with_it(env, suffix) -> None:
    """An upstream_url may carry a query (a gateway's `?api-key=`: the settings show it as
    `?***`), but the worker appended its paths to the whole URL: the query swallowed them
    ("...?api-key=k/v1/completions" posts to "/v1" or "/"), and every request failed (404)."""
    seen: list[tuple[str, str]] = []

    async def records_query(request: web.Request, body: dict[str, Any], n: int) -> web.StreamResponse:
        seen.append((request.path, request.query.get("api-key", "")))
        resp = await sse_response(request)
        return await end_stream(resp, sse_chunk("fine", finish="stop", completion_tokens=1))

    answer = await _answer(env, "QUERY", records_query, suffix=suffix, max_tokens=5)
    assert answer.error is None, answer.error
    assert answer.text == "fine"
    assert seen == [("/v1/completions", "k")]


async def test_a_character_split_between_two_chunks_as_json_surrogate_escapes_is_delivered(env) -> None:
    """JSON may write a character outside the BMP as two \\u escapes (a surrogate pair), and a
    server that slices its text in UTF-16 units (a JavaScript gateway, say) may put the two
    halves in two chunks. Each half alone is no character: the worker failed the request
    ("internal error in the worker") instead of delivering the character."""

    async def split_pair(request: web.Request, body: dict[str, Any], n: int) -> web.StreamResponse:
        resp = await sse_response(request)
        for piece in ("a\ud83d", "\ude00b"):  # JSON writes each half as its \u escape
            await resp.write(sse_chunk(piece))
            await asyncio.sleep(0.02)
        return await end_stream(resp, sse_chunk("", finish="stop", completion_tokens=2))

    answer = await _answer(env, "SURROGATE", split_pair)
    assert answer.error is None, answer.error
    assert answer.text == "a\U0001F600b"


@pytest.mark.parametrize("choices", ['["x"]', '{"text": "x"}', '[{"index": 0, "delta": "x"}]',
                                     '[{"index": 0, "text": "x", "finish_reason": 7}]'])
async def test_a_chunk_whose_choices_are_not_objects_is_a_malformed_response(env, choices: str) -> None:
    """A chunk whose `choices` is no list of objects (or a choice's `delta` no object, its
    finish_reason no string) raised AttributeError inside the stream's loop: the client read
    "internal error in the worker" where a server's broken stream is "malformed response"."""
    async def broken(request: web.Request, body: dict[str, Any], n: int) -> web.StreamResponse:
        resp = await sse_response(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "ok", "finish_reason": null}]}\n\n')
        await resp.write(b'data: {"choices": ' + choices.encode() + b"}\n\ndata: [DONE]\n\n")
        return resp

    chat = {"kind": "chat", "messages": (ChatMessage("user", "BROKEN"),)} if "delta" in choices else {}
    error = (await _answer(env, "BROKEN", broken, **chat)).error
    assert error["msg"] == "the model server sent a malformed response", error


RETRY = {"upstream_retry_min_s": 0.1, "upstream_retry_max_s": 0.4}


@pytest.mark.parametrize("status", [401, 403])
async def test_a_rotated_key_hands_the_request_back_and_stops_claiming_until_the_key_is_taken(
        env, status: int, caplog) -> None:
    """A 401/403 refuses the worker's key (QOS_UPSTREAM_API_KEY), not the request: the
    breaker opens (no claim) and the request goes back to the queue, for a worker whose key
    works, or this one once its probe's one-token generation is taken with the key (its
    /health asks for none). Failed instead, a rotated key made the worker fail every request
    it claimed, in milliseconds each: it took more of the queue than any other worker. The
    server's words (OpenAI's names the key, masked but for its last four characters) stay in
    the log."""
    cfg, c, up = env
    up.status = status  # every generation refused, the probe's too
    rt, loop, task = await start_worker(cfg, engine="openai", upstream_url=up.url, **RETRY)
    try:
        rid = await c.admit("hello", max_tokens=8)
        await wait_until(lambda: loop.breaker.state == "open", "the breaker open on the refused key")
        await wait_until(lambda: loop.breaker.probes >= 2, "two probes refused with the key")
        answer = c.answers[rid]
        assert loop.breaker.state == "open" and answer.done is None and answer.error is None  # not failed
        assert (await c.record(rid))["state"] == "queued"
        # sent once: no claim while the probes' generations were refused with the key
        sent = [b for b in up.bodies if b.get("prompt") != "ping" and b.get("messages") is None]
        assert len(sent) == 1 and len(up.bodies) > 1, up.bodies
        up.status = None  # the key mended
        await c.wait([rid], timeout=20)
    finally:
        assert await stop_worker(rt, task) is None
    assert c.answers[rid].error is None and c.answers[rid].text
    assert f"refuses the worker's credentials (HTTP {status})" in caplog.text


@pytest.mark.parametrize("status", [401, 403])
async def test_a_key_refused_for_one_prompt_fails_it_after_its_attempts_without_the_servers_words(
        env, status: int, caplog) -> None:
    """A key refused for one request only (a proxy's policy) while the probe's generation is
    taken: each refusal spends an attempt, so the request fails after max_attempts rather than
    going round for ever; its client never reads the server's words."""
    cfg, c, up = env
    up.scripts["KEYFAIL"] = _split_json_error(status, "Incorrect API key provided: sk-...abcd")
    async with worker(cfg, engine="openai", upstream_url=up.url, **RETRY):
        rid = await c.admit("KEYFAIL", max_tokens=8)
        await c.wait([rid], timeout=30)
    error = c.answers[rid].error
    assert error is not None and error["code"] == "exhausted", error
    assert up.calls["KEYFAIL"] == cfg.pools[0].max_attempts
    assert "sk-...abcd" not in json.dumps(error) and "sk-...abcd" in caplog.text


async def test_a_whole_json_answer_where_a_stream_was_asked_says_so(env) -> None:
    """A server (or a proxy before it) that ignores `stream` answers 200 with the whole
    completion as JSON. The request fails (the worker relays streams), but the client read
    "the model server answered without a stream: OK", the body's reason phrase."""

    async def whole(request: web.Request, body: dict[str, Any], n: int) -> web.StreamResponse:
        return web.json_response({"id": "c1", "object": "text_completion", "choices": [
            {"index": 0, "text": "all at once", "finish_reason": "stop"}]})

    msg = (await _answer(env, "WHOLE", whole)).error["msg"]
    assert msg.startswith("the model server answered without a stream: a whole answer"), msg


async def test_a_lone_high_surrogate_that_ends_the_answer_is_delivered_as_a_replacement(env) -> None:
    """A high surrogate is held for the next chunk's low half; one that ends the answer (its
    chunk carries the finish_reason) has no next chunk: it was dropped without a trace,
    where a lone half is promised as U+FFFD."""

    async def lone_end(request: web.Request, body: dict[str, Any], n: int) -> web.StreamResponse:
        resp = await sse_response(request)
        return await end_stream(resp, sse_chunk("a\ud83d", finish="stop", completion_tokens=1))

    answer = await _answer(env, "LONEEND", lone_end)
    assert answer.error is None, answer.error
    assert answer.text == "a\ufffd"


async def test_an_event_of_endless_data_lines_is_refused_not_buffered(env) -> None:
    """A line past MAX_SSE_LINE is refused, but an event is its data lines up to a blank line:
    a server (or proxy) that ends each chunk with one newline, not two, made one event of the
    whole stream, its lines kept until the stream ended -- a stream that never ends held
    ever more of the worker's memory (found by a review). It is refused at the same bound."""
    from worker.sse_events import MAX_SSE_LINE

    end = asyncio.Event()
    chunk = {"choices": [{"index": 0, "text": "x" * 200, "finish_reason": None}]}
    line = b"data: " + json.dumps(chunk).encode()

    async def no_blank_lines(request: web.Request, body: dict[str, Any], n: int) -> web.StreamResponse:
        resp = await sse_response(request)
        block = (line + b"\n") * (64 * 1024 // len(line))
        sent = 0
        while sent < 3 * MAX_SSE_LINE:
            await resp.write(block)
            sent += len(block)
        await end.wait()  # and never ends
        return resp

    try:
        answer = await _answer(env, "NOBLANK", no_blank_lines)
    finally:
        end.set()
    assert answer.error is not None, answer
    assert answer.error["msg"] == "the model server sent a malformed response", answer
