"""Several answers to one request as real clients ask for them, replayed byte for byte (with their
headers, Host and Content-Length left to the test client) through the frontend, Redis, the openai
worker and the fake model server, and read back as those clients read them.

lm-eval 0.4.13 ``local-completions`` with ``--batch_size 2`` / ``4`` (``num_concurrent=1``:
``requests``; ``2``: aiohttp), its prompts as token ids (the default; a pool counting in the
model server's tokenizer) or as text (``tokenized_requests=False``), tokenizer
deploy/make_bytetok.py's (an id a byte), ``custom_prefix_token_id=10``: the captured batch bodies
are in tests/data/lm_eval_batches.json with, for each loglikelihood prompt, lm-eval's ``ctxlen``
(its rolling windows' and its truncation at max_length 2047, from lm_eval.utils) and the sum of
the fake's ``fake_prompt_logprob`` lm-eval must read.

OpenAI's Python SDK 3.63.0 (``chat.completions.create(n=3)``, ``completions.create(prompt=[..],
n=2)``, with a seed), langchain-openai 1.8.1 (``ChatOpenAI(n=2)``'s
``generate``) and LiteLLM 1.110.2 (``completion(n=2)``, ``text_completion(prompt=[..], n=2)``); and the same
clients streaming them (``stream=True``: the SDK's ``create`` and ``stream()`` helper, LiteLLM's
``completion`` / ``text_completion`` read whole by ``stream_chunk_builder``, ``ChatOpenAI(n=2)``'s
``stream()``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from openai._models import construct_type
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from tests.support.fake_upstream import fake_prompt_logprob, fake_prompt_tokens
from tests.support.frontend_helpers import frontend, make_cfg, post_captured
from tests.support.sdk_headers import OPENAI_SDK, OPENAI_SDK_SYNC
from tests.support.worker_helpers import answered_through_openai_worker, worker
from tests.test_lm_eval_requests import parse_generations, parse_logprobs

BATCHES: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).parent / "data" / "lm_eval_batches.json").read_text())


def _pool(name: str, up: Any) -> dict[str, Any]:
    # (lm-eval's windows are 2047 tokens: a context that holds them, as a real model's)
    pool: dict[str, Any] = {"logprobs": True, "context_tokens": 65536}
    if name.startswith("ids"):
        pool.update(tokenizer="upstream", tokenizer_url=up.url)
    return pool


@pytest.mark.parametrize("name", [k for k in BATCHES if "generate" not in k])
async def test_lm_evals_batched_loglikelihoods_read_each_prompts_sum(redis_server, sync_redis, fake_upstream,
                                                                     name: str) -> None:
    """Each prompt of the batch a choice, in order: lm-eval zips them with its ctxlens."""
    case, up = BATCHES[name], fake_upstream
    prompts = [p if isinstance(p, str) else bytes(p).decode() for p in json.loads(case["body"])["prompt"]]
    cfg = make_cfg(redis_server.url, pool=_pool(name, up))
    out = await answered_through_openai_worker(cfg, up.url, "/v1/completions", case["body"].encode(),
                                               dict(case["headers"]))
    got = parse_logprobs(out, case["ctxlens"])
    assert len(got) == len(prompts) == len(case["expected"])
    for (logprob, is_greedy), prompt, ctxlen, expected in zip(got, prompts, case["ctxlens"],
                                                             case["expected"], strict=True):
        assert logprob == pytest.approx(expected)
        assert expected == pytest.approx(sum(fake_prompt_logprob(k) for k in range(ctxlen, len(prompt))))
        assert is_greedy is True
    assert [c["text"][:len(p)] for c, p in zip(out["choices"], prompts, strict=True)] == prompts
    assert [c["index"] for c in out["choices"]] == list(range(len(prompts)))
    # each prompt counted as the model server counts it: an id a token, a text in the fake's words + BOS
    counts = [len(p) if name.startswith("ids") else fake_prompt_tokens({"prompt": p}) for p in prompts]
    assert out["usage"]["prompt_tokens"] == sum(counts)
    assert len(up.bodies) == len(prompts) and all(b["max_tokens"] == 1 and b["echo"] for b in up.bodies)


@pytest.mark.parametrize("name", [k for k in BATCHES if "generate" in k])
async def test_lm_evals_batched_generate_until_reads_an_answer_a_prompt(redis_server, sync_redis,
                                                                        fake_upstream, name: str) -> None:
    case, up = BATCHES[name], fake_upstream
    prompts = [p if isinstance(p, str) else bytes(p).decode() for p in json.loads(case["body"])["prompt"]]
    cfg = make_cfg(redis_server.url, pool=_pool(name, up))
    out = await answered_through_openai_worker(cfg, up.url, "/v1/completions", case["body"].encode(),
                                               dict(case["headers"]))
    assert parse_generations(out) == [p[::-1][:24] for p in prompts]  # the fake's 8 tokens of 3
    assert all(b["stop"] == ["\n\n"] and b["seed"] == 1234 and "echo" not in b for b in up.bodies)


SDK = {**OPENAI_SDK_SYNC, "Authorization": "Bearer demo-p1", "x-stainless-retry-count": "0",
       "x-stainless-read-timeout": "600"}
LANGCHAIN = {**{k: v for k, v in SDK.items() if k != "x-stainless-read-timeout"},
             "x-stainless-raw-response": "true"}
LITELLM = {**SDK, "Accept-Encoding": "gzip, deflate, zstd", "x-stainless-raw-response": "true",
           "x-stainless-read-timeout": "600.0"}

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize(("path", "headers", "raw", "texts", "seeds", "usage"), [
    # openai SDK: chat.completions.create(n=3, seed=42) and without the seed
    (CHAT, SDK, b'{"model":"tiny","messages":[{"role":"user","content":"abcdef"}],"max_tokens":10,"n":3,'
     b'"seed":42}', ["fedcba"] * 3, [42, 43, 40], (4, 6)),
    (CHAT, SDK, b'{"model":"tiny","messages":[{"role":"user","content":"abcdef"}],"max_tokens":10,"n":3}',
     ["fedcba"] * 3, [None] * 3, (4, 6)),
    # openai SDK: completions.create(prompt=["abcdef", "ghi"], n=2, seed=42): each prompt's n in turn
    (COMPLETIONS, SDK, b'{"model":"tiny","prompt":["abcdef","ghi"],"max_tokens":10,"n":2,"seed":42}',
     ["fedcba", "fedcba", "ihg", "ihg"], [42, 43, 42, 43], (4, 6)),
    # langchain-openai: ChatOpenAI(n=2, max_tokens=10).generate(...)
    (CHAT, LANGCHAIN, b'{"model":"tiny","stream":false,"messages":[{"content":"abcdef","role":"user"}],'
     b'"max_completion_tokens":10,"n":2}', ["fedcba"] * 2, [None] * 2, (4, 4)),
    # litellm: completion(n=2) and text_completion(prompt=[...], n=2)
    (CHAT, LITELLM, b'{"model":"tiny","messages":[{"role":"user","content":"abcdef"}],"n":2,"max_tokens":10}',
     ["fedcba"] * 2, [None] * 2, (4, 4)),
    (COMPLETIONS, LITELLM, b'{"model":"tiny","prompt":["abcdef","ghi"],"max_tokens":10,"n":2}',
     ["fedcba", "fedcba", "ihg", "ihg"], [None] * 4, (4, 6)),
], ids=["sdk-chat-n3-seed", "sdk-chat-n3", "sdk-completions-2-prompts-n2-seed", "langchain-generate-n2",
        "litellm-completion-n2", "litellm-text-completion-2-prompts-n2"])
async def test_clients_asking_for_n_answers_read_n_choices(
        redis_server, sync_redis, fake_upstream, path: str, headers: dict[str, str], raw: bytes,
        texts: list[str], seeds: list[int | None], usage: tuple[int, int]) -> None:
    """What they read: ``choices[i]`` by its index (the SDK's models, LangChain's generations,
    LiteLLM's ModelResponse), each its text and finish_reason, and the usage summed (a chat's
    prompt counted once: 1 BOS + 1 word + 2 for its template)."""
    cfg, up = make_cfg(redis_server.url), fake_upstream
    out = await answered_through_openai_worker(cfg, up.url, path, raw, headers)
    chat = path == CHAT
    assert out["object"] == ("chat.completion" if chat else "text_completion") and out["model"] == "tiny"
    assert [c["index"] for c in out["choices"]] == list(range(len(texts)))
    assert [c["message"]["content"] if chat else c["text"] for c in out["choices"]] == texts
    assert all(c["finish_reason"] == "stop" for c in out["choices"])
    assert all(c["message"]["role"] == "assistant" for c in out["choices"]) if chat else True
    assert out["usage"] == {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                            "total_tokens": usage[0] + usage[1]}
    assert len(up.bodies) == len(texts) and all(b.get("n") in (None, 1) for b in up.bodies)
    # the copies of one prompt sample apart (seed ^ j), each prompt's the same
    got = sorted(((b.get("prompt") or b["messages"][-1]["content"]), b.get("seed") or 0) for b in up.bodies)
    want = sorted(zip([t[::-1] for t in texts], [s or 0 for s in seeds], strict=True))
    assert got == want


async def test_the_sdk_streams_several_answers_a_choice_each(redis_server, fake_upstream) -> None:
    """The OpenAI SDK itself, streaming: ``chat.completions.create(n=2, stream=True)`` read by
    its own accumulator (``ChatCompletionStreamState``, what its ``stream()`` helper builds the
    final completion with), the ``stream()`` helper, and ``completions.create`` with two
    prompts: every choice whole under its index, the usage summed with a prompt once."""
    cfg, up = make_cfg(redis_server.url), fake_upstream
    messages: list[Any] = [{"role": "user", "content": "abcdef"}]
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="demo-p1", max_retries=0)
        try:
            state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
            async for c in await sdk.chat.completions.create(
                    model="tiny", messages=messages, n=2, max_tokens=10, stream=True,
                    stream_options={"include_usage": True}):
                state.handle_chunk(c)
            created = state.get_final_completion()
            async with sdk.chat.completions.stream(model="tiny", messages=messages, n=3, max_tokens=10) as s:
                helper = await s.get_final_completion()
            texts: dict[int, str] = {}
            async for c in await sdk.completions.create(model="tiny", prompt=["abcdef", "ghi"], n=2,
                                                        max_tokens=10, stream=True):
                for ch in c.choices:
                    texts[ch.index] = texts.get(ch.index, "") + ch.text
        finally:
            await sdk.close()
    assert [(c.index, c.message.content, c.finish_reason) for c in created.choices] == \
        [(0, "fedcba", "stop"), (1, "fedcba", "stop")]
    usage = created.usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (4, 4)
    assert [(c.index, c.message.content) for c in helper.choices] == [(i, "fedcba") for i in range(3)]
    assert texts == {0: "fedcba", 1: "fedcba", 2: "ihg", 3: "ihg"}


# The same clients streaming several answers (``stream=True``), as captured from the calls below
# (the OpenAI SDK 3.63.0, LiteLLM 1.110.2 on it and on its own httpx client for ``hosted_vllm/``,
# langchain-openai 1.8.1); each row is what that client reads of the stream, checked live against
# the clients themselves.
def _async(headers: dict[str, str]) -> dict[str, str]:
    """The same call's headers from the SDK's async client."""
    return {**headers, **{k: OPENAI_SDK[k] for k in ("User-Agent", "x-stainless-async")}}


def _as_sdk_reads(model: Any, chunk: dict[str, Any]) -> Any:
    """A chunk as the SDK's stream makes it (its construct_type: no validation, as it reads)."""
    return construct_type(type_=model, value=chunk)


HELPER = {**SDK, "x-stainless-helper-method": "chat.completions.stream"}
LANGCHAIN_STREAM = {k: v for k, v in SDK.items() if k != "x-stainless-read-timeout"}
HOSTED_VLLM = {"Accept": "*/*", "Accept-Encoding": "gzip, deflate, zstd", "Connection": "keep-alive",
               "User-Agent": "litellm/1.110.2", "Authorization": "Bearer demo-p1",
               "Content-Type": "application/json"}
SDK_CHAT_N2 = (b'{"model":"tiny","stream":true,"messages":[{"role":"user","content":"abcdef"}],'
               b'"max_tokens":10,"n":2,"stream_options":{"include_usage":true}}')
SDK_PROMPTS_N2 = b'{"model":"tiny","stream":true,"prompt":["abcdef","ghi"],"max_tokens":10,"n":2'
LITELLM_CHAT_N2 = (b'{"model":"tiny","messages":[{"role":"user","content":"abcdef"}],"n":2,"max_tokens":10,'
                   b'"stream":true,"stream_options":{"include_usage":true}}')
LANGCHAIN_N2 = (b'{"model":"tiny","stream":true,"messages":[{"content":"abcdef","role":"user"}],'
                b'"max_completion_tokens":10,"n":2')
USAGE = b',"stream_options":{"include_usage":true}}'
CHAT_READ = {0: ("fedcba", "stop"), 1: ("fedcba", "stop")}
PROMPTS_READ = {0: ("fedcba", "stop"), 1: ("fedcba", "stop"), 2: ("ihg", "stop"), 3: ("ihg", "stop")}


@pytest.mark.parametrize(("path", "headers", "raw", "read", "usage"), [
    # openai SDK: chat.completions.create(n=2, stream=True, stream_options={"include_usage": True})
    (CHAT, SDK, SDK_CHAT_N2, CHAT_READ, (4, 4)),
    (CHAT, _async(SDK), SDK_CHAT_N2, CHAT_READ, (4, 4)),
    # openai SDK: chat.completions.stream(n=2, stream_options=...) (its helper, ChatCompletionStreamState)
    (CHAT, HELPER, SDK_CHAT_N2, CHAT_READ, (4, 4)),
    (CHAT, _async(HELPER), SDK_CHAT_N2, CHAT_READ, (4, 4)),
    # openai SDK: completions.create(prompt=["abcdef", "ghi"], n=2, stream=True), with and without the usage
    (COMPLETIONS, SDK, SDK_PROMPTS_N2 + USAGE, PROMPTS_READ, (4, 6)),
    (COMPLETIONS, _async(SDK), SDK_PROMPTS_N2 + USAGE, PROMPTS_READ, (4, 6)),
    (COMPLETIONS, SDK, SDK_PROMPTS_N2 + b"}", PROMPTS_READ, None),
    # litellm: completion / acompletion("openai/tiny", n=2, stream=True, stream_options=...), read
    # back whole by stream_chunk_builder; "hosted_vllm/tiny" (its own client, sync and async alike)
    (CHAT, LITELLM, LITELLM_CHAT_N2, CHAT_READ, (4, 4)),
    (CHAT, _async(LITELLM), LITELLM_CHAT_N2, CHAT_READ, (4, 4)),
    (CHAT, HOSTED_VLLM, b'{"model": "tiny", "messages": [{"role": "user", "content": "abcdef"}], "n": 2, '
     b'"stream": true, "stream_options": {"include_usage": true}, "max_tokens": 10}', CHAT_READ, (4, 4)),
    # litellm: text_completion / atext_completion(prompt=["abcdef", "ghi"], n=2, stream=True)
    (COMPLETIONS, LITELLM, SDK_PROMPTS_N2 + USAGE, PROMPTS_READ, (4, 6)),
    (COMPLETIONS, _async(LITELLM), SDK_PROMPTS_N2 + USAGE, PROMPTS_READ, (4, 6)),
    (COMPLETIONS, LITELLM, SDK_PROMPTS_N2 + b"}", PROMPTS_READ, None),
    # langchain-openai: ChatOpenAI(n=2, stream_usage=True).stream() / .astream(), and without the usage
    (CHAT, LANGCHAIN_STREAM, LANGCHAIN_N2 + USAGE, CHAT_READ, (4, 4)),
    (CHAT, _async(LANGCHAIN_STREAM), LANGCHAIN_N2 + USAGE, CHAT_READ, (4, 4)),
    (CHAT, LANGCHAIN_STREAM, LANGCHAIN_N2 + b"}", CHAT_READ, None),
], ids=["sdk-chat-create", "sdk-async-chat-create", "sdk-chat-stream-helper", "sdk-async-chat-stream-helper",
        "sdk-completions-2-prompts", "sdk-async-completions-2-prompts", "sdk-completions-2-prompts-no-usage",
        "litellm-completion", "litellm-acompletion", "litellm-hosted-vllm-completion",
        "litellm-text-completion", "litellm-atext-completion", "litellm-text-completion-no-usage",
        "langchain-stream", "langchain-astream", "langchain-stream-no-usage"])
async def test_clients_streaming_n_answers_read_each_choice(
        redis_server, sync_redis, fake_upstream, path: str, headers: dict[str, str], raw: bytes,
        read: dict[int, tuple[str, str]], usage: tuple[int, int] | None) -> None:
    """Each choice's text and finish_reason under its ``index`` (the SDK's accumulator, LiteLLM's
    stream_chunk_builder; LiteLLM's and LangChain's chunk handlers read ``choices[0]`` of each
    chunk: one choice a chunk), a chat's role chunk first for each, one id and time, and the usage
    summed on a last chunk of its own (none unasked), as vLLM streams them."""
    cfg, up = make_cfg(redis_server.url), fake_upstream
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        chunks, _ = await post_captured(client, path, raw, headers, "streaming client", streamed=True)
    assert chunks[-1] is None  # [DONE]
    chunks = chunks[:-1]
    chat = path == CHAT
    assert all(c["object"] == ("chat.completion.chunk" if chat else "text_completion") for c in chunks)
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    answers = [c for c in chunks if c["choices"]]
    assert all(len(c["choices"]) == 1 and not c.get("usage") for c in answers)
    if chat:
        state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
        for c in chunks:
            state.handle_chunk(_as_sdk_reads(ChatCompletionChunk, c))
        final = state.get_final_completion()
        got = {ch.index: (ch.message.content, ch.finish_reason) for ch in final.choices}
        assert all(ch.message.role == "assistant" for ch in final.choices)
        # the role chunks, one a choice, before any text
        assert [c["choices"][0]["delta"] for c in answers[:len(read)]] == \
            [{"role": "assistant", "content": ""}] * len(read)
        assert [c["choices"][0]["index"] for c in answers[:len(read)]] == list(range(len(read)))
        got_usage = final.usage
    else:
        texts: dict[int, str] = {}
        finish: dict[int, str] = {}
        got_usage = None
        for c in chunks:
            chunk = _as_sdk_reads(Completion, c)
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
                if ch.finish_reason:
                    assert ch.index not in finish, chunk
                    finish[ch.index] = ch.finish_reason
            got_usage = chunk.usage or got_usage
        got = {i: (texts[i], finish.get(i)) for i in texts}
    assert got == read
    # the usage once, on the last chunk, with no choices (LangChain's usage_metadata, LiteLLM's Usage)
    if usage is None:
        assert got_usage is None and all(c.get("usage") is None for c in chunks)
    else:
        assert chunks[-1]["choices"] == [] and got_usage is not None
        assert (got_usage.prompt_tokens, got_usage.completion_tokens, got_usage.total_tokens) == \
            (*usage, sum(usage))
    assert len(up.bodies) == len(read) and all(b.get("n") in (None, 1) for b in up.bodies)
