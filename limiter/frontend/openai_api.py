"""The OpenAI wire format: strict request validation, response and chunk builders.

Validation turns a JSON body into a :class:`GenerationRequest` or raises :class:`ApiError`
naming the offending field in ``param`` — before anything touches Redis, so a bad request
is never admitted or charged. Fields OpenAI defines but this service does not implement
are accepted only at their neutral value (``n: 1``, ``logprobs: false``, ...); anything
else, and any field neither OpenAI nor vLLM (``ignore_eos``, ``min_tokens``,
``stream_options.continuous_usage_stats``; ``repetition_penalty``/``top_k``/``min_p`` at
neutral) defines, is a 400 naming it — the same as OpenAI's own API.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from limiter.config import PoolConfig, QosConfig
from limiter.frontend.errors import ApiError
from limiter.prompt import CHAT_ROLES, DEFAULTABLE, ChatMessage, Payload, is_token_id, render_chat
from limiter.reply_text import REASONING_FIELDS, Logprob

INT64 = (-(2**63), 2**63 - 1)


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


# --- the typed request ---------------------------------------------------------------------

@dataclass(frozen=True)
class GenerationRequest:
    kind: str  # "chat" | "completion"
    model: str
    pool: PoolConfig
    prompt: str  # rendered: what the engine sees
    prompt_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats (with include_usage)
    ignore_eos: bool = False  # vLLM: keep generating past the end-of-sequence token
    min_tokens: int = 0  # vLLM: no end-of-sequence before this many tokens
    messages: tuple[ChatMessage, ...] = ()  # chat: the messages as data (the openai engine sends these)
    defaulted: tuple[str, ...] = ()  # sampling fields the client left out (Payload.defaulted)
    # the pool's upstream_fields the client sent, for the model server (Payload.upstream)
    upstream: Mapping[str, Any] = field(default_factory=dict)
    # a completion's `echo`: the answer's text begins with the prompt (with logprobs, the prompt's
    # tokens' come first: the model server is asked to echo, and the worker takes the echo apart)
    echo: bool = False
    prompt_ids: tuple[int, ...] = ()  # a completion's token-id prompt (then ``prompt`` is "")

    def payload(self) -> Payload:
        return Payload(kind=self.kind, prompt=self.prompt, max_tokens=self.max_tokens,
                       temperature=self.temperature, top_p=self.top_p, stop=self.stop, seed=self.seed,
                       model=self.model, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                       messages=self.messages, stream=self.stream, defaulted=self.defaulted,
                       upstream=self.upstream, prompt_ids=self.prompt_ids,
                       grouped_tokens=True,  # this frontend reads grouped entries (replies.py)
                       aside_logprobs=True)  # and NUL L (limiter/reply_text.py)


# The longest integer a body may hold: no field means anything past 2**64 (20 digits), and
# Python's own limit (4,300) answers with advice about sys.set_int_max_str_digits().
MAX_INT_DIGITS = 100


class _BadNumber(ValueError):
    """A number JSON allows but a request cannot hold; its text is the client's answer."""


def _reject_constant(name: str) -> Any:
    raise _BadNumber(f"{name} is not valid JSON")


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _BadNumber(f"an integer has more than {MAX_INT_DIGITS} digits")
    return int(text)


def _parse_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):  # 1e400 parses as inf, which no field takes
        raise _BadNumber(f"the number {text[:24]} is out of range")
    return v


def parse_json(raw: bytes) -> dict[str, Any]:
    """Strict JSON: an object, UTF-8, no NaN/Infinity, no number past a float's range or
    ``MAX_INT_DIGITS`` digits."""
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int,
                          parse_float=_parse_float)
    except (_BadNumber, json.JSONDecodeError) as exc:  # ours, or the parser's: where, what it expected
        raise bad(None, f"request body is not valid JSON: {exc}", "invalid_json") from exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        why = " (not UTF-8)" if isinstance(exc, UnicodeDecodeError) else \
            " (nested too deeply)" if isinstance(exc, RecursionError) else ""
        raise bad(None, f"request body is not valid JSON{why}", "invalid_json") from exc
    if not isinstance(body, dict):
        raise bad(None, "request body must be a JSON object", "invalid_json")
    return body


# Fields per endpoint. Value: a checker returning True when the (non-null) value is the
# neutral one we accept without implementing, or None for fields we implement.
_NEUTRAL: dict[str, Any] = {
    "n": lambda v: _is_int(v) and v == 1,  # (more: split_choices, one request each)
    "frequency_penalty": lambda v: _is_num(v) and v == 0,
    "presence_penalty": lambda v: _is_num(v) and v == 0,
    "logit_bias": lambda v: isinstance(v, dict) and not v,
    # vLLM's sampling extensions (``vllm bench serve`` sends repetition_penalty 1.0; top_k and
    # min_p come from its --top-k / --min-p): accepted at the value that turns them off.
    "repetition_penalty": lambda v: _is_num(v) and v == 1,
    "top_k": lambda v: _is_int(v) and v in (-1, 0),
    "min_p": lambda v: _is_num(v) and v == 0,
    "skip_special_tokens": lambda v: v is True,
    # OpenAI's: stored completions (``store: true``) and a paid tier are not offered here
    "store": lambda v: v is False,
    "service_tier": lambda v: v in ("auto", "default"),
}
_CHAT_NEUTRAL: dict[str, Any] = {
    **_NEUTRAL,
    "logprobs": lambda v: v is False,
    "top_logprobs": lambda v: _is_int(v) and v == 0,
    "response_format": lambda v: v == {"type": "text"},
    "parallel_tool_calls": lambda v: isinstance(v, bool),
    # no tools: what a client that always sends the tool fields sends when it has none
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "modalities": lambda v: v == ["text"],
    # no neutral value: a reasoning model's effort, predicted outputs and web search change
    # what is generated, which the engines here do not do (refused, not silently ignored)
    "reasoning_effort": lambda v: False,
    "prediction": lambda v: False,
    "web_search_options": lambda v: False,
}
# Fields of an assistant message as OpenAI (and vLLM) return it: a client that appends the
# answer it got to its next request's messages sends them back, at these values.
_MESSAGE_NEUTRAL: dict[str, Any] = {
    "refusal": lambda v: v is None,
    "tool_calls": lambda v: v is None or v == [],
    "function_call": lambda v: v is None,
    "audio": lambda v: v is None,
    "annotations": lambda v: v is None or v == [],
    # the OpenAI SDK's parse() and stream() helpers answer a ParsedChatCompletionMessage, whose
    # ``parsed`` (the response_format's object) is null without one: appended, it comes back
    "parsed": lambda v: v is None,
}
_COMPLETION_NEUTRAL: dict[str, Any] = {
    **_NEUTRAL,
    # Any number asks for logprobs, 0 too (the sampled token's: OpenAI's and vLLM's answer
    # then has a logprobs object): not served, so refused, not answered with null.
    "logprobs": lambda v: False,
    "best_of": lambda v: _is_int(v) and v == 1,
    "suffix": lambda v: v == "",
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "user",
           "ignore_eos", "min_tokens", "metadata", "safety_identifier", "prompt_cache_key"}
# OpenAI's end-user and cache ids, accepted (type-checked) and not used: what they steer
# (abuse tracking, OpenAI's prompt cache routing) does not exist here.
_IDS = ("user", "safety_identifier", "prompt_cache_key")
MAX_METADATA_PAIRS = 16  # OpenAI's limit, with keys of at most 64 and values of 512 characters
# OpenAI allows 4 stop sequences, vLLM any number (lm-eval sends more); bounded, as every
# stop string is checked against each step's text
MAX_STOP = 32
# Stored with the request and checked against its text, not counted as prompt tokens: bounded
# (32 stop strings of 6 KB each, in a chat of 54 counted tokens, stored 200 KB uncharged).
MAX_STOP_BYTES = 4096
MAX_MESSAGE_ID_CHARS = 256  # a message's name / tool_call_id (OpenAI's names are 64 at most)
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_obfuscation")
_CHAT = _COMMON | {"messages", "max_completion_tokens"}
_COMPLETION = _COMMON | {"prompt", "echo"}


def _is_int(v: Any) -> bool:
    """An integer, or a number that is one (``5.0``: vLLM's validation takes it, and some
    clients' JSON writes every number as a float)."""
    if isinstance(v, float):
        return math.isfinite(v) and v.is_integer()
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v: Any) -> Any:
    """``v`` as an int when :func:`_is_int` holds (``5.0`` -> 5), else ``v`` unchanged."""
    return int(v) if isinstance(v, float) and _is_int(v) else v


def _is_num(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    # An int is always finite; math.isfinite() raises OverflowError for one past a float.
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))


def _text(v: Any, param: str) -> str:
    if not isinstance(v, str):
        raise bad(param, f"'{param}' must be a string, got {_type_name(v)}", "invalid_type")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates from a \\ud800 escape
        raise bad(param, f"'{param}' is not valid Unicode text", "invalid_type") from exc
    return v


# A passed-through value is the model server's to judge, but it must be storable (msgpack:
# 64-bit integers, valid UTF-8) and bounded in depth (the check recurses).
MAX_PASSED_DEPTH = 32
# Keys vLLM lets chat_template_kwargs set over its own template arguments: the worker sets the
# first two itself (a resume continues the answer), the others replace the conversation or
# carry a template or text the frontend never counted.
CHAT_TEMPLATE_KWARGS_RESERVED = frozenset({
    "add_generation_prompt", "continue_final_message", "conversation", "chat_template", "tools",
    "documents", "messages", "tokenize"})


def _id_text(v: Any, param: str) -> str:
    """An id or a name (a message's name, a tool call's id and function name): text of at most
    MAX_MESSAGE_ID_CHARS, stored with the request and never counted as prompt tokens."""
    text = _text(v, param)
    if len(text) > MAX_MESSAGE_ID_CHARS:
        raise bad(param, f"'{param}' may be at most {MAX_MESSAGE_ID_CHARS} characters")
    return text


def _passed(v: Any, param: str, depth: int = 0) -> Any:
    """``v`` when it can go to the model server as sent, else a 400 naming ``param``."""
    if depth > MAX_PASSED_DEPTH:
        raise bad(param, f"'{param}' is nested more than {MAX_PASSED_DEPTH} levels deep")
    if depth == 0 and param == "chat_template_kwargs":
        # vLLM's is an object of the template's arguments (the count applies it too)
        if not isinstance(v, dict):
            raise bad(param, f"'{param}' must be an object, got {_type_name(v)}", "invalid_type")
        for k in v:
            if k in CHAT_TEMPLATE_KWARGS_RESERVED:
                raise bad(f"{param}.{k}", f"'{param}.{k}' is set by this service, or carries a "
                          "template or text it does not count: it cannot be passed through",
                          "unsupported_value")
    if isinstance(v, str):
        return _text(v, param)
    if isinstance(v, int) and not isinstance(v, bool) and not INT64[0] <= v <= INT64[1]:
        raise bad(param, f"'{param}' holds an integer past 64 bits", "invalid_value")
    if isinstance(v, list):
        return [_passed(x, f"{param}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, dict):
        return {_text(k, param): _passed(x, f"{param}.{k[:64]}", depth + 1) for k, x in v.items()}
    return v  # bool, None, a finite float (parse_json took no other)


def _metadata(v: Any) -> None:
    """OpenAI's ``metadata``: up to 16 string pairs (kept by OpenAI with stored completions;
    accepted and not used here)."""
    if v is None:
        return
    if not isinstance(v, dict):
        raise bad("metadata", f"'metadata' must be an object, got {_type_name(v)}", "invalid_type")
    if len(v) > MAX_METADATA_PAIRS:
        raise bad("metadata", f"'metadata' may hold at most {MAX_METADATA_PAIRS} pairs, got {len(v)}")
    for k, val in v.items():
        param = f"metadata.{k[:64]}"
        _text(val, param)
        if len(k) > 64 or len(val) > 512:
            raise bad(param, "metadata keys may be at most 64 characters, values 512")


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(v), type(v).__name__)


def resolve_pool(cfg: QosConfig, body: Mapping[str, Any]) -> PoolConfig:
    model = body.get("model")
    if model is None:
        raise bad("model", "'model' is required", "missing_required_parameter")
    _text(model, "model")
    for p in cfg.pools:
        if p.model_name == model:
            return p
    served = ", ".join(p.model_name for p in cfg.pools)
    raise ApiError(404, f"The model '{model[:200]}' does not exist (this deployment serves: {served})",
                   code="model_not_found", param="model", outcome="not_found")


# Tool calling (a pool with tool_calls on: config.py PoolConfig.tool_calls). OpenAI's bounds:
# 128 tools a request. A function's name is any text (vLLM's, the model server's, as it takes
# it: an MCP client's "server.tool", a pydantic generic's "Resp[int]"; OpenAI's own API holds
# names to 64 of [A-Za-z0-9_-]), bounded as the other names here.
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # in one assistant message sent back
TOOL_CHOICES = ("none", "auto", "required")


def _keys(v: Any, param: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """``v`` as an object of ``allowed`` keys holding every ``required`` one, else a 400."""
    if not isinstance(v, dict):
        raise bad(param, f"'{param}' must be an object, got {_type_name(v)}", "invalid_type")
    for k in v:
        if k not in allowed:
            raise bad(f"{param}.{k[:64]}", f"unrecognized field '{param}.{k[:64]}'", "unknown_parameter")
    for k in required:
        if v.get(k) is None:
            raise bad(f"{param}.{k}", f"'{param}.{k}' is required", "missing_required_parameter")
    return v


def _function_name(v: Any, param: str) -> str:
    name = _id_text(v, param)
    if not name:
        raise bad(param, f"'{param}' may not be empty")
    return name


def _tools(v: Any) -> list[dict[str, Any]]:
    """The request's ``tools``: function tools, each ``{type: "function", function: {name,
    description?, parameters?, strict?}}``; the schema is the model server's to judge."""
    if not isinstance(v, list):
        raise bad("tools", f"'tools' must be an array, got {_type_name(v)}", "invalid_type")
    if len(v) > MAX_TOOLS:
        raise bad("tools", f"'tools' may hold at most {MAX_TOOLS} tools, got {len(v)}")
    names: set[str] = set()
    for i, t in enumerate(v):
        p = f"tools[{i}]"
        _keys(t, p, ("type", "function"), ("type", "function"))
        if t["type"] != "function":
            raise bad(f"{p}.type", f"'{p}.type' must be \"function\" (the only tool type served)",
                      "unsupported_value")
        f = _keys(t["function"], f"{p}.function", ("name", "description", "parameters", "strict"), ("name",))
        name = _function_name(f["name"], f"{p}.function.name")
        if name in names:
            raise bad(f"{p}.function.name", f"'{p}.function.name' {name!r} names a tool twice")
        names.add(name)
        if f.get("description") is not None:
            _text(f["description"], f"{p}.function.description")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise bad(f"{p}.function.parameters", f"'{p}.function.parameters' must be a JSON Schema "
                      f"object, got {_type_name(f['parameters'])}", "invalid_type")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise bad(f"{p}.function.strict", f"'{p}.function.strict' must be a boolean", "invalid_type")
    return _passed(v, "tools")


def _tool_choice(v: Any, tools: list[dict[str, Any]]) -> Any:
    """``tool_choice``: none | auto | required, or ``{type: "function", function: {name}}``
    naming one of ``tools``; any but "none" needs tools (as OpenAI)."""
    if isinstance(v, str):
        if v not in TOOL_CHOICES:
            raise bad("tool_choice", f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or an object "
                      f"naming a function, got {v[:40]!r}")
    else:
        _keys(v, "tool_choice", ("type", "function"), ("type", "function"))
        if v["type"] != "function":
            raise bad("tool_choice.type", "'tool_choice.type' must be \"function\"", "unsupported_value")
        f = _keys(v["function"], "tool_choice.function", ("name",), ("name",))
        name = _function_name(f["name"], "tool_choice.function.name")
        if name not in {t["function"]["name"] for t in tools}:
            raise bad("tool_choice.function.name", f"'tool_choice' names {name!r}, which is not among "
                      "'tools'")
    if v != "none" and not tools:
        raise bad("tool_choice", "'tool_choice' is only allowed when 'tools' are given")
    return v


def _message_tool_calls(v: Any, p: str) -> tuple[dict[str, Any], ...]:
    """An assistant message's ``tool_calls`` sent back: ``[{id, type: "function", function:
    {name, arguments}}]``, the arguments a JSON text as the model wrote it. What the OpenAI
    SDK's parse() and stream() helpers keep on a call they answered, and send back when the
    answer is appended (its stream ``index``, the ``function.parsed_arguments`` it parsed from
    the arguments), is accepted and not sent on: the arguments are the call."""
    if not isinstance(v, list):
        raise bad(p, f"'{p}' must be an array, got {_type_name(v)}", "invalid_type")
    if len(v) > MAX_TOOL_CALLS:
        raise bad(p, f"'{p}' may hold at most {MAX_TOOL_CALLS} calls, got {len(v)}")
    out = []
    for i, c in enumerate(v):
        cp = f"{p}[{i}]"
        _keys(c, cp, ("id", "type", "function", "index"), ("id", "function"))
        _id_text(c["id"], f"{cp}.id")
        if c.get("type", "function") != "function":
            raise bad(f"{cp}.type", f"'{cp}.type' must be \"function\"", "unsupported_value")
        if c.get("index") is not None and not (_is_int(c["index"]) and c["index"] >= 0):
            raise bad(f"{cp}.index", f"'{cp}.index' must be a non-negative integer", "invalid_type")
        f = _keys(c["function"], f"{cp}.function", ("name", "arguments", "parsed_arguments"),
                  ("name", "arguments"))
        if f.get("parsed_arguments") is not None and not isinstance(f["parsed_arguments"], dict):
            raise bad(f"{cp}.function.parsed_arguments", f"'{cp}.function.parsed_arguments' must be an "
                      f"object, got {_type_name(f['parsed_arguments'])}", "invalid_type")
        # The name the model wrote, not the tools' pattern: a model server's parser does not
        # hold a call to the tools offered (vLLM's hermes reads any name), and an answer of
        # this service's that a client sends back must not be refused (its agent loop ended)
        _id_text(f["name"], f"{cp}.function.name")
        out.append({"id": c["id"], "type": "function",
                    "function": {"name": f["name"],
                                 "arguments": _text(f["arguments"], f"{cp}.function.arguments")}})
    return tuple(out)


def _messages(v: Any, tool_calls: bool = False, structured: bool = False) -> list[ChatMessage]:
    """``tool_calls``: the pool calls tools, so an assistant message may carry its calls;
    ``structured``: it answers to a schema, so an answer the OpenAI SDK's ``parse()`` read
    may come back with its ``parsed`` object (accepted, not sent on: the content is the
    answer)."""
    if v is None:
        raise bad("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(v, list) or not v:
        raise bad("messages", "'messages' must be a non-empty array", "invalid_type")
    out = []
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(p, f"'{p}' must be an object, got {_type_name(m)}", "invalid_type")
        for k in m:
            if (k == "tool_calls" and tool_calls) or (k == "parsed" and structured):
                continue
            if k in _MESSAGE_NEUTRAL:
                if not _MESSAGE_NEUTRAL[k](m[k]):
                    raise bad(f"{p}.{k}", f"'{p}.{k}' = {json.dumps(m[k])[:100]} is not supported by this "
                              "service (only its neutral value is accepted)", "unsupported_value")
            elif k not in ("role", "content", "name", "tool_call_id", *REASONING_FIELDS):
                raise bad(f"{p}.{k}", f"unrecognized field '{p}.{k}'", "unknown_parameter")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system message
            role = "system"
        if role not in CHAT_ROLES:
            raise bad(f"{p}.role", f"'{p}.role' must be one of {', '.join((*CHAT_ROLES, 'developer'))}")
        extra = {}
        for k in ("name", "tool_call_id"):
            if m.get(k) is not None:
                extra[k] = _id_text(m[k], f"{p}.{k}")
        # An earlier answer's thinking, sent back (vLLM's `reasoning`, or `reasoning_content`):
        # kept, and sent upstream under the client's name for it, for the chat templates of
        # interleaved-thinking models that render it; the others drop it.
        reasoning = None
        for k in REASONING_FIELDS:
            if m.get(k) is not None:
                text = _text(m[k], f"{p}.{k}")  # both checked, the first kept
                reasoning = reasoning or (k, text)
        calls: tuple[dict[str, Any], ...] = ()
        # (is not None: junk that is falsy -- 0, "", false, {} -- is a 400, not taken for no calls)
        if tool_calls and m.get("tool_calls") is not None and m["tool_calls"] != []:
            if role != "assistant":
                raise bad(f"{p}.tool_calls", f"'{p}.tool_calls' is only allowed in an assistant message")
            calls = _message_tool_calls(m["tool_calls"], f"{p}.tool_calls")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                pp = f"{p}.content[{j}]"
                if not isinstance(part, dict) or part.get("type") != "text" or set(part) != {"type", "text"}:
                    raise bad(pp, f"'{pp}' must be {{\"type\": \"text\", \"text\": str}} (only text parts "
                              "are supported)", "invalid_type")
                texts.append(_text(part["text"], f"{pp}.text"))
            # as vLLM joins text parts for its (usual) string-content chat templates; joined
            # with nothing, ["Hello", "world"] reached the model as "Helloworld"
            content = "\n".join(texts)
        elif content is None:
            if not calls:  # an assistant turn that only called tools has none (OpenAI's null)
                raise bad(f"{p}.content", f"'{p}.content' is required", "missing_required_parameter")
            content = ""
        out.append(ChatMessage(role, _text(content, f"{p}.content"), extra.get("name"),
                               extra.get("tool_call_id"), reasoning, calls))
    return out


MAX_TOKEN_ID = 2**31 - 1  # a vocabulary's ids are far below it (vLLM's are int32)


def _token_ids(v: list[Any], pool: PoolConfig) -> tuple[int, ...] | None:
    """``v`` as a token-id prompt (vLLM's ``prompt: [int]``, or a batch of one: ``[[int]]``),
    None when it is not one. Served where the pool counts in its model's tokenizer (a
    tokenizer.json or the model server's): the ids are then that model's, and their count
    is the prompt's tokens, exactly."""
    one = len(v) == 1 and isinstance(v[0], list)
    ids = v[0] if one else v
    if not ids:
        return None
    other = next(((i, t) for i, t in enumerate(ids) if not is_token_id(t)), None)
    if other is not None:
        if not one and not any(is_token_id(t) for t in ids):
            return None  # not ids at all (a batch of texts)
        i, t = other
        shown = json.dumps(t)
        hint = (" (lm-eval sends null as a rolling window's first token when its tokenizer has neither "
                "a BOS nor an EOS token: give it custom_prefix_token_id)") if t is None else ""
        raise bad("prompt", f"'prompt' holds {shown if len(shown) <= 24 else shown[:21] + '...'} at {i}, "
                  f"not a token id (an integer){hint}", "invalid_type")
    if pool.tokenizer == "bytes":
        raise bad("prompt", "token-id prompts are served by a pool that counts in its model's tokenizer "
                  "(tokenizer = a tokenizer.json or \"upstream\", in front of a model server); this one "
                  "counts bytes: send the prompt's text", "unsupported_value")
    for i, t in enumerate(ids):
        if not 0 <= t <= MAX_TOKEN_ID:
            raise bad("prompt", f"'prompt' holds the token id {t} at {i}: ids are in [0, {MAX_TOKEN_ID}]")
    return tuple(ids)


def _prompt(v: Any, pool: PoolConfig) -> tuple[str, tuple[int, ...]]:
    """A completion's prompt: its text, or its token ids (:func:`_token_ids`) with no text."""
    if v is None:
        raise bad("prompt", "'prompt' is required", "missing_required_parameter")
    if isinstance(v, list):
        if (ids := _token_ids(v, pool)) is not None:
            return "", ids
        if len(v) != 1 or not isinstance(v[0], str):
            raise bad("prompt", "'prompt' must be a string, an array of token ids, or an array of prompts "
                      "all of one kind (strings, or arrays of token ids)", "invalid_type")
        v = v[0]
    return _text(v, "prompt"), ()


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise bad(name, f"'{name}' must be a number, got {_type_name(v)}", "invalid_type")
    if v > hi or v < lo or (lo_open and v == lo):
        shown = repr(v) if len(repr(v)) <= 24 else repr(v)[:21] + "..."
        raise bad(name, f"'{name}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {shown}")
    return float(v)


def _tool_fields(body: Mapping[str, Any], upstream: dict[str, Any]) -> None:
    """A tool_calls pool's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked and
    put among the fields for the model server. No tools (absent, null or ``[]``) sends none of
    the three: the server answers as it does a request without them."""
    tools = body.get("tools")
    tools = [] if tools is None else _tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        choice = _tool_choice(choice, tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean, got "
                  f"{_type_name(parallel)}", "invalid_type")
    if not tools:
        return
    upstream["tools"] = tools
    if choice is not None:
        upstream["tool_choice"] = choice
    if parallel is not None:
        upstream["parallel_tool_calls"] = parallel


LOGPROB_FIELDS = ("logprobs", "top_logprobs")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _response_format(v: Any) -> dict[str, Any] | None:
    """A structured_outputs pool's ``response_format``: ``{type: "text"}`` (None: nothing to
    send), ``{type: "json_object"}``, or ``{type: "json_schema", json_schema: {name,
    description?, schema?, strict?}}`` (OpenAI's shape; the schema is the model server's to
    judge, as a tool's parameters). The name is a label, any text as vLLM takes it, not
    OpenAI's pattern: the SDK's ``parse()`` names it after a generic pydantic model
    (``Resp[int]``), LangChain after a JSON schema's title (``"Weather report"``)."""
    rf = _keys(v, "response_format", ("type", "json_schema"), ("type",))
    kind = rf["type"]
    if kind not in RESPONSE_FORMATS:
        raise bad("response_format.type", "'response_format.type' must be one of "
                  f"{', '.join(RESPONSE_FORMATS)}, got {json.dumps(kind)[:40]}")
    if kind != "json_schema":
        if "json_schema" in rf:
            raise bad("response_format.json_schema", "'response_format.json_schema' is only allowed with "
                      "type json_schema", "unknown_parameter")
        return None if kind == "text" else {"type": kind}
    p = "response_format.json_schema"
    js = _keys(rf.get("json_schema"), p, ("name", "description", "schema", "strict"), ("name",))
    _id_text(js["name"], f"{p}.name")
    if js.get("description") is not None:
        _text(js["description"], f"{p}.description")
    if js.get("schema") is not None and not isinstance(js["schema"], dict):
        raise bad(f"{p}.schema", f"'{p}.schema' must be a JSON Schema object, got {_type_name(js['schema'])}",
                  "invalid_type")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise bad(f"{p}.strict", f"'{p}.strict' must be a boolean", "invalid_type")
    return _passed(rf, "response_format")


def _count_field(body: Mapping[str, Any], name: str, most: int) -> int | None:
    """``body[name]`` as an integer in [0, ``most``], None when absent or null; else a 400."""
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(name, f"'{name}' must be an integer, got {_type_name(v)}", "invalid_type")
    if not 0 <= v <= most:
        raise bad(name, f"'{name}' must be in [0, {most}] (this model's max_logprobs), got {int(v)}")
    return int(v)


def _logprob_fields(kind: str, body: Mapping[str, Any], pool: PoolConfig, upstream: dict[str, Any]) -> None:
    """A logprobs pool's ``logprobs`` (a chat's boolean and its ``top_logprobs``, a
    completion's count of alternatives), checked and put among the fields for the model
    server, as vLLM takes them; not asked for (false, null), none is sent."""
    if kind != "chat":
        n = _count_field(body, "logprobs", pool.max_logprobs)
        if n is not None:
            upstream["logprobs"] = n
        return
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad("logprobs", f"'logprobs' must be a boolean, got {_type_name(on)}", "invalid_type")
    top = _count_field(body, "top_logprobs", pool.max_logprobs)
    if not on:
        if top:  # (0 without logprobs: what a client that always sends the field sends)
            raise bad("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
        return
    upstream["logprobs"] = True
    if top is not None:
        upstream["top_logprobs"] = top


def _echo(v: Any, upstream: dict[str, Any], token_ids: bool) -> bool:
    """A completion's ``echo``: whether the frontend puts the prompt before the answer's text
    itself. With logprobs asked for, the prompt's tokens' logprobs are the model server's,
    which it is asked to echo (vLLM then returns the prompt's logprobs first: lm-eval's
    loglikelihood tasks read them); a token-id prompt's text is the server's too (the
    frontend has none): its echo is forwarded as it comes."""
    if v is None or v is False:
        return False
    if v is not True:
        raise bad("echo", f"'echo' must be a boolean, got {_type_name(v)}", "invalid_type")
    if "logprobs" in upstream or token_ids:
        upstream["echo"] = True
    return not token_ids


def _served_by(kind: str, field: str) -> str:
    """For the 400 of a field a pool takes only at its neutral value: the pool setting that
    serves it, if one does."""
    if kind == "chat" and field in TOOL_FIELDS:
        return (" in this pool: tool calling is served by a pool with tool_calls = true, in front of a "
                "model server that calls tools")
    if field in LOGPROB_FIELDS:
        return (" in this pool: logprobs are served by a pool with logprobs = true, in front of a model "
                "server that returns them")
    if kind == "chat" and field == "reasoning_effort":
        return (" in this pool: a reasoning model's effort is passed to its model server by a pool that "
                "lists reasoning_effort in upstream_fields")
    if kind == "chat" and field == "response_format":
        return (" in this pool: JSON answers are served by a pool with structured_outputs = true, in front "
                "of a model server that holds answers to a schema")
    return ""


# Answers one request may ask for (``n`` times its prompts): each is a request of its own.
MAX_CHOICES = 64


def split_choices(kind: str, body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """(one body per answer, ``n``) for a body asking for several -- ``n`` > 1, or a
    completion's ``prompt`` as several prompts (texts, or token-id lists: lm-eval's
    ``batch_size``) -- each with one prompt and ``n`` 1, in vLLM's order of choices (each
    prompt's ``n`` in turn); ``([body], 1)`` for one. A ``seed`` goes to the ``j``-th copy as
    ``seed ^ j``: the copies sample apart, reproducibly (vLLM's ``n`` samples ``n`` sequences
    of one seeded generator)."""
    n = _int(body.get("n"))
    if n is None:
        n = 1
    elif not _is_int(n):
        raise bad("n", f"'n' must be an integer, got {_type_name(n)}", "invalid_type")
    elif not 1 <= n <= MAX_CHOICES:
        raise bad("n", f"'n' must be in [1, {MAX_CHOICES}], got {n}")
    prompts = body.get("prompt")
    # (a list of lists is token-id prompts: one holding texts or lists, ``[["a"], ["b"]]`` or
    # ``[[[1]], [[2]]]``, is none of vLLM's prompt shapes, and its 400 is parse_request's)
    several = kind != "chat" and isinstance(prompts, list) and len(prompts) > 1 and (
        all(isinstance(p, str) for p in prompts)
        or all(isinstance(p, list) and not any(isinstance(t, list | str) for t in p) for p in prompts))
    if not several:
        prompts = [prompts]
    if n == 1 and not several:
        return [dict(body)], 1
    if len(prompts) * n > MAX_CHOICES:
        raise bad("prompt" if several else "n", f"{len(prompts)} prompts x n {n} ask for {len(prompts) * n} "
                  f"answers; at most {MAX_CHOICES} a request")
    seed = _int(body.get("seed"))
    out = []
    for prompt in prompts:
        for j in range(n):
            one = {**body, "prompt": prompt} if several else dict(body)
            if "n" in body:
                one["n"] = 1
            if j and _is_int(seed):
                one["seed"] = seed ^ j
            out.append(one)
    return out, n


@dataclass(frozen=True)
class Draft:
    """A body whose every field is checked except what depends on the prompt's token count
    (the context check, ``max_tokens``' room and default, ``min_tokens`` against them):
    counting may need the model server (``tokenizer = "upstream"``), so it comes last."""

    kind: str
    pool: PoolConfig
    prompt: str
    prompt_param: str
    messages: tuple[ChatMessage, ...]
    max_tokens: int | None
    max_param: str
    min_tokens: int
    fields: dict[str, Any]
    prompt_ids: tuple[int, ...] = ()  # a completion's token-id prompt (then ``prompt`` is "")


def parse_request(kind: str, body: Mapping[str, Any], cfg: QosConfig,
                  pool: PoolConfig | None = None) -> Draft:
    """Check every field of a /v1/chat/completions (``kind='chat'``) or /v1/completions body
    that does not depend on the prompt's token count; :func:`finish_request` does the rest.
    ``pool``: the body's, when the caller resolved it already (:func:`resolve_pool`)."""
    allowed = _CHAT if kind == "chat" else _COMPLETION
    neutral = _CHAT_NEUTRAL if kind == "chat" else _COMPLETION_NEUTRAL
    pool = pool or resolve_pool(cfg, body)
    upstream: dict[str, Any] = {}
    for k, v in body.items():
        if k in allowed:
            continue
        if k in pool.upstream_fields:  # for the model server, as sent (null: not sent)
            if v is not None:
                upstream[k] = _passed(v, k)
            continue
        if kind == "chat" and pool.tool_calls and k in TOOL_FIELDS:
            continue  # checked below
        if pool.logprobs and k in LOGPROB_FIELDS:
            continue  # checked below
        if kind == "chat" and pool.structured_outputs and k == "response_format":
            continue  # checked below
        if k in neutral:
            if v is not None and not neutral[k](v):
                why = _served_by(kind, k)
                raise bad(k, f"'{k}' = {json.dumps(v)[:100]} is not supported by this service{why} "
                          "(only its neutral value is accepted)", "unsupported_value")
            continue
        raise bad(k, f"Unrecognized request argument supplied: {k[:100]}", "unknown_parameter")

    if pool.logprobs:
        _logprob_fields(kind, body, pool, upstream)
    messages: tuple[ChatMessage, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    if kind == "chat":
        prompt_param = "messages"
        messages = tuple(_messages(body.get("messages"), pool.tool_calls, pool.structured_outputs))
        if pool.structured_outputs and "response_format" not in pool.upstream_fields:
            if (rf := body.get("response_format")) is not None and (rf := _response_format(rf)):
                upstream["response_format"] = rf
        if pool.tool_calls:
            _tool_fields(body, upstream)
        # What the frontend's own counters count (and a step engine reads): the tools' JSON
        # too, which a model server's chat template renders into the prompt
        tools = [("tools", json.dumps(upstream["tools"], ensure_ascii=False))] if "tools" in upstream else []
        prompt = render_chat([*tools, *((m.role, m.text_for_count()) for m in messages)])
    else:
        prompt_param = "prompt"
        prompt, prompt_ids = _prompt(body.get("prompt"), pool)

    max_tokens = _int(body.get("max_tokens"))
    param = "max_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        if max_tokens is not None and not _is_int(max_tokens):  # checked, though not used
            raise bad(param, f"'{param}' must be an integer, got {_type_name(max_tokens)}", "invalid_type")
        # As vLLM (and OpenAI, which deprecated max_tokens for it): max_completion_tokens wins
        max_tokens, param = _int(body["max_completion_tokens"]), "max_completion_tokens"
    if max_tokens is None:
        pass
    elif not _is_int(max_tokens):
        raise bad(param, f"'{param}' must be an integer, got {_type_name(max_tokens)}", "invalid_type")
    elif max_tokens < 1:
        raise bad(param, f"'{param}' must be at least 1, got {max_tokens}")

    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)

    stop_v = body.get("stop")
    stop: tuple[str, ...] = ()
    if isinstance(stop_v, str):
        stop = (_text(stop_v, "stop"),)
    elif isinstance(stop_v, list):
        if len(stop_v) > MAX_STOP:
            raise bad("stop", f"'stop' may hold at most {MAX_STOP} sequences, got {len(stop_v)}")
        stop = tuple(_text(s, f"stop[{i}]") for i, s in enumerate(stop_v))
    elif stop_v is not None:
        raise bad("stop", f"'stop' must be a string or an array of strings, got {_type_name(stop_v)}",
                  "invalid_type")
    for i, s in enumerate(stop):
        if not s:
            raise bad(f"stop[{i}]" if isinstance(stop_v, list) else "stop", "stop sequences may not be empty")
    if (stop_bytes := sum(len(s.encode()) for s in stop)) > MAX_STOP_BYTES:
        raise bad("stop", f"'stop' holds {stop_bytes} bytes; at most {MAX_STOP_BYTES} in all")

    for name in _IDS:
        if body.get(name) is not None:
            _text(body[name], name)
    _metadata(body.get("metadata"))

    seed = _int(body.get("seed"))
    if seed is not None and (not _is_int(seed) or not INT64[0] <= seed <= INT64[1]):
        raise bad("seed", f"'seed' must be a 64-bit integer, got {json.dumps(seed)[:40]}", "invalid_type")

    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise bad("stream", f"'stream' must be a boolean, got {_type_name(stream)}", "invalid_type")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("stream_options", "'stream_options' must be an object", "invalid_type")
        if not stream:
            raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        for k, v in so.items():
            if k not in STREAM_OPTIONS:
                raise bad(f"stream_options.{k}", f"unrecognized field 'stream_options.{k[:100]}'",
                          "unknown_parameter")
            if v is not None and not isinstance(v, bool):
                raise bad(f"stream_options.{k}", f"'stream_options.{k}' must be a boolean", "invalid_type")
        include_usage = bool(so.get("include_usage"))
        # As vLLM: per-chunk usage only together with include_usage.
        continuous_usage = include_usage and bool(so.get("continuous_usage_stats"))
    else:
        continuous_usage = False

    ignore_eos = body.get("ignore_eos")
    if ignore_eos is None:
        ignore_eos = False
    elif not isinstance(ignore_eos, bool):
        raise bad("ignore_eos", f"'ignore_eos' must be a boolean, got {_type_name(ignore_eos)}",
                  "invalid_type")
    min_tokens = _int(body.get("min_tokens"))
    if min_tokens is None:
        min_tokens = 0
    elif not _is_int(min_tokens):
        raise bad("min_tokens", f"'min_tokens' must be an integer, got {_type_name(min_tokens)}",
                  "invalid_type")
    elif min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
        raise bad("min_tokens", f"'min_tokens' must be in [0, {param} ({max_tokens})], got {min_tokens}")
    elif min_tokens and stop:
        # vLLM also ignores stop strings before min_tokens; the step engines' stop check does
        # not know min_tokens, so the combination is refused rather than half honoured.
        raise bad("min_tokens", "'min_tokens' together with 'stop' is not supported by this service",
                  "unsupported_value")

    echo = kind != "chat" and _echo(body.get("echo"), upstream, bool(prompt_ids))
    return Draft(kind=kind, pool=pool, prompt=prompt, prompt_param=prompt_param, messages=messages,
                 max_tokens=max_tokens, max_param=param, min_tokens=min_tokens, prompt_ids=prompt_ids,
                 fields={"temperature": temperature, "top_p": top_p, "stop": stop, "seed": seed,
                         "defaulted": tuple(n for n in DEFAULTABLE if body.get(n) is None),
                         "stream": stream, "include_usage": include_usage,
                         "continuous_usage": continuous_usage, "ignore_eos": ignore_eos,
                         "upstream": upstream, "echo": echo})


# No tokenizer packs more characters than this into a token over a whole prompt (the longest
# tokens of real vocabularies are runs of a few dozen characters): a prompt longer than this
# many per token of the context cannot fit, and is refused before it is counted.
MAX_CHARS_PER_TOKEN = 64


def refuse_if_surely_too_long(d: Draft) -> None:
    """A 400 for a prompt no tokenizer could fit in its pool's context, before the count:
    with ``tokenizer = "upstream"`` a count is a call to the model server, with a file one the
    frontend's CPU, and a request refused by the count's result is neither admitted nor
    charged (a review's tenant of 0.001 tokens/s sent the model server 32 MB to count)."""
    chars = len(d.prompt) + sum(len(m.reasoning[1]) for m in d.messages if m.reasoning)
    limit = d.pool.context_tokens * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise bad(d.prompt_param, f"This model's maximum context length is {d.pool.context_tokens} tokens; "
                  f"the prompt has {chars} characters, more than any tokenizer fits in it",
                  "context_length_exceeded")


def finish_request(d: Draft, prompt_tokens: int) -> GenerationRequest:
    """The checks that need the prompt's token count (in the pool's tokenizer): the context
    limit, ``max_tokens`` within the room left (its default fills the room up to
    ``default_max_tokens``) and ``min_tokens`` within ``max_tokens``."""
    pool = d.pool
    room = pool.context_tokens - prompt_tokens
    if room < 1:
        raise bad(d.prompt_param, f"This model's maximum context length is {pool.context_tokens} tokens; "
                  f"the prompt has {prompt_tokens}, leaving no room for output", "context_length_exceeded")
    max_tokens = d.max_tokens
    if max_tokens is None:
        max_tokens = min(pool.default_max_tokens, room)
    elif max_tokens > room:
        raise bad(d.max_param, f"'{d.max_param}' is {max_tokens}, but the prompt uses {prompt_tokens} "
                  f"of this model's {pool.context_tokens}-token context: at most {room} output tokens fit",
                  "context_length_exceeded")
    if d.min_tokens > max_tokens:
        raise bad("min_tokens", f"'min_tokens' must be in [0, {d.max_param} ({max_tokens})], "
                  f"got {d.min_tokens}")
    return GenerationRequest(kind=d.kind, model=pool.model_name, pool=pool, prompt=d.prompt,
                             prompt_tokens=prompt_tokens, max_tokens=max_tokens, min_tokens=d.min_tokens,
                             messages=d.messages, prompt_ids=d.prompt_ids, **d.fields)


# --- responses -----------------------------------------------------------------------------

def finish_reason(worker_reason: str) -> str:
    """OpenAI knows stop | length (| tool_calls | content_filter); map the worker's others."""
    return worker_reason if worker_reason in ("stop", "length", "tool_calls") else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_id(req: GenerationRequest, request_id: str) -> str:
    return ("chatcmpl-" if req.kind == "chat" else "cmpl-") + request_id


def merge_tool_calls(deltas: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A whole answer's tool calls from the model server's streamed deltas: per ``index``, the
    first delta's id, type and name, and the arguments' pieces joined in order (vLLM's and
    OpenAI's stream). A delta without an index (a server's own shape) is the next call."""
    calls: dict[Any, dict[str, Any]] = {}
    for record in deltas:
        for delta in record:
            key: Any = delta.get("index")
            if not isinstance(key, int):  # (a worker checks it: an unhashable one was a 500 here)
                key = ("next", len(calls))  # a call of its own, never one with a real index
            f = delta.get("function") if isinstance(delta.get("function"), dict) else {}
            call = calls.get(key)
            if call is None:
                call = calls[key] = {"id": delta.get("id") or "", "type": delta.get("type") or "function",
                                     "function": {"name": f.get("name") or "", "arguments": ""}}
            else:
                call["id"] = call["id"] or delta.get("id") or ""
                call["function"]["name"] = call["function"]["name"] or f.get("name") or ""
            if isinstance(f.get("arguments"), str):
                call["function"]["arguments"] += f["arguments"]
    return list(calls.values())


def logprobs_object(req: GenerationRequest, entries: Iterable[Logprob], text_offset: int = 0,
                    ) -> dict[str, Any] | None:
    """A choice's ``logprobs`` from the model server's (limiter/reply_text.py Logprob), in
    the request's endpoint's shape: a chat's ``{content: [{token, logprob, bytes,
    top_logprobs}]}``, a completion's arrays, whose ``text_offset`` counts from
    ``text_offset`` (the characters of the answer before these tokens) by each token's length,
    as vLLM counts it. None when the request asked for none."""
    if "logprobs" not in req.upstream:
        return None
    if req.kind == "chat":
        return {"content": [{"token": t, "logprob": lp, "bytes": b,
                             "top_logprobs": [{"token": a, "logprob": alp, "bytes": ab}
                                              for a, alp, ab in top or ()]}
                            for t, lp, b, top in entries]}
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for t, lp, _, top in entries:
        offsets.append(text_offset)
        text_offset += len(t)
        tokens.append(t)
        token_logprobs.append(lp)
        tops.append(None if top is None else {a: alp for a, alp, _ in top})
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": tops}


def full_response(req: GenerationRequest, request_id: str, created: int, text: str, reason: str,
                  usage_in: int, usage_out: int, reasoning: tuple[str, str] | None = None,
                  tool_calls: list[dict[str, Any]] | None = None,
                  logprobs: Iterable[Logprob] = ()) -> dict[str, Any]:
    """``reasoning``: (field name, text) of what a model server sent apart from the answer
    (limiter/reply_text.py), in the chat message as that server put it; ``tool_calls``: the
    tools it called (:func:`merge_tool_calls`), with a null content when it wrote none;
    ``logprobs``: its tokens' (:func:`logprobs_object`)."""
    if req.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if tool_calls else text)}
        if reasoning:
            message[reasoning[0]] = reasoning[1]
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": logprobs_object(req, logprobs),
                                  "finish_reason": finish_reason(reason)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs_object(req, logprobs),
                  "finish_reason": finish_reason(reason)}
        obj = "text_completion"
    return {"id": response_id(req, request_id), "object": obj, "created": created, "model": req.model,
            "choices": [choice], "usage": usage(usage_in, usage_out)}


def chunk(req: GenerationRequest, request_id: str, created: int, *, index: int = 0, text: str | None = None,
          role: bool = False, reason: str | None = None, usage_so_far: tuple[int, int] | None = None,
          reasoning: tuple[str, str] | None = None,
          tool_calls: list[dict[str, Any]] | None = None,
          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One SSE chunk: a text delta, the chat role opener, or the final finish_reason.

    ``usage_so_far`` = (prompt tokens, completion tokens so far): with ``continuous_usage``
    (vLLM's ``continuous_usage_stats``) every chunk carries the running usage. ``reasoning``
    = (field name, text): a chat delta of a reasoning model's thinking, as vLLM's reasoning
    parser sends it (no ``content`` unless ``text`` has some too); ``tool_calls``: one chunk's
    tool-call deltas as the model server sent them; ``logprobs``: its tokens'
    (:func:`logprobs_object`); ``index``: the choice's (several answers to one request)."""
    fin = finish_reason(reason) if reason is not None else None
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if reasoning:
            delta[reasoning[0]] = reasoning[1]
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": fin}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": fin}
        obj = "text_completion"
    out: dict[str, Any] = {"id": response_id(req, request_id), "object": obj, "created": created,
                           "model": req.model, "choices": [choice]}
    if req.continuous_usage and usage_so_far is not None:
        out["usage"] = usage(*usage_so_far)
    elif req.include_usage:
        out["usage"] = None  # as OpenAI: every chunk but the last carries "usage": null
    return out


def usage_chunk(req: GenerationRequest, request_id: str, created: int, usage_in: int,
                usage_out: int) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": response_id(req, request_id), "object": obj, "created": created, "model": req.model,
            "choices": [], "usage": usage(usage_in, usage_out)}


def compact_json(obj: Any) -> str:
    """JSON as the answers carry it: no spaces, and text as UTF-8 rather than escapes."""
    return _dumps(obj).decode()


def _std_dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


try:  # the same bytes as _std_dumps for what this module builds (str keys, finite numbers)
    from orjson import dumps as _dumps
except ImportError:  # pragma: no cover - orjson is a dependency; this keeps a bare install working
    _dumps = _std_dumps


def sse(data: Mapping[str, Any] | str) -> bytes:
    payload = data.encode() if isinstance(data, str) else _dumps(data)
    return b"data: " + payload + b"\n\n"
