"""lm-evaluation-harness's ``local-completions`` requests, replayed byte for byte through the
frontend, Redis, the openai worker and the fake model server, and read back with lm-eval's
own parse.

Captured from lm-eval 0.4.13 (``lm_eval --model local-completions --model_args
model=tiny,base_url=.../v1/completions,tokenized_requests=False,tokenizer_backend=huggingface,
tokenizer=<deploy/make_bytetok.py's directory>,...`` with ``OPENAI_API_KEY=demo-p1``): its
bodies are ``json.dumps`` of the payload (", " and ": " separators), sent by ``requests``
with ``num_concurrent=1`` and by aiohttp above it, with the headers below (Host and
Content-Length left to the client). The loglikelihood of a continuation is
``sum(token_logprobs[ctxlen:-1])``: the echoed prompt's tokens from the context's length on,
the one generated token left out; ``ctxlen`` is the context's token count in lm-eval's
tokenizer, here one a character as the fake server's echo (ASCII text, no BOS: lm-eval's
``add_bos_token`` defaults to false).

lm-eval's default, ``tokenized_requests=True``, sends the same requests with the prompt as
token ids in a batch of one (``[[int]]``), served by a pool that counts in its model's
tokenizer (here the fake's ``/tokenize``): captured with the same command less
``tokenized_requests=False`` (the byte tokenizer: an id a byte, as the fake decodes them). A
rolling window's first token is lm-eval's prefix token, the tokenizer's BOS or else its EOS:
this one has neither, so it sends null (refused, saying so) unless given
``custom_prefix_token_id`` (here 10, "\n"). With ``batch_size=2`` it sends two prompts in one
request, which the service refuses."""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any

import pytest

from tests.support.fake_upstream import fake_prompt_logprob
from tests.support.frontend_helpers import frontend, make_cfg
from tests.support.worker_helpers import answered_through_openai_worker, worker

SYNC_HEADERS = {"User-Agent": "python-requests/2.34.2", "Accept-Encoding": "gzip, deflate", "Accept": "*/*",
                "Connection": "keep-alive", "Authorization": "Bearer demo-p1",
                "Content-Type": "application/json"}
ASYNC_HEADERS = {"Authorization": "Bearer demo-p1", "Accept": "*/*", "Accept-Encoding": "gzip, deflate",
                 "User-Agent": "Python/3.11 aiohttp/3.14.5", "Content-Type": "application/json"}

# a multiple_choice task's request (doc_to_text "Question: {{question}}\nAnswer:", the choice
# after lm-eval's target_delimiter " "), and a loglikelihood_rolling one's first window (its
# context the prefix token, here custom_prefix_token_id=198: "\n" in the byte-level tokenizer)
MC = (b'{"model": "tiny", "prompt": "Question: What is 2+2?\\nAnswer: four", "temperature": 0, '
      b'"max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}')
ROLLING = (b'{"model": "tiny", "prompt": "\\nHello world, this is a short page.", "temperature": 0, '
           b'"max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}')
GENERATE = (b'{"prompt": "Q: What is 2+2? A:", "model": "tiny", "max_tokens": 8, "temperature": 0, '
            b'"stop": ["\\n\\n"], "seed": 1234}')


# lm-eval's token-id requests (the default, tokenized_requests=True), captured byte for byte
IDS_MC = (b'{"model": "tiny", "prompt": [[81, 117, 101, 115, 116, 105, 111, 110, 58, 32, 87, 104, '
          b'97, 116, 32, 105, 115, 32, 50, 43, 50, 63, 10, 65, 110, 115, 119, 101, 114, 58, 32, '
          b'102, 111, 117, 114]], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, '
          b'"echo": true}')
IDS_ROLLING = (b'{"model": "tiny", "prompt": [[10, 72, 101, 108, 108, 111, 32, 119, 111, 114, '
               b'108, 100, 44, 32, 116, 104, 105, 115, 32, 105, 115, 32, 97, 32, 115, 104, 111, '
               b'114, 116, 32, 112, 97, 103, 101, 46]], "temperature": 0, "max_tokens": 1, '
               b'"logprobs": 1, "seed": 1234, "echo": true}')
IDS_ROLLING_NULL = (b'{"model": "tiny", "prompt": [[null, 72, 101, 108, 108, 111, 32, 119, 111, '
                    b'114, 108, 100, 44, 32, 116, 104, 105, 115, 32, 105, 115, 32, 97, 32, 115, '
                    b'104, 111, 114, 116, 32, 112, 97, 103, 101, 46]], "temperature": 0, '
                    b'"max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}')
IDS_GENERATE = (b'{"prompt": [[81, 58, 32, 87, 104, 97, 116, 32, 105, 115, 32, 50, 43, 50, 63, '
                b'32, 65, 58]], "model": "tiny", "max_tokens": 8, "temperature": 0, '
                b'"stop": ["\\n\\n"], "seed": 1234}')
IDS_BATCH = (b'{"model": "tiny", "prompt": [[81, 117, 101, 115, 116, 105, 111, 110, 58, 32, 80, '
             b'105, 99, 107, 32, 116, 104, 101, 32, 108, 111, 110, 103, 101, 115, 116, 32, 119, '
             b'111, 114, 100, 46, 10, 65, 110, 115, 119, 101, 114, 58, 32, 101, 120, 116, 114, '
             b'97, 111, 114, 100, 105, 110, 97, 114, 105, 108, 121], [81, 117, 101, 115, 116, '
             b'105, 111, 110, 58, 32, 87, 104, 105, 99, 104, 32, 105, 115, 32, 97, 32, 99, 111, '
             b'108, 111, 117, 114, 63, 10, 65, 110, 115, 119, 101, 114, 58, 32, 115, 101, 118, '
             b'101, 110, 116, 101, 101, 110]], "temperature": 0, "max_tokens": 1, "logprobs": 1, '
             b'"seed": 1234, "echo": true}')


def parse_logprobs(outputs: dict[str, Any] | list[dict[str, Any]],
                   ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval 0.4.13's LocalCompletionsAPI.parse_logprobs (lm_eval/models/openai_completions.py)."""
    res = []
    if not isinstance(outputs, list):
        outputs = [outputs]
    for out in outputs:
        for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens, strict=False):
            assert ctxlen > 0, "Context length must be greater than 0"
            logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
            tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
            top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
            is_greedy = True
            for tok, top in zip(tokens_logprobs, top_logprobs, strict=False):
                if tok != max(top.values()):
                    is_greedy = False
                    break
            res.append((logprobs, is_greedy))
    return res


def parse_generations(outputs: dict[str, Any]) -> list[str | None]:
    """lm-eval 0.4.13's LocalCompletionsAPI.parse_generations, for one answer."""
    tmp: list[str | None] = [None] * len(outputs["choices"])
    for choice in outputs["choices"]:
        tmp[choice["index"]] = choice["text"]
    return tmp


@pytest.fixture
def env(redis_server, sync_redis, fake_upstream):
    return make_cfg(redis_server.url, pool={"logprobs": True}), fake_upstream


@pytest.mark.parametrize("headers", [SYNC_HEADERS, ASYNC_HEADERS], ids=["requests", "aiohttp"])
@pytest.mark.parametrize(("raw", "prompt", "ctxlen"), [
    (MC, "Question: What is 2+2?\nAnswer: four", len("Question: What is 2+2?\nAnswer:")),
    (ROLLING, "\nHello world, this is a short page.", 1),
], ids=["multiple_choice", "rolling"])
async def test_lm_evals_loglikelihood_request_reads_the_continuations_logprobs(
        env, headers: dict[str, str], raw: bytes, prompt: str, ctxlen: int) -> None:
    cfg, up = env
    out = await answered_through_openai_worker(cfg, up.url, "/v1/completions", raw, headers)
    expected = sum(fake_prompt_logprob(k) for k in range(ctxlen, len(prompt)))
    [(logprob, is_greedy)] = parse_logprobs(out, [ctxlen])
    assert logprob == pytest.approx(expected) and is_greedy is True
    choice = out["choices"][0]
    assert choice["text"] == prompt + prompt[::-1][:3]  # the prompt, then the one token generated
    assert len(choice["logprobs"]["tokens"]) == len(prompt) + 1
    assert up.bodies[-1]["echo"] is True and up.bodies[-1]["logprobs"] == 1
    assert up.bodies[-1]["prompt"] == prompt and up.bodies[-1]["max_tokens"] == 1


async def test_lm_evals_generate_until_request_reads_the_answer(env) -> None:
    cfg, up = env
    out = await answered_through_openai_worker(cfg, up.url, "/v1/completions", GENERATE, SYNC_HEADERS)
    assert parse_generations(out) == ["Q: What is 2+2? A:"[::-1][:24]]  # the fake's 8 tokens of 3
    assert "echo" not in up.bodies[-1] and up.bodies[-1]["stop"] == ["\n\n"]


@pytest.fixture
def env_ids(redis_server, sync_redis, fake_upstream):
    return make_cfg(redis_server.url, pool={"logprobs": True, "tokenizer": "upstream",
                                            "tokenizer_url": fake_upstream.url}), fake_upstream


@pytest.mark.parametrize("headers", [SYNC_HEADERS, ASYNC_HEADERS], ids=["requests", "aiohttp"])
@pytest.mark.parametrize(("raw", "prompt", "ctxlen"), [
    (IDS_MC, "Question: What is 2+2?\nAnswer: four", len("Question: What is 2+2?\nAnswer:")),
    (IDS_ROLLING, "\nHello world, this is a short page.", 1),
], ids=["multiple_choice", "rolling"])
async def test_lm_evals_token_id_loglikelihood_request_reads_the_continuations_logprobs(
        env_ids, headers: dict[str, str], raw: bytes, prompt: str, ctxlen: int) -> None:
    """Counted as its ids (nobody asked), sent as they are; the text and logprobs echoed are
    the model server's, so lm-eval's ``ctxlen`` (its count of the context's ids) falls where
    the continuation's tokens begin."""
    cfg, up = env_ids
    out = await answered_through_openai_worker(cfg, up.url, "/v1/completions", raw, headers)
    expected = sum(fake_prompt_logprob(k) for k in range(ctxlen, len(prompt)))
    [(logprob, is_greedy)] = parse_logprobs(out, [ctxlen])
    assert logprob == pytest.approx(expected) and is_greedy is True
    choice = out["choices"][0]
    assert choice["text"] == prompt + prompt[::-1][:3]
    assert choice["logprobs"]["tokens"][:len(prompt)] == list(prompt)
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1
    assert out["usage"]["prompt_tokens"] == len(prompt) and up.tokenized == []
    assert up.bodies[-1]["prompt"] == list(prompt.encode()) and up.bodies[-1]["echo"] is True
    assert up.bodies[-1]["logprobs"] == 1 and up.bodies[-1]["max_tokens"] == 1


async def test_lm_evals_token_id_generate_until_request_reads_the_answer(env_ids) -> None:
    cfg, up = env_ids
    out = await answered_through_openai_worker(cfg, up.url, "/v1/completions", IDS_GENERATE, SYNC_HEADERS)
    assert parse_generations(out) == ["Q: What is 2+2? A:"[::-1][:24]]
    assert out["usage"]["prompt_tokens"] == len("Q: What is 2+2? A:")
    assert up.bodies[-1]["prompt"] == list(b"Q: What is 2+2? A:") and "echo" not in up.bodies[-1]


async def test_lm_evals_batch_of_token_id_prompts_is_answered_a_choice_each(env_ids) -> None:
    """``batch_size=2``: two prompts in one request, each a request of its own in the queue,
    answered together as lm-eval reads them (a choice per prompt, in order)."""
    cfg, up = env_ids
    prompts = [bytes(p).decode() for p in json.loads(IDS_BATCH)["prompt"]]
    out = await answered_through_openai_worker(cfg, up.url, "/v1/completions", IDS_BATCH, SYNC_HEADERS)
    ctxlens = [p.index("Answer:") + len("Answer:") for p in prompts]
    got = parse_logprobs(out, ctxlens)
    for (logprob, is_greedy), prompt, ctxlen in zip(got, prompts, ctxlens, strict=True):
        assert logprob == pytest.approx(sum(fake_prompt_logprob(k) for k in range(ctxlen, len(prompt))))
        assert is_greedy is True
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["text"][:len(p)] for c, p in zip(out["choices"], prompts, strict=True)] == prompts
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert sorted(b["prompt"] for b in up.bodies) == sorted(list(p.encode()) for p in prompts)


@pytest.mark.parametrize(("raw", "says"), [
    (IDS_ROLLING_NULL, "custom_prefix_token_id"),  # a tokenizer with neither BOS nor EOS
], ids=["null_prefix"])
async def test_lm_evals_token_id_requests_the_service_refuses_say_why(env_ids, raw: bytes, says: str) -> None:
    """A 400 lm-eval shows in its warning ("API request failed with error message: ...")
    before it gives up: what to change, and nothing sent to the model server."""
    cfg, up = env_ids
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/completions", data=raw, headers=SYNC_HEADERS)
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["param"] == "prompt" and error["code"] == "invalid_type" and says in error["message"]
    assert up.bodies == [] and up.tokenized == []
