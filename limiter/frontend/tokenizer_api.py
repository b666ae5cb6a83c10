"""vLLM's tokenizer endpoints, served for a pool with a model tokenizer: ``POST /tokenize``,
``POST /detokenize`` and ``GET /tokenizer_info``. lm-eval's ``tokenizer_backend=remote``
reads them (no local copy of the model's tokenizer needed), as do UIs that count tokens.

A pool whose ``tokenizer`` is ``"upstream"`` relays them to its model server (the body as
sent, its ``model`` the served name): exact, chat templates included. A pool counting in a
``tokenizer.json`` answers ``/tokenize`` and ``/detokenize`` itself, and ``/tokenizer_info``
from the ``tokenizer_config.json`` beside it; it has no chat template to apply, so a chat is
refused (tokenize its rendered text). A pool counting bytes has no model tokenizer: refused.

Each call needs a tenant's key and takes one of its ``max_inflight`` turns to tokenize, as a
prompt's count does. ``model`` may be left out where the frontend serves one pool (lm-eval
sends none)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from limiter import token_count
from limiter.config import PoolConfig, QosConfig
from limiter.frontend import openai_api as oa
from limiter.frontend.errors import ApiError
from limiter.frontend.openai_api import bad

log = logging.getLogger("qos.frontend")

TOKENIZE_FIELDS = ("model", "prompt", "add_special_tokens", "return_token_strs")
# a chat's, as vLLM's TokenizeChatRequest takes them (relayed: only a model server applies a template)
TOKENIZE_CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message",
                        "add_special_tokens", "return_token_strs", "chat_template_kwargs", "tools",
                        "mm_processor_kwargs")
DETOKENIZE_FIELDS = ("model", "tokens")
MAX_TOKEN_ID = 2**31 - 1


def dumps(obj: Any) -> str:
    """An answer's JSON: a tokenizer's configuration may hold an integer past 64 bits (an
    unbounded ``model_max_length`` is saved as int(1e30)), which orjson refuses."""
    try:
        return oa.compact_json(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def pool_of(cfg: QosConfig, model: Any) -> PoolConfig:
    """The pool ``model`` names; without one, the only pool this deployment serves."""
    if model is None:
        if len(cfg.pools) == 1:
            return cfg.pools[0]
        served = ", ".join(p.model_name for p in cfg.pools)
        raise bad("model", f"'model' is required: this deployment serves {served}",
                  "missing_required_parameter")
    return oa.resolve_pool(cfg, {"model": model})


def _known(body: Mapping[str, Any], fields: tuple[str, ...]) -> None:
    for key in body:
        if key not in fields:
            raise bad(key, f"Unrecognized request argument supplied: {key}", "unknown_parameter")


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(key, f"'{key}' must be a boolean", "invalid_type")
    return value


def _no_tokenizer(pool: PoolConfig) -> ApiError:
    return bad("model", f"Model '{pool.model_name}' counts bytes: it has no model tokenizer to serve "
               "(its pool's tokenizer must be a tokenizer.json or \"upstream\")", "unsupported_value")


def check_tokenize(pool: PoolConfig, kind: str, body: Mapping[str, Any]) -> None:
    """A ``/tokenize`` body, checked (a 400 naming the field)."""
    if kind == token_count.BYTES:
        raise _no_tokenizer(pool)
    if "messages" in body:
        if kind != token_count.UPSTREAM:
            raise bad("messages", f"Model '{pool.model_name}' counts in a tokenizer.json, which holds no "
                      "chat template: tokenize the chat's rendered text as 'prompt'", "unsupported_value")
        _known(body, TOKENIZE_CHAT_FIELDS)
        # held to what the chat completions path takes (relayed unchecked, an image_url part had
        # the model server fetch any URL, an internal one included, on this service's word)
        oa._messages(body["messages"], tool_calls=True)
        for key in ("chat_template_kwargs", "mm_processor_kwargs"):
            if body.get(key) is not None:
                oa._passed(body[key], key)
        if body.get("tools") is not None:
            oa._tools(body["tools"])
        for key in ("add_generation_prompt", "continue_final_message"):
            _flag(body, key, False)
    else:
        _known(body, TOKENIZE_FIELDS)
        if not isinstance(body.get("prompt"), str):
            raise bad("prompt", "'prompt' is required, a string (or send 'messages')",
                      "missing_required_parameter" if "prompt" not in body else "invalid_type")
        oa._text(body["prompt"], "prompt")  # a lone surrogate (a \\ud800 escape): no text to encode
    _flag(body, "add_special_tokens", True)
    _flag(body, "return_token_strs", False)


def check_detokenize(pool: PoolConfig, kind: str, body: Mapping[str, Any]) -> list[int]:
    """A ``/detokenize`` body's token ids, checked (a 400 naming the field)."""
    if kind == token_count.BYTES:
        raise _no_tokenizer(pool)
    _known(body, DETOKENIZE_FIELDS)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise bad("tokens", f"'tokens' must be an array of token ids (integers in [0, {MAX_TOKEN_ID}])",
                  "invalid_type")
    return ids


async def tokenize(pool: PoolConfig, counter: token_count.Counter, body: Mapping[str, Any]) -> dict[str, Any]:
    check_tokenize(pool, counter.kind, body)
    if isinstance(counter, token_count.UpstreamCounter):
        return await _relayed(pool, counter, "/tokenize", body)
    assert isinstance(counter, token_count.FileCounter)
    ids, strs = await counter.encode(body["prompt"], _flag(body, "add_special_tokens", True))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": pool.context_tokens, "tokens": ids}
    if _flag(body, "return_token_strs", False):
        out["token_strs"] = strs
    return out


async def detokenize(pool: PoolConfig, counter: token_count.Counter,
                     body: Mapping[str, Any]) -> dict[str, Any]:
    ids = check_detokenize(pool, counter.kind, body)
    if isinstance(counter, token_count.UpstreamCounter):
        return await _relayed(pool, counter, "/detokenize", body)
    assert isinstance(counter, token_count.FileCounter)
    if ids and (top := max(ids)) > (most := counter.max_token_id() or 0):
        raise bad("tokens", f"'tokens' holds the token id {top} at {ids.index(top)}: this model's vocabulary "
                  f"ends at {most}", "invalid_value")
    return {"prompt": await counter.decode(ids)}


async def tokenizer_info(pool: PoolConfig, counter: token_count.Counter) -> dict[str, Any]:
    if counter.kind == token_count.BYTES:
        raise _no_tokenizer(pool)
    if isinstance(counter, token_count.UpstreamCounter):
        return await _relayed(pool, counter, "/tokenizer_info", None)
    assert isinstance(counter, token_count.FileCounter)
    return counter.info()


async def _relayed(pool: PoolConfig, counter: token_count.UpstreamCounter, path: str,
                   body: Mapping[str, Any] | None) -> dict[str, Any]:
    """The model server's answer to ``path``. Its own words on a refusal stay in the log (they
    may name its internals); the client reads what happened."""
    try:
        status, data = await counter.relay(path, body)
    except token_count.TokenizerUnavailable as exc:
        log.warning("pool %s: the model server's %s could not be asked: %s", pool.name, path, exc)
        raise _unavailable(path) from exc
    if status == 200 and isinstance(data, dict):
        return data
    log.info("pool %s: the model server answered %s with HTTP %d: %.300s", pool.name, path, status, data)
    if status == 404:
        hint = " (vLLM serves it with --enable-tokenizer-info-endpoint)" if path == "/tokenizer_info" else ""
        raise ApiError(404, f"The model server of '{pool.model_name}' does not serve {path}{hint}",
                       code="not_found", outcome="not_found")
    if status in token_count.REFUSING_STATUSES:
        raise ApiError(400, f"The model server refused this {path[1:]} request (HTTP {status}); check "
                       "its body", code="tokenizer_refused")
    raise _unavailable(path)


def _unavailable(path: str) -> ApiError:
    return ApiError(503, f"Service temporarily unavailable: the model server could not answer {path}; retry "
                    "shortly", code="tokenizer_unavailable", retry_after_s=1, outcome="unavailable")
