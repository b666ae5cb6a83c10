"""Real token counts per pool: the pool names its tokenizer (a tokenizer.json loaded with the
``tokenizers`` library, or the upstream's ``/tokenize``), the frontend charges and checks the
context with it, and the openai engine's ``max_tokens`` and ``usage`` are the upstream's
tokens end to end. Tokenizers are built here in code (no model hub)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from limiter.cli import main
from limiter.config import load, parse, validate
from limiter.errors import ConfigError
from limiter.frontend.settings import FrontendSettings
from limiter.keys import PoolKeys
from limiter.prompt import ChatMessage
from limiter.token_count import FileCounter, counter_for
from tests.support.fake_upstream import fake_prompt_tokens
from tests.support.frontend_helpers import auth, frontend, make_cfg, redis_state, tenant
from tests.support.helpers import wait_until
from tests.support.worker_helpers import worker
from worker.settings import load_settings

POOL = PoolKeys("tiny")
WORDS = "one two three four five six seven eight nine ten".split()


def word_tokenizer(path: Path) -> Path:
    """A WordLevel tokenizer.json: one token per whitespace-separated word, BOS first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "[BOS]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def _cfg_toml(tokenizer: str, extra: str = "") -> str:
    return f"""
[[classes]]
name = "P1"
share = 1.0

[[pools]]
name = "tiny"
tokenizer = "{tokenizer}"
{extra}
"""


# --- config -------------------------------------------------------------------------------------

def test_pool_tokenizer_config_loads_files_and_directories_relative_to_the_config(tmp_path, monkeypatch):
    word_tokenizer(tmp_path / "conf" / "tok" / "tokenizer.json")
    (tmp_path / "conf" / "qos.toml").write_text(_cfg_toml("tok"))  # a directory holding tokenizer.json
    monkeypatch.chdir(tmp_path)  # relative to the config file, not to where the process runs
    cfg = load(tmp_path / "conf" / "qos.toml", env={})
    assert cfg.pools[0].tokenizer == str(tmp_path / "conf" / "tok")
    counter = counter_for(cfg.pools[0].tokenizer, "", {}, "tiny")
    assert isinstance(counter, FileCounter)
    assert counter.count_text("one two three") == 4  # 3 words + BOS (bytes would say 14)
    assert load(None, env={}).pools[0].tokenizer == "bytes"  # the demo: byte-level
    assert counter_for("bytes", "", {}, "tiny").count_text("one two three") == 14


@pytest.mark.parametrize(("tokenizer", "extra", "field", "words"), [
    ("missing/tokenizer.json", "", "pools[0].tokenizer", "neither a tokenizer mode"),
    ("sentencepiece", "", "pools[0].tokenizer", "neither a tokenizer mode (bytes, upstream)"),
    ("bad.json", "", "pools[0].tokenizer", "cannot load tokenizer"),
    ("", "", "pools[0].tokenizer", "must be 'bytes', 'upstream' or the path"),
    ("upstream", "", "pools[0].tokenizer_url", "needs the model server's http(s):// URL"),
    ("upstream", 'tokenizer_url = "ftp://x"', "pools[0].tokenizer_url", "http(s)://"),
    ("bytes", 'tokenizer_url = "http://x"', "pools[0].tokenizer_url", "only used with"),
])
def test_bad_tokenizer_settings_name_the_field(tmp_path, capsys, tokenizer, extra, field, words):
    (tmp_path / "bad.json").write_text('{"model": {"type": "NoSuchModel"}}')
    p = tmp_path / "qos.toml"
    p.write_text(_cfg_toml(tokenizer, extra))
    with pytest.raises(ConfigError) as exc:
        load(p, env={})
    assert exc.value.path == field and words in str(exc.value), str(exc.value)
    assert main(["config", "check", str(p)]) == 2  # every role exits with it at start
    assert field in capsys.readouterr().err


def test_upstream_mode_takes_the_workers_upstream_url(tmp_path):
    cfg = parse({"classes": [{"name": "P1", "share": 1.0}],
                 "pools": [{"name": "tiny", "tokenizer": "upstream"}],
                 "worker": {"upstream_url": "http://127.0.0.1:9/v1", "upstream_model": "org/M"}})
    counter = counter_for("upstream", "", cfg.worker, "tiny", env={})
    # vLLM serves /tokenize at the root, not under /v1
    assert counter.url == "http://127.0.0.1:9/tokenize" and counter.model == "org/M"
    # the model the workers send: QOS_UPSTREAM_MODEL over the config, as worker/cli.py reads it
    # (the count asked the config's model while the workers' requests named the env's)
    from worker.cli import upstream_env

    env = {"QOS_UPSTREAM_MODEL": "org/N"}
    sent = load_settings(cfg, {"engine": "openai", **upstream_env(env, {})}).upstream_model
    assert counter_for("upstream", "", cfg.worker, "tiny", env=env).model == sent == "org/N"


async def test_an_upstream_url_with_a_query_is_asked_at_its_tokenize_path_with_the_query(upstream):
    """A gateway that takes its key in the query (`?api-key=`): "/tokenize" was appended after
    the query, so the count was asked of the URL's own path (the review of the openai worker
    found the same in its generation calls)."""
    for given in (f"{upstream.url}/v1?api-key=k", f"{upstream.url}/?api-key=k"):
        counter = counter_for("upstream", given, {}, "tiny", env={})
        try:
            assert await counter.count("one two three") == fake_prompt_tokens({"prompt": "one two three"})
        finally:
            await counter.close()
    assert upstream.tokenize_queries == ["api-key=k", "api-key=k"]


async def test_an_upstream_tokenizer_that_redirects_is_unavailable_not_followed(upstream):
    """A redirect from /tokenize (a deployment's mistake) is not followed: the count is
    unavailable (the frontend's 503), asked once; followed, a loop asked it eleven times and
    its error carried the URL with its query."""
    from limiter.token_count import TokenizerUnavailable

    upstream.tokenize_redirect = f"{upstream.url}/tokenize?followed=1"
    counter = counter_for("upstream", f"{upstream.url}/v1?api-key=k", {}, "tiny", env={})
    try:
        with pytest.raises(TokenizerUnavailable) as info:
            await counter.count("one two three")
    finally:
        await counter.close()
    assert upstream.tokenize_queries == ["api-key=k"]
    assert "HTTP 307" in str(info.value) and "api-key" not in str(info.value)


def test_a_step_engine_refuses_a_pool_not_counted_in_bytes(tmp_path, redis_server):
    tok = word_tokenizer(tmp_path / "tokenizer.json")
    cfg = make_cfg(redis_server.url, pool={"tokenizer": str(tok)})
    for engine in ("sim", "torch"):
        with pytest.raises(ConfigError) as exc:
            load_settings(cfg, {"engine": engine})
        assert exc.value.path == "pools[0].tokenizer" and "only the openai engine" in str(exc.value)
    load_settings(cfg, {"engine": "openai", "upstream_url": "http://127.0.0.1:9"})


# --- the frontend counts with the pool's tokenizer; the openai engine counts the upstream's ---------

@pytest.fixture
def upstream(fake_upstream):
    return fake_upstream


async def test_file_tokenizer_counts_for_admission_context_and_usage_is_the_upstreams(
        tmp_path, redis_server, sync_redis, upstream) -> None:
    tok = word_tokenizer(tmp_path / "tokenizer.json")
    cfg = make_cfg(redis_server.url, pool={"tokenizer": str(tok), "context_tokens": 32,
                                           "default_max_tokens": 32})
    prompt = "one two three four five six seven eight"  # 8 words + BOS = 9 tokens; 40 bytes
    async with frontend(cfg) as client:
        async with worker(cfg, engine="openai", upstream_url=upstream.url):
            r = await client.post("/v1/completions", headers=auth(),
                                  json={"model": "tiny", "prompt": prompt, "max_tokens": 4})
            assert r.status == 200, await r.text()
            out = await r.json()
            rid = r.headers["X-QoS-Request-Id"]
            rec = {k.decode(): v.decode(errors="replace")
                   for k, v in sync_redis.hgetall(POOL.request(rid)).items()}
            # admission charged the pool's tokens: 9 in (not 41 bytes), 4 out
            assert rec["input_tokens"] == "9" and rec["max_tokens"] == "4"
            # max_tokens=4 is 4 of the model's tokens (the fake's are 3 characters), not 4 characters
            choice = out["choices"][0]
            assert choice["text"] == prompt[::-1][:12] and choice["finish_reason"] == "length"
            assert out["usage"] == {"prompt_tokens": fake_prompt_tokens({"prompt": prompt}),
                                    "completion_tokens": 4, "total_tokens": 9 + 4}
            assert upstream.bodies[-1]["max_tokens"] == 4 and upstream.disconnects == 0  # not cut off early
            assert rec["usage_in"] == "9" and rec["usage_out"] == "4" and float(rec["refund"]) == 0

            # The default max_tokens fills the room left in the pool's tokens: 32 - 9.
            r = await client.post("/v1/completions", headers=auth(),
                                  json={"model": "tiny", "prompt": prompt, "stream": True, "stream_options": {
                                      "include_usage": True, "continuous_usage_stats": True}})
            assert r.status == 200
            chunks = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                      if line.startswith("data: {")]
            assert upstream.bodies[-1]["max_tokens"] == 32 - 9
            assert chunks[-1]["usage"]["completion_tokens"] == 13  # the upstream's: 39 characters, 3 a token

        # The worker has stopped (its samples are written; no background write can follow):
        # the context check is in the pool's tokens too: 40 words (41 tokens) do not fit 32.
        before = redis_state(sync_redis)
        long = " ".join(WORDS * 4)
        r = await client.post("/v1/completions", headers=auth(), json={"model": "tiny", "prompt": long})
        body = await r.json()
        assert r.status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert body["error"]["param"] == "prompt" and "the prompt has 41" in body["error"]["message"]
        r = await client.post("/v1/completions", headers=auth(),
                              json={"model": "tiny", "prompt": prompt, "max_tokens": 24})
        body = await r.json()
        assert r.status == 400 and body["error"]["param"] == "max_tokens"
        assert "at most 23 output tokens fit" in body["error"]["message"]
        assert redis_state(sync_redis) == before  # nothing charged or queued


async def test_upstream_tokenizer_counts_chats_with_the_servers_template(tmp_path, redis_server, sync_redis,
                                                                          upstream) -> None:
    cfg = make_cfg(redis_server.url, pool={"tokenizer": "upstream", "tokenizer_url": upstream.url,
                                           "context_tokens": 64, "default_max_tokens": 64})
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say it backwards please"}]
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=upstream.url,
                                               upstream_model="org/Model-7B"):
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json={"model": "tiny", "messages": msgs, "max_tokens": 3})
        assert r.status == 200, await r.text()
        out = await r.json()
        want = fake_prompt_tokens({"messages": msgs})  # 1 + (2 + 2) + (4 + 2) = 11
        (asked,) = upstream.tokenized
        assert asked["messages"] == msgs and asked["add_generation_prompt"] is True
        assert asked["model"] == "tiny"  # no [worker] upstream_model in this config: the pool's model
        rec = {k.decode(): v.decode(errors="replace") for k, v in
               sync_redis.hgetall(POOL.request(r.headers["X-QoS-Request-Id"])).items()}
        assert rec["input_tokens"] == str(want) == rec["usage_in"]
        assert out["usage"]["prompt_tokens"] == want and out["usage"]["completion_tokens"] == 3
        assert out["choices"][0]["message"]["content"] == "say it backwards please"[::-1][:9]
        assert "chat_template_kwargs" not in asked

    # A pool that passes chat_template_kwargs on (enable_thinking changes what the template
    # renders): the count is asked with them, of the prompt the model server is sent
    passing = make_cfg(redis_server.url, pool={"tokenizer": "upstream", "tokenizer_url": upstream.url,
                                               "context_tokens": 64, "default_max_tokens": 64,
                                               "upstream_fields": ("chat_template_kwargs",)})
    kwargs = {"enable_thinking": False}
    async with frontend(passing) as client, worker(passing, engine="openai", upstream_url=upstream.url):
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json={"model": "tiny", "messages": msgs, "max_tokens": 3,
                                    "chat_template_kwargs": kwargs})
        assert r.status == 200, await r.text()
    asked = upstream.tokenized[-1]
    assert asked["messages"] == msgs and asked["chat_template_kwargs"] == kwargs
    assert upstream.bodies[-1]["chat_template_kwargs"] == kwargs
    async with frontend(cfg) as client:
        # The model server cannot count: a clear 503, nothing admitted or charged.
        before = redis_state(sync_redis)
        upstream.status = 503
        r = await client.post("/v1/completions", headers=auth(), json={"model": "tiny", "prompt": "hi"})
        body = await r.json()
        assert r.status == 503 and body["error"]["code"] == "tokenizer_unavailable"
        assert r.headers["Retry-After"] == "1" and "127.0.0.1" not in body["error"]["message"]
        assert redis_state(sync_redis) == before
        # It refuses this prompt (its chat template rejects the messages, say): the request's
        # fault, a 400 without Retry-After -- a 503 had the client retry it for ever.
        upstream.status = 422
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json={"model": "tiny", "messages": msgs})
        body = await r.json()
        err = body["error"]
        assert (r.status, err["code"], err["param"]) == (400, "tokenizer_refused", "messages")
        assert body["error"]["type"] == "invalid_request_error" and "Retry-After" not in r.headers
        assert "busy" not in body["error"]["message"]  # the upstream's own text is not shown
        assert redis_state(sync_redis) == before


async def test_counters_count_completions_and_chats(tmp_path) -> None:
    from tokenizers import Tokenizer

    counter = FileCounter(Tokenizer.from_file(str(word_tokenizer(tmp_path / "t.json"))))
    assert await counter.count("one two") == 3
    assert await counter.count(" ".join(["one"] * 20_000)) == 20_001  # long prompts: off the event loop
    msgs = (ChatMessage("user", "one two"),)
    # chat: the rendered prompt (its role markers are unknown words here)
    assert await counter.count("<|user|>\none two\n<|assistant|>\n", msgs) == 5


def test_frontend_settings_validate_the_tokenize_timeout(redis_server) -> None:
    from limiter.frontend.settings import validate as validate_settings

    cfg = validate(dataclasses.replace(make_cfg(redis_server.url)))
    with pytest.raises(ConfigError) as exc:
        validate_settings(FrontendSettings(tokenize_timeout_s=0), cfg)
    assert exc.value.path == "frontend.tokenize_timeout_s"


async def test_a_prompt_no_tokenizer_fits_is_refused_before_the_model_server_counts_it(
        redis_server, sync_redis, upstream) -> None:
    """A prompt of more characters than any tokenizer fits in the context (64 a token): a 400
    before the count -- it was sent to the model server's /tokenize, then refused by the
    count's result, never admitted nor charged: free work for any tenant, however small."""
    cfg = make_cfg(redis_server.url, pool={"tokenizer": "upstream", "tokenizer_url": upstream.url,
                                           "context_tokens": 64, "default_max_tokens": 8})
    async with frontend(cfg) as client:
        before = redis_state(sync_redis)
        for body in ({"model": "tiny", "prompt": "x" * (64 * 64 + 1)},
                     {"model": "tiny", "messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "ok",
                                                     "reasoning": "r" * (64 * 64)}]}):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = await client.post(path, headers=auth(), json=body)
            err = (await r.json())["error"]
            assert (r.status, err["code"]) == (400, "context_length_exceeded"), err
        assert redis_state(sync_redis) == before  # nothing admitted or charged
    assert upstream.tokenized == []  # the model server was not asked


async def test_a_tenant_counts_no_more_prompts_at_once_than_its_max_inflight(redis_server, sync_redis,
                                                                            upstream) -> None:
    """The model server's count is free until admission charges it: a tenant with
    ``max_inflight`` 1 whose first prompt is being counted gets a 429 for a second (it was
    counted too, and so 40 at once), and its turn comes back when the first count ends."""
    cfg = make_cfg(redis_server.url, pool={"tokenizer": "upstream", "tokenizer_url": upstream.url,
                                           "context_tokens": 64, "default_max_tokens": 8},
                   tenants=[tenant("one", "key-one", "P1", max_inflight=1)])
    long = {"model": "tiny", "prompt": "w " * 100}  # 101 words: past the context once counted
    upstream.tokenize_gate = asyncio.Event()
    async with frontend(cfg) as client:
        first = asyncio.create_task(client.post("/v1/completions", headers=auth("key-one"), json=long))
        await wait_until(lambda: len(upstream.tokenized) == 1, "the first prompt at the model server's count")
        r = await client.post("/v1/completions", headers=auth("key-one"), json=long)
        err = (await r.json())["error"]
        assert (r.status, err["code"]) == (429, "too_many_inflight"), err
        assert len(upstream.tokenized) == 1  # the second was not sent to be counted
        other = asyncio.create_task(client.post("/v1/completions", headers=auth(), json=long))
        await wait_until(lambda: len(upstream.tokenized) == 2, "another tenant's count, beside it")
        upstream.tokenize_gate.set()
        for task in (first, other):
            r = await task
            assert (r.status, (await r.json())["error"]["code"]) == (400, "context_length_exceeded")
        r = await client.post("/v1/completions", headers=auth("key-one"), json=long)  # its turn is back
        assert (r.status, (await r.json())["error"]["code"]) == (400, "context_length_exceeded")


async def test_a_tokenizer_json_saved_with_truncation_or_padding_counts_the_whole_prompt(
        tmp_path, redis_server, sync_redis) -> None:
    """A tokenizer.json saved while truncation or padding was on (a training script's
    ``enable_truncation(512)``) keeps it in the file, and ``tokenizers`` applies it to every
    encode: a prompt of any length counted as at most ``max_length`` tokens (admitted past the
    context, charged a fraction of it), or every prompt as the padded length. transformers (so
    vLLM) turns both off unless a call asks: the count is the whole prompt's."""
    from tokenizers import Tokenizer

    truncating = word_tokenizer(tmp_path / "trunc" / "tokenizer.json")
    t = Tokenizer.from_file(str(truncating))
    t.enable_truncation(max_length=8)
    t.save(str(truncating))
    padding = word_tokenizer(tmp_path / "pad" / "tokenizer.json")
    t = Tokenizer.from_file(str(padding))
    t.enable_padding(length=64, pad_id=0, pad_token="[UNK]")
    t.save(str(padding))
    long = " ".join(WORDS * 4)  # 40 words + BOS
    for path in (truncating, padding):
        counter = counter_for(str(path), "", {}, "tiny")
        assert await counter.count(long) == 41 and await counter.count("one two") == 3
        assert await counter.count("w " * 20_000) == 20_001  # (off the event loop too)
        ids, _ = await counter.encode(long, True)  # /tokenize's count
        assert len(ids) == 41

    cfg = make_cfg(redis_server.url, pool={"tokenizer": str(truncating), "context_tokens": 32,
                                           "default_max_tokens": 8})
    async with frontend(cfg) as client:
        before = redis_state(sync_redis)
        r = await client.post("/v1/completions", headers=auth(), json={"model": "tiny", "prompt": long})
        err = (await r.json())["error"]
        assert (r.status, err["code"]) == (400, "context_length_exceeded"), err
        assert "the prompt has 41" in err["message"]
        assert redis_state(sync_redis) == before  # nothing admitted or charged


def test_a_tokenizer_json_that_cannot_encode_is_refused_at_start(tmp_path) -> None:
    """A tokenizer.json that loads but fails every prompt with a word outside its vocabulary
    (a WordLevel model whose unk_token is not in it): a ConfigError naming the field at start
    (every role's check, the frontend's counter), not a 500 for each such request."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"one": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with pytest.raises(ConfigError) as exc:
        counter_for(str(path), "", {}, "tiny")
    assert exc.value.path == "tokenizer" and "cannot encode" in str(exc.value)
    (tmp_path / "qos.toml").write_text(_cfg_toml("tokenizer.json"))
    with pytest.raises(ConfigError) as exc:
        load(str(tmp_path / "qos.toml"), env={})
    assert exc.value.path == "pools[0].tokenizer"
