"""vLLM's tokenizer endpoints through the frontend (``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info``: what lm-eval's ``tokenizer_backend=remote`` reads): answered from a
pool's tokenizer.json (and the tokenizer_config.json beside it), relayed to the model server
for a pool counting ``"upstream"``, refused for a pool counting bytes; each needing a key and
one of its tenant's turns to tokenize; bad input a 400 naming the field."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from limiter.frontend.metrics import METRICS
from tests.support.body_strategies import JUNK, MESSAGE
from tests.support.frontend_helpers import auth, frontend, make_cfg, tenant
from tests.support.helpers import wait_until
from tests.test_token_count import word_tokenizer

CONFIG = {"bos_token": "[BOS]", "eos_token": {"content": "[UNK]", "special": True}, "pad_token": None,
          "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
          "model_max_length": 4096, "added_tokens_decoder": {"0": {"content": "[UNK]"}}}


@pytest.fixture
def file_cfg(redis_server, tmp_path: Path) -> Any:
    """A pool counting in a WordLevel tokenizer.json ([BOS] first; "one".."ten" are 2..11),
    its tokenizer_config.json beside it."""
    word_tokenizer(tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(CONFIG))
    return make_cfg(redis_server.url, pool={"tokenizer": str(tmp_path / "tok")})


async def test_a_tokenizer_json_pool_tokenizes_detokenizes_and_tells_its_tokenizer(file_cfg) -> None:
    async with frontend(file_cfg) as client:
        r = await client.post("/tokenize", headers=auth(), json={"prompt": "one two three"})
        assert r.status == 200, await r.text()
        assert await r.json() == {"count": 4, "max_model_len": file_cfg.pools[0].context_tokens,
                                  "tokens": [1, 2, 3, 4]}
        r = await client.post("/tokenize", headers=auth(), json={
            "model": "tiny", "prompt": "one two", "add_special_tokens": False, "return_token_strs": True})
        assert (await r.json())["tokens"] == [2, 3] and (await r.json())["token_strs"] == ["one", "two"]
        r = await client.post("/detokenize", headers=auth(), json={"tokens": [2, 3, 11]})
        assert await r.json() == {"prompt": "one two ten"}
        r = await client.get("/tokenizer_info", headers=auth())
        info = await r.json()
    # the config as vLLM answers it: a special token's text, not its AddedToken object
    assert info["eos_token"] == "[UNK]" and info["bos_token"] == "[BOS]" and info["pad_token"] is None
    assert info["chat_template"] == CONFIG["chat_template"] and info["model_max_length"] == 4096
    assert "added_tokens_decoder" not in info and info["tokenizer_class"] == "PreTrainedTokenizerFast"


@pytest.mark.parametrize(("path", "body", "param", "code"), [
    ("/tokenize", {}, "prompt", "missing_required_parameter"),
    ("/tokenize", {"prompt": 5}, "prompt", "invalid_type"),
    ("/tokenize", {"prompt": "one", "add_special_tokens": "yes"}, "add_special_tokens", "invalid_type"),
    ("/tokenize", {"prompt": "one", "return_token_strs": 1}, "return_token_strs", "invalid_type"),
    ("/tokenize", {"prompt": "one", "temperature": 1}, "temperature", "unknown_parameter"),
    ("/tokenize", {"prompt": "one", "model": "other"}, "model", "model_not_found"),
    ("/tokenize", {"messages": [{"role": "user", "content": "one"}]}, "messages", "unsupported_value"),
    ("/detokenize", {"tokens": [2, "x"]}, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [2, -1]}, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [2, True]}, "tokens", "invalid_type"),
    ("/detokenize", {}, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [2, 12]}, "tokens", "invalid_value"),  # past the vocabulary (0..11)
])
async def test_bad_tokenizer_requests_are_a_400_naming_the_field(file_cfg, path: str, body: dict[str, Any],
                                                                 param: str, code: str) -> None:
    async with frontend(file_cfg) as client:
        r = await client.post(path, headers=auth(), json=body)
        error = (await r.json())["error"]
    assert (r.status in (400, 404), error["param"], error["code"]) == (True, param, code), error


async def test_the_tokenizer_endpoints_need_a_key_and_a_model_tokenizer(redis_server, file_cfg) -> None:
    async with frontend(file_cfg) as client:
        for call in (client.post("/tokenize", json={"prompt": "one"}), client.get("/tokenizer_info"),
                     client.post("/detokenize", json={"tokens": [1]}, headers=auth("wrong-key"))):
            r = await call
            assert r.status == 401, await r.text()
    async with frontend(make_cfg(redis_server.url)) as client:  # the demo pool counts bytes
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            r = await client.post(path, headers=auth(), json=body)
            error = (await r.json())["error"]
            assert (r.status, error["code"], error["param"]) == (400, "unsupported_value", "model"), error
            assert "counts bytes" in error["message"]
        r = await client.get("/tokenizer_info", headers=auth())
        assert r.status == 400 and "counts bytes" in (await r.json())["error"]["message"]


async def test_with_several_models_a_tokenizer_call_names_its_own(redis_server, file_cfg) -> None:
    pools = (*file_cfg.pools, dataclasses.replace(file_cfg.pools[0], name="big", model="big"))
    cfg = dataclasses.replace(file_cfg, pools=pools)
    async with frontend(cfg) as client:
        r = await client.post("/tokenize", headers=auth(), json={"prompt": "one"})
        error = (await r.json())["error"]
        assert (r.status, error["param"], error["code"]) == (400, "model", "missing_required_parameter")
        assert "tiny" in error["message"] and "big" in error["message"]
        r = await client.post("/tokenize", headers=auth(), json={"prompt": "one", "model": "big"})
        assert (await r.json())["tokens"] == [1, 2]
        r = await client.get("/tokenizer_info?model=big", headers=auth())
        assert (await r.json())["eos_token"] == "[UNK]"


def _upstream_cfg(redis_server: Any, up: Any, **more: Any) -> Any:
    return make_cfg(redis_server.url, pool={"tokenizer": "upstream", "tokenizer_url": up.url}, **more)


async def test_an_upstream_pool_relays_them_to_its_model_server(redis_server, fake_upstream) -> None:
    """The body as sent (a chat's too: the model server applies its template), its ``model``
    the served name; the answer as the server gave it; ``/tokenizer_info`` where the server
    serves it, else a 404 saying how vLLM serves it."""
    up = fake_upstream
    async with frontend(_upstream_cfg(redis_server, up)) as client:
        r = await client.post("/tokenize", headers=auth(),
                              json={"prompt": "a b c", "add_special_tokens": False})
        assert await r.json() == {"count": 4, "max_model_len": 4096, "tokens": [0, 1, 2, 3]}
        chat = {"messages": [{"role": "user", "content": "a b"}], "add_generation_prompt": True}
        r = await client.post("/tokenize", headers=auth(), json=chat)
        assert (await r.json())["count"] == 1 + 2 + 2
        r = await client.post("/detokenize", headers=auth(), json={"model": "tiny", "tokens": list(b"hi")})
        assert await r.json() == {"prompt": "hi"}
        r = await client.get("/tokenizer_info", headers=auth())
        error = (await r.json())["error"]
        assert r.status == 404 and "--enable-tokenizer-info-endpoint" in error["message"]
        up.tokenizer_info = {"tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>"}
        r = await client.get("/tokenizer_info", headers=auth())
        assert await r.json() == up.tokenizer_info
    assert up.tokenized == [{"prompt": "a b c", "add_special_tokens": False, "model": "tiny"},
                            {**chat, "model": "tiny"}]
    assert up.detokenized == [{"model": "tiny", "tokens": list(b"hi")}]


@pytest.mark.parametrize(("status", "code", "want"), [
    (503, "tokenizer_unavailable", 503), (500, "tokenizer_unavailable", 503),
    (422, "tokenizer_refused", 400)])
async def test_a_model_server_that_cannot_answer_is_a_503_and_one_that_refuses_a_400_in_our_words(
        redis_server, fake_upstream, status: int, code: str, want: int) -> None:
    """Its own words stay in the log (they may name its internals); a 503 carries Retry-After."""
    fake_upstream.status = status
    async with frontend(_upstream_cfg(redis_server, fake_upstream)) as client:
        r = await client.post("/tokenize", headers=auth(), json={"prompt": "a"})
        error = (await r.json())["error"]
    assert (r.status, error["code"]) == (want, code) and "busy" not in error["message"], error
    assert (r.headers.get("Retry-After") == "1") == (want == 503)


async def test_a_model_servers_answer_past_the_bound_is_a_503_not_read_whole(
        redis_server, fake_upstream, monkeypatch) -> None:
    """A relayed tokenizer call's answer, and a prompt's count, are read up to
    ``MAX_ANSWER_BYTES`` (a broken server or proxy sending without end was read whole into the
    frontend's memory): past it, the model server could not answer."""
    from limiter import token_count

    monkeypatch.setattr(token_count, "MAX_ANSWER_BYTES", 40)  # the fake's answers are longer
    async with frontend(_upstream_cfg(redis_server, fake_upstream)) as client:
        r = await client.post("/tokenize", headers=auth(), json={"prompt": "a b c d e f"})
        error = (await r.json())["error"]
        assert (r.status, error["code"]) == (503, "tokenizer_unavailable"), error
        r = await client.post("/v1/completions", headers=auth(), json={
            "model": "tiny", "prompt": "a b c d e f", "max_tokens": 1})
        error = (await r.json())["error"]
        assert (r.status, error["code"]) == (503, "tokenizer_unavailable"), error
    monkeypatch.setattr(token_count, "MAX_ANSWER_BYTES", 1 << 20)
    async with frontend(_upstream_cfg(redis_server, fake_upstream)) as client:
        r = await client.post("/tokenize", headers=auth(), json={"prompt": "a b c d e f"})
        assert r.status == 200 and (await r.json())["count"] == 7


async def test_a_tenant_tokenizes_at_most_its_max_inflight_at_once(redis_server, fake_upstream) -> None:
    """Tokenizing costs the model server (or this process) work that no admission charges: a
    tenant with a ``max_inflight`` holds at most that many tokenizer calls at once, as it may
    count that many prompts (a 429 past it); its turn is free again once the call returns."""
    capped = tenant("capped", "key-capped", "P1", max_inflight=1)
    up = fake_upstream
    up.tokenize_gate = asyncio.Event()
    async with frontend(_upstream_cfg(redis_server, up, tenants=[capped])) as client:
        held = asyncio.create_task(client.post("/tokenize", headers=auth("key-capped"), json={"prompt": "a"}))
        await wait_until(lambda: len(up.tokenized) == 1, "the first call at the model server")
        r = await client.post("/detokenize", headers=auth("key-capped"), json={"tokens": [1]})
        error = (await r.json())["error"]
        assert (r.status, error["code"]) == (429, "too_many_inflight"), error
        up.tokenize_gate.set()
        assert (await held).status == 200
        r = await client.post("/detokenize", headers=auth("key-capped"), json={"tokens": [104]})
        assert await r.json() == {"prompt": "h"}


# --- found by review -----------------------------------------------------------------------

async def test_a_relayed_chat_is_checked_as_a_generation_chat_is(redis_server, fake_upstream) -> None:
    """A chat relayed to the model server is held to what the chat completions path takes: only
    text parts (an image_url part has vLLM fetch any URL, an internal address included, on the
    frontend's word), no reserved template argument, well-formed tools; nothing is relayed."""
    bodies = [
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"chat_template": "x"}},
         "chat_template_kwargs.chat_template"),
        ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "code"}]}, "tools[0].function"),
        ({"messages": [{"role": "wizard", "content": "a"}]}, "messages[0].role"),
    ]
    async with frontend(_upstream_cfg(redis_server, fake_upstream)) as client:
        for body, param in bodies:
            r = await client.post("/tokenize", headers=auth(), json=body)
            error = (await r.json())["error"]
            assert (r.status, error["param"]) == (400, param), error
    assert fake_upstream.tokenized == []


async def test_a_prompt_that_is_not_valid_unicode_is_a_400(file_cfg) -> None:
    """A lone surrogate (a JSON \\ud800 escape) is no text the tokenizer can take: a 400 naming
    ``prompt``, as on the generation paths, not a 500."""
    async with frontend(file_cfg) as client:
        r = await client.post("/tokenize", headers={**auth(), "Content-Type": "application/json"},
                              data=b'{"prompt": "one \\ud800 two"}')
        error = (await r.json())["error"]
    assert (r.status, error["param"], error["code"]) == (400, "prompt", "invalid_type"), error


async def test_tokenizer_info_answers_a_huge_model_max_length_and_non_json_constants(
        redis_server, file_cfg, fake_upstream, tmp_path: Path) -> None:
    """transformers saves an unbounded ``model_max_length`` as int(1e30), past 64 bits: answered
    as it is (vLLM answers it so), not a 500; a NaN or Infinity in the file, which is no JSON, is
    answered as null."""
    huge = 1000000000000000019884624838656
    config = tmp_path / "tok" / "tokenizer_config.json"
    config.write_text(f'{{"eos_token": "[UNK]", "model_max_length": {huge}, "x": NaN, "y": -Infinity}}')
    async with frontend(file_cfg) as client:
        r = await client.get("/tokenizer_info", headers=auth())
        assert r.status == 200, await r.text()
        info = json.loads(await r.text())  # (strict: NaN would not be JSON)
    assert info["model_max_length"] == huge and info["x"] is None and info["y"] is None
    fake_upstream.tokenizer_info = {"tokenizer_class": "LlamaTokenizerFast", "model_max_length": huge}
    async with frontend(_upstream_cfg(redis_server, fake_upstream)) as client:
        r = await client.get("/tokenizer_info", headers=auth())
        assert r.status == 200, await r.text()
        assert await r.json() == fake_upstream.tokenizer_info


async def test_tokenizer_info_answers_added_tokens_as_their_text_and_the_saved_chat_template(
        file_cfg, tmp_path: Path) -> None:
    """As vLLM answers a tokenizer loaded by transformers: every AddedToken (a special token's,
    the additional special tokens') as its text; the chat_template.jinja that save_pretrained
    writes beside tokenizer_config.json (which then holds none) is the chat template (lm-eval's
    remote tokenizer renders chats with it)."""
    added = {"__type": "AddedToken", "content": "<tool>", "lstrip": False, "special": True}
    config = {"eos_token": {"__type": "AddedToken", "content": "[UNK]"}, "additional_special_tokens": [added]}
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tok" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}\n")
    async with frontend(file_cfg) as client:
        info = await (await client.get("/tokenizer_info", headers=auth())).json()
    assert info["eos_token"] == "[UNK]" and info["additional_special_tokens"] == ["<tool>"]
    assert info["chat_template"] == "{{ messages[0]['content'] }}\n"


# lm-eval 0.4.13's RemoteTokenizer (``local-completions`` with ``tokenizer_backend=remote``,
# ``auth_token=demo-p1``), captured: a requests.Session's headers, Content-Type even on the GET
LM_EVAL_HEADERS = {"User-Agent": "python-requests/2.34.2", "Accept-Encoding": "gzip, deflate",
                   "Accept": "*/*", "Connection": "keep-alive", "Content-Type": "application/json",
                   "Authorization": "Bearer demo-p1"}
# transformers' save_pretrained writes this model_max_length for a tokenizer that names none
# (its VERY_LARGE_INTEGER, int(1e30)): deploy/make_bytetok.py's tokenizer_config.json has it
UNBOUNDED = 1000000000000000019884624838656



async def test_a_tokenizer_config_with_transformers_unbounded_max_length_is_served(
        redis_server, tmp_path: Path) -> None:
    """lm-eval's first call, ``GET /tokenizer_info``, on a pool counting in
    deploy/make_bytetok.py's directory: the config's int(1e30) past 64 bits was a 500 (the
    JSON encoder refused it) and lm-eval stopped; vLLM answers the integer as it is."""
    word_tokenizer(tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"backend": "tokenizers", "model_max_length": UNBOUNDED, "tokenizer_class": "TokenizersBackend"}))
    async with frontend(make_cfg(redis_server.url, pool={"tokenizer": str(tmp_path / "tok")})) as client:
        r = await client.get("/tokenizer_info", headers=LM_EVAL_HEADERS)
        assert r.status == 200, await r.text()
        info = json.loads(await r.text())
    assert info["model_max_length"] == UNBOUNDED and info["tokenizer_class"] == "TokenizersBackend"


async def test_a_model_servers_tokenizer_info_past_64_bit_integers_is_relayed(redis_server,
                                                                             fake_upstream) -> None:
    up = fake_upstream
    up.tokenizer_info = {"tokenizer_class": "Qwen2TokenizerFast", "model_max_length": UNBOUNDED}
    async with frontend(_upstream_cfg(redis_server, up)) as client:
        r = await client.get("/tokenizer_info", headers=LM_EVAL_HEADERS)
        assert r.status == 200, await r.text()
        assert json.loads(await r.text()) == up.tokenizer_info


# lm-eval's calls as it sent them (``requests``' json.dumps: ", " and ": " separators), the
# headers above: its first GET, a multiple_choice request's context and continuation
# tokenized, and (``tokenized_requests=False``) its token ids read back as text
LM_EVAL_TOKENIZE = b'{"prompt": "Question: What is 2+2?\\nAnswer: four", "add_special_tokens": false}'
LM_EVAL_DETOKENIZE = (b'{"tokens": [81, 117, 101, 115, 116, 105, 111, 110, 58, 32, 87, 104, 97, 116, 32, '
                      b'105, 115, 32, 50, 43, 50, 63, 10, 65, 110, 115, 119, 101, 114, 58, 32, 102, 111, '
                      b'117, 114]}')
# deploy/make_bytetok.py's tokenizer_config.json, as transformers 5.25 writes it
BYTETOK_CONFIG = {"backend": "tokenizers", "model_max_length": UNBOUNDED,
                  "tokenizer_class": "TokenizersBackend"}


def byte_tokenizer(directory: Path) -> Path:
    """deploy/make_bytetok.py's directory (an id a byte), built with the tokenizers library
    alone (transformers' save_pretrained wrote the same tokenizer.json and the config above)."""
    import importlib.util

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    spec = importlib.util.spec_from_file_location(
        "make_bytetok", Path(__file__).resolve().parents[1] / "deploy" / "make_bytetok.py")
    assert spec is not None and spec.loader is not None
    make_bytetok = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_bytetok)
    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in enumerate(make_bytetok.byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(BYTETOK_CONFIG))
    return directory


async def test_lm_evals_remote_tokenizer_calls_replayed_on_a_byte_tokenizer_pool(
        redis_server, tmp_path: Path) -> None:
    """What lm-eval 0.4.13 (``local-completions``, ``tokenizer_backend=remote``) sent, byte
    for byte, to a pool counting in deploy/make_bytetok.py's directory: its info (no special
    tokens: lm-eval then needs ``custom_prefix_token_id`` for a rolling window), a byte's id
    its value, and those ids back to the text."""
    text = "Question: What is 2+2?\nAnswer: four"
    cfg = make_cfg(redis_server.url, pool={"tokenizer": str(byte_tokenizer(tmp_path / "bytetok"))})
    async with frontend(cfg) as client:
        r = await client.get("/tokenizer_info", headers=LM_EVAL_HEADERS)
        assert r.status == 200, await r.text()
        assert json.loads(await r.text()) == {"tokenizer_class": "TokenizersBackend", **BYTETOK_CONFIG}
        r = await client.post("/tokenize", data=LM_EVAL_TOKENIZE, headers=LM_EVAL_HEADERS)
        assert await r.json() == {"count": len(text), "max_model_len": cfg.pools[0].context_tokens,
                                  "tokens": list(text.encode())}
        r = await client.post("/detokenize", data=LM_EVAL_DETOKENIZE, headers=LM_EVAL_HEADERS)
        assert await r.json() == {"prompt": text}


async def test_lm_evals_remote_tokenizer_calls_replayed_on_an_upstream_pool(redis_server,
                                                                            fake_upstream) -> None:
    """The same calls relayed to the model server, each with the served name as ``model``."""
    up = fake_upstream
    up.tokenizer_info = {"tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>",
                         "bos_token": None}
    async with frontend(_upstream_cfg(redis_server, up)) as client:
        r = await client.get("/tokenizer_info", headers=LM_EVAL_HEADERS)
        assert await r.json() == up.tokenizer_info
        r = await client.post("/tokenize", data=LM_EVAL_TOKENIZE, headers=LM_EVAL_HEADERS)
        assert (await r.json())["tokens"] == list(range(1 + 6))  # the fake's: BOS and a token a word
        r = await client.post("/detokenize", data=LM_EVAL_DETOKENIZE, headers=LM_EVAL_HEADERS)
        assert await r.json() == {"prompt": "Question: What is 2+2?\nAnswer: four"}
    assert up.tokenized == [{**json.loads(LM_EVAL_TOKENIZE), "model": "tiny"}]
    assert up.detokenized == [{**json.loads(LM_EVAL_DETOKENIZE), "model": "tiny"}]


TOKEN_IDS = st.lists(st.integers(-2, 2**32), max_size=6)
TOKENIZER_BODY = st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.just("tiny"), JUNK),
    "prompt": st.one_of(st.text(max_size=30), JUNK),
    "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=2), JUNK),
    "tokens": st.one_of(TOKEN_IDS, st.lists(st.integers(0, 11), max_size=6), JUNK),
    "add_special_tokens": st.one_of(st.booleans(), JUNK),
    "return_token_strs": st.one_of(st.booleans(), JUNK),
    "add_generation_prompt": JUNK,
    "surprise": JUNK,
})


@pytest.fixture
async def file_client(file_cfg) -> Any:
    async with frontend(file_cfg) as client:
        yield client


# near-valid bodies, junk in a field or two (most cases must pass the unknown-field check)
NEAR_VALID = {
    "/tokenize": st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=30), JUNK)}, optional={
        "model": st.one_of(st.just("tiny"), JUNK), "add_special_tokens": st.one_of(st.booleans(), JUNK),
        "return_token_strs": st.one_of(st.booleans(), JUNK)}),
    "/detokenize": st.fixed_dictionaries({"tokens": st.one_of(TOKEN_IDS, st.lists(st.integers(0, 11)), JUNK)},
                                         optional={"model": st.one_of(st.just("tiny"), JUNK)}),
}


@st.composite
def tokenizer_calls(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from(sorted(NEAR_VALID)))
    return path, draw(st.one_of(NEAR_VALID[path], NEAR_VALID[path], TOKENIZER_BODY))


@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(call=tokenizer_calls())
async def test_any_tokenizer_body_is_answered_or_refused_naming_what_is_wrong(
        file_client, call: tuple[str, dict[str, Any]]) -> None:
    """Whatever a client sends the tokenizer endpoints of a tokenizer.json pool: an answer of
    vLLM's shape, or a 400/404 in OpenAI's error shape naming the field; never a 5xx."""
    path, body = call
    try:
        raw = json.dumps(body, allow_nan=False).encode()
    except ValueError:
        raw = repr(body).encode()  # (not JSON: the body's own 400)
    r = await file_client.post(path, data=raw, headers={**auth(), "Content-Type": "application/json"})
    out = await r.json()
    assert r.status in (200, 400, 404), (path, body, r.status, out)
    if r.status != 200:
        error = out["error"]
        assert error["message"] and error["code"], error
        named = (*body, "model", "prompt", "tokens")  # (a field sent, or one required)
        assert error["param"] is None or error["param"].split("[")[0].split(".")[0] in named, (body, error)
    elif path == "/tokenize":
        assert out["count"] == len(out["tokens"]) and all(0 <= t <= 11 for t in out["tokens"]), out
    else:
        assert isinstance(out["prompt"], str) and set(body) <= {"model", "tokens"}, (body, out)


async def test_the_tokenizer_config_is_read_once_as_the_tokenizer_is(file_cfg, tmp_path: Path) -> None:
    """Read at the first ``/tokenizer_info`` and kept, as the tokenizer itself is loaded once:
    a config of megabytes was parsed on the event loop at every call."""
    async with frontend(file_cfg) as client:
        first = await (await client.get("/tokenizer_info", headers=auth())).json()
        (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[BOS]"}))
        again = await (await client.get("/tokenizer_info", headers=auth())).json()
    assert first == again and again["eos_token"] == "[UNK]"


async def test_tokenizer_calls_are_counted_by_endpoint_and_status(file_cfg) -> None:
    """``qos_frontend_tokenizer_calls_total{endpoint,status}``: the error middleware counts
    only the generation paths, and an operator sees what these cost and how they end."""
    async with frontend(file_cfg) as client:
        await client.post("/tokenize", headers=auth(), json={"prompt": "one"})
        await client.post("/tokenize", headers=auth(), json={"prompt": 5})
        await client.post("/detokenize", json={"tokens": [1]})
        await client.get("/tokenizer_info", headers=auth())
        metrics = client.server.app[METRICS]
        counts = {(s.labels["endpoint"], s.labels["status"]): s.value
                  for m in metrics.tokenizer_calls.collect() for s in m.samples if s.name.endswith("_total")}
    assert counts == {("tokenize", "200"): 1, ("tokenize", "400"): 1, ("detokenize", "401"): 1,
                      ("tokenizer_info", "200"): 1}


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_expect_100_continue_on_a_tokenizer_endpoint_is_answered_only_when_the_headers_pass(
        file_cfg, path: str) -> None:
    """A security review: the generation routes send ``100 Continue`` only when the key and
    the announced size pass, but the tokenizer endpoints kept aiohttp's default, which sent it
    at once: a client with no key or a wrong one (or a body over the limit) was asked for its
    whole body, then told 401. Good headers still get the 100 and an answer."""
    from tests.test_frontend_bad_input import _first_answer_line

    def head(headers: dict[str, str], length: int) -> bytes:
        lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json",
                 f"Content-Length: {length}", "Expect: 100-continue",
                 *(f"{k}: {v}" for k, v in headers.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    async with frontend(file_cfg, max_body_bytes=10_000) as c:
        for headers, length, status in ((auth("wrong-key"), 100, 401), ({}, 100, 401), (auth(), 10_001, 400)):
            lines = await _first_answer_line(c.port, head(headers, length))
            assert lines[0].startswith(f"HTTP/1.1 {status} ".encode()), (headers, length, lines)
        body = json.dumps({"prompt": "one two"} if path == "/tokenize" else {"tokens": [2, 3]}).encode()
        lines = await _first_answer_line(c.port, head(auth(), len(body)), body)
        assert lines[0].startswith(b"HTTP/1.1 100 ") and lines[1].startswith(b"HTTP/1.1 200 "), lines
