"""Token logprobs as the client libraries people use ask for them and read them: the exact
requests of the OpenAI SDK 3.63.0 (``chat.completions.create(logprobs=True,
top_logprobs=3)`` streamed and not, the ``chat.completions.stream()`` helper,
``completions.create(logprobs=2)`` streamed and not), LangChain (``langchain-openai`` 1.8.1,
``langchain-core`` 1.8.3: ``ChatOpenAI(logprobs=True, top_logprobs=2)`` invoke and stream,
with ``stream_usage``, ``.bind(logprobs=True)``, the completions ``OpenAI(logprobs=2)``) and
LiteLLM 1.110.2 (``litellm.acompletion(model="openai/...", logprobs=True,
top_logprobs=2)`` streamed and not, ``litellm.atext_completion(logprobs=2)``), each over the
SDK's httpx transport.

The bodies and headers were captured from those clients, run against a recording proxy in
front of a logprobs pool (Python 3.11.7), and are replayed byte for byte through the real
frontend, a private redis-server and the openai worker to the fake model server: each is
accepted, reaches the model server with its logprobs fields, and is answered in the shape
those clients were seen to parse. Run live, each of them read our answers' tokens,
logprobs, bytes, alternatives and offsets as the model server sent them: the SDK's own types
and its stream helper's ``logprobs.content.delta`` events and ``get_final_completion()``,
LangChain's ``response_metadata["logprobs"]`` (its streamed chunks' merged by ``+``) and
``generation_info["logprobs"]``, LiteLLM's ``ChoiceLogprobs`` / ``Logprobs`` (its streamed
chat chunks' too), but for two things LiteLLM drops on its side, whatever the server (the
same straight against the vLLM-shaped fake model server): ``litellm.stream_chunk_builder``
builds a chat choice without ``logprobs`` (it merges text, tool calls and usage, never
logprobs), and ``atext_completion(stream=True)`` yields chunks whose ``logprobs`` is None
(its TextCompletionStreamWrapper copies text and finish_reason alone)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from limiter.localstack.sse import sse_chunks
from tests.support.fake_upstream import fake_logprob
from tests.support.frontend_helpers import frontend, make_cfg
from tests.support.sdk_headers import OPENAI_SDK
from tests.support.worker_helpers import worker

KEY = "demo-p1"
# The OpenAI SDK's headers (LangChain and LiteLLM send through it)
SDK = {**OPENAI_SDK, "x-stainless-retry-count": "0"}
SDK_PLAIN = {**SDK, "x-stainless-read-timeout": "600"}
SDK_STREAM = {**SDK_PLAIN, "x-stainless-helper-method": "chat.completions.stream"}
LANGCHAIN = {**SDK, "x-stainless-raw-response": "true"}  # unstreamed (streamed: SDK's alone)
LANGCHAIN_SYNC = {**SDK, "User-Agent": "OpenAI/Python 3.63.0", "x-stainless-async": "false"}
LITELLM = {**LANGCHAIN, "Accept-Encoding": "gzip, deflate, zstd", "x-stainless-read-timeout": "600.0"}
LITELLM_SYNC = {**LITELLM, "User-Agent": "OpenAI/Python 3.63.0", "x-stainless-async": "false"}

ASK = "abcdefghijklmno"
TOKENS = ["onm", "lkj", "ihg", "fed", "cba"]  # the fake model server's answer to ASK
OA_USER = {"role": "user", "content": ASK}
LC_USER = {"content": ASK, "role": "user"}  # LangChain's key order
# LangChain's completions OpenAI(logprobs=2, max_tokens=40): every default it writes
LC_LLM = {"frequency_penalty": 0, "logprobs": 2, "max_tokens": 40, "n": 1, "presence_penalty": 0,
          "seed": None, "temperature": 0.7, "top_p": 1}
USAGE = {"include_usage": True}

OA, LC, LL = "openai-3.63.0", "langchain-openai-1.8.1", "litellm-1.110.2"
CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
# (client and what it did, path, headers, body as the client serialises it (key order kept))
REPLAYS: list[tuple[str, str, dict[str, str], dict[str, Any]]] = [
    (f"{OA}-chat-create", CHAT, SDK_PLAIN,
     {"model": "tiny", "messages": [OA_USER], "logprobs": True, "top_logprobs": 3}),
    (f"{OA}-chat-create-streamed", CHAT, SDK_PLAIN,
     {"model": "tiny", "stream": True, "messages": [OA_USER], "logprobs": True, "top_logprobs": 3}),
    (f"{OA}-chat-stream-helper", CHAT, SDK_STREAM,
     {"model": "tiny", "stream": True, "messages": [OA_USER], "logprobs": True, "top_logprobs": 3}),
    (f"{OA}-completions-create", COMPLETION, SDK_PLAIN, {"model": "tiny", "prompt": ASK, "logprobs": 2}),
    (f"{OA}-completions-create-streamed", COMPLETION, SDK_PLAIN,
     {"model": "tiny", "stream": True, "prompt": ASK, "logprobs": 2}),
    (f"{LC}-ChatOpenAI-invoke", CHAT, LANGCHAIN,
     {"model": "tiny", "stream": False, "messages": [LC_USER], "logprobs": True, "top_logprobs": 2}),
    (f"{LC}-ChatOpenAI-astream", CHAT, SDK,
     {"model": "tiny", "stream": True, "messages": [LC_USER], "logprobs": True, "top_logprobs": 2}),
    (f"{LC}-ChatOpenAI-stream-sync", CHAT, LANGCHAIN_SYNC,
     {"model": "tiny", "stream": True, "messages": [LC_USER], "logprobs": True, "top_logprobs": 2}),
    (f"{LC}-ChatOpenAI-stream_usage", CHAT, SDK,
     {"model": "tiny", "stream": True, "messages": [LC_USER], "logprobs": True, "stream_options": USAGE,
      "top_logprobs": 2}),
    (f"{LC}-bind-logprobs-invoke", CHAT, LANGCHAIN,
     {"model": "tiny", "stream": False, "messages": [LC_USER], "logprobs": True}),
    (f"{LC}-bind-logprobs-astream", CHAT, SDK,
     {"model": "tiny", "stream": True, "messages": [LC_USER], "logprobs": True}),
    (f"{LC}-OpenAI-completion-generate", COMPLETION, SDK,
     {"model": "tiny", "prompt": [ASK], **LC_LLM}),
    (f"{LC}-OpenAI-completion-astream", COMPLETION, SDK,
     {"model": "tiny", "stream": True, "prompt": ASK, **LC_LLM}),
    (f"{LL}-acompletion", CHAT, LITELLM,
     {"model": "tiny", "messages": [OA_USER], "logprobs": True, "top_logprobs": 2}),
    (f"{LL}-acompletion-logprobs-alone", CHAT, LITELLM,
     {"model": "tiny", "messages": [OA_USER], "logprobs": True}),
    (f"{LL}-completion-sync", CHAT, LITELLM_SYNC,
     {"model": "tiny", "messages": [OA_USER], "logprobs": True, "top_logprobs": 2}),
    (f"{LL}-acompletion-streamed", CHAT, LITELLM,
     {"model": "tiny", "messages": [OA_USER], "logprobs": True, "top_logprobs": 2, "stream": True}),
    (f"{LL}-acompletion-streamed-usage", CHAT, LITELLM,
     {"model": "tiny", "messages": [OA_USER], "logprobs": True, "top_logprobs": 2, "stream": True,
      "stream_options": USAGE}),
    (f"{LL}-atext_completion", COMPLETION, LITELLM, {"model": "tiny", "prompt": ASK, "logprobs": 2}),
    (f"{LL}-atext_completion-streamed", COMPLETION, LITELLM,
     {"model": "tiny", "stream": True, "prompt": ASK, "logprobs": 2}),
]

ENTRY_KEYS = {"token", "logprob", "bytes", "top_logprobs"}
ALT_KEYS = {"token", "logprob", "bytes"}


def _chat_entries_ok(entries: list[dict[str, Any]], top: int, first: int = 0) -> None:
    """A chat's ``logprobs.content``: the fake's tokens from the ``first``-th, each with its
    logprob, its UTF-8 bytes and ``top`` alternatives (itself first, then alt1...), in OpenAI's
    keys and no others (the SDK's models, LangChain's dicts and LiteLLM's ChoiceLogprobs read
    these)."""
    assert [e["token"] for e in entries] == TOKENS[first:first + len(entries)]
    for k, e in enumerate(entries, first):
        assert set(e) == ENTRY_KEYS
        assert e["logprob"] == fake_logprob(k) and e["bytes"] == list(e["token"].encode())
        alts = [e["token"], *(f"alt{j}" for j in range(1, top))][:top]
        assert [a["token"] for a in e["top_logprobs"]] == alts
        assert all(set(a) == ALT_KEYS and a["bytes"] == list(a["token"].encode()) for a in e["top_logprobs"])
        assert [a["logprob"] for a in e["top_logprobs"]] == [fake_logprob(k) - j for j in range(top)]


def _completion_logprobs_ok(lp: dict[str, Any], top: int, tokens: list[str], first: int = 0) -> None:
    """A completion's arrays for ``tokens`` (the answer's ``first``-th on): offsets over the
    whole answer, ``top`` alternatives a token as a {token: logprob} object."""
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert lp["tokens"] == tokens
    assert lp["token_logprobs"] == [fake_logprob(first + i) for i in range(len(tokens))]
    assert lp["text_offset"] == [3 * (first + i) for i in range(len(tokens))]
    assert [list(a) for a in lp["top_logprobs"]] == [[t, *(f"alt{j}" for j in range(1, top))] for t in tokens]


@pytest.mark.parametrize("client,path,headers,body", REPLAYS, ids=[r[0] for r in REPLAYS])
async def test_client_logprobs_requests_replayed(redis_server, sync_redis, fake_upstream, client, path,
                                                 headers, body):
    cfg = make_cfg(redis_server.url, pool={"logprobs": True})
    raw = json.dumps(body, separators=(",", ":")).encode()  # as the SDK's httpx writes it
    chat = path == CHAT
    streamed = bool(body.get("stream"))
    async with frontend(cfg) as http, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        if streamed:
            # the model server's chunks come apart (each waits until the client read the one
            # before): every token's logprobs reach the client in a chunk of their own text
            fake_upstream.gate = asyncio.Semaphore(0)
        r = await http.post(path, data=raw, headers={**headers, "Authorization": f"Bearer {KEY}"})
        assert r.status == 200, (client, await r.text())
        if streamed:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            chunks: list[dict[str, Any] | None] = []
            async for ch in sse_chunks(r.content):
                chunks.append(ch)
                c = (ch or {}).get("choices") or [{}]
                if (c[0].get("delta") or {}).get("content") or c[0].get("text"):
                    fake_upstream.gate.release()
        else:
            whole = await r.json()

    # what reached the model server: the logprobs fields as vLLM takes them
    (up,) = fake_upstream.bodies
    if chat:
        assert up["logprobs"] is True
        assert up.get("top_logprobs") == body.get("top_logprobs")
        top = body.get("top_logprobs") or 0
    else:
        assert up["logprobs"] == body["logprobs"]
        top = body["logprobs"]
    assert up.get("stream_options", {}).get("include_usage") is True  # (the worker's own)
    assert "".join(TOKENS) == ASK[::-1]

    if not streamed:
        (choice,) = whole["choices"]
        assert choice["finish_reason"] == "stop"
        if chat:
            assert choice["message"] == {"role": "assistant", "content": ASK[::-1]}
            assert set(choice["logprobs"]) == {"content"}
            _chat_entries_ok(choice["logprobs"]["content"], top)
            sdk = ChatCompletion.model_validate(whole)  # the SDK's own types (LiteLLM's and LangChain's too)
            assert [e.token for e in sdk.choices[0].logprobs.content] == TOKENS
        else:
            assert choice["text"] == ASK[::-1]
            _completion_logprobs_ok(choice["logprobs"], top, TOKENS)
            assert Completion.model_validate(whole).choices[0].logprobs.tokens == TOKENS
        return

    # streamed: one id, every token once, in a chunk of its own text; the role opener and
    # the finish chunk with a null logprobs; the usage chunk (asked) with no choices
    assert chunks[-1] is None  # [DONE]
    events = [c for c in chunks[:-1] if c is not None]
    assert len({c["id"] for c in events}) == 1
    with_choices = [c for c in events if c["choices"]]
    fins = [c["choices"][0]["finish_reason"] for c in with_choices]
    assert fins[-1] == "stop" and all(f is None for f in fins[:-1])
    assert with_choices[-1]["choices"][0]["logprobs"] is None
    if (body.get("stream_options") or {}).get("include_usage"):
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(TOKENS)
    if chat:
        deltas = [c["choices"][0] for c in with_choices]
        assert deltas[0]["delta"]["role"] == "assistant" and deltas[0]["logprobs"] is None
        texts = [d for d in deltas if d["delta"].get("content")]
        assert [d["delta"]["content"] for d in texts] == TOKENS
        seen: list[dict[str, Any]] = []
        for d in texts:
            assert set(d["logprobs"]) == {"content"}
            assert "".join(e["token"] for e in d["logprobs"]["content"]) == d["delta"]["content"]
            _chat_entries_ok(d["logprobs"]["content"], top, len(seen))
            seen += d["logprobs"]["content"]
        assert all(d["logprobs"] is None for d in deltas if not d["delta"].get("content"))
        # the SDK's stream helper, as chat.completions.stream() runs it over these chunks
        state = ChatCompletionStreamState()
        kinds: set[str] = set()
        for c in events:
            kinds |= {e.type for e in state.handle_chunk(ChatCompletionChunk.model_validate(c))}
        final = state.get_final_completion()
        assert {"logprobs.content.delta", "logprobs.content.done"} <= kinds
        assert final.choices[0].message.content == ASK[::-1]
        assert [e.model_dump() for e in final.choices[0].logprobs.content] == seen
    else:
        texts = [c["choices"][0] for c in with_choices if c["choices"][0]["text"]]
        assert [c["text"] for c in texts] == TOKENS
        for k, c in enumerate(texts):
            _completion_logprobs_ok(c["logprobs"], top, [TOKENS[k]], k)
        # as the SDK builds its stream's items (construct: a chunk's null finish_reason is
        # none of its Literal's values)
        sdk = [Completion.construct(**c).choices for c in events]
        assert [t for ch in sdk if ch and ch[0].logprobs for t in ch[0].logprobs.tokens] == TOKENS
