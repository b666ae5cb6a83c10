"""OpenAI's Responses API (``POST /v1/responses``): the request, checked and turned into the
chat it asks for (limiter/frontend/responses_api.py answers it).

A Responses body is checked field by field (a 400 names the field as the client sent it) and
turned into the chat completion it describes: ``instructions`` and ``input`` become the
messages (a ``function_call`` item an assistant's tool call, a ``function_call_output`` a tool
message, a ``reasoning`` item its turn's thinking), ``max_output_tokens`` the max tokens,
function tools (a ``namespace`` tool's by their flat names), ``tool_choice`` and
``text.format`` their chat shapes. What the answer repeats of the request is a
:class:`ResponseShape`.

Stateless: nothing is stored. What needs a stored response (``previous_response_id``,
``conversation``, ``background``, ``item_reference`` items, reusable ``prompt``s) is a 400
naming it -- the client sends the whole conversation in ``input``, as the OpenAI Agents SDK
and Codex do with ``store: false``; ``store`` is accepted either way and answered ``false``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from limiter.config import PoolConfig, QosConfig
from limiter.frontend import openai_api as oa
from limiter.frontend.errors import ApiError

# --- the request ---------------------------------------------------------------------------

# Fields taken as they are (checked by the chat's own checks, under the same names).
_SAME = ("model", "temperature", "top_p", "stream", "user", "metadata", "safety_identifier",
         "prompt_cache_key",
         # vLLM's own, which its /v1/responses takes as its chat does
         "seed", "stop", "ignore_eos", "min_tokens", "top_k", "min_p", "repetition_penalty",
         "skip_special_tokens")
_OWN = ("input", "instructions", "max_output_tokens", "tools", "tool_choice", "parallel_tool_calls",
        "text", "reasoning", "store", "include", "stream_options", "service_tier", "truncation",
        "top_logprobs", "max_tool_calls", "background", "previous_response_id", "conversation",
        "prompt", "prompt_cache_retention", "client_metadata")
# What needs a stored response or conversation: this service keeps none.
_STATEFUL = ("previous_response_id", "conversation", "prompt")
# `include` entries a client may send: Codex and the Agents SDK ask for the encrypted reasoning
# with store false; there is none here to give (the reasoning comes as text, in its item). The
# answer's token logprobs, in a pool whose model server returns them (`logprobs`), as vLLM.
OUTPUT_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = ("reasoning.encrypted_content", OUTPUT_LOGPROBS)
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"user": ("input_text",), "system": ("input_text",), "developer": ("input_text",),
              "assistant": ("output_text", "input_text", "refusal")}
# Fields of the OpenAI SDK's output items that a client sends back when it appends an answer's
# output to its next ``input`` (``to_dict()``, ``model_dump()``): the API's own, at the values
# that change nothing here, and the SDK's local parse results (``parsed_arguments`` of the
# stream helper's and parse()'s function calls, ``parsed`` of parse()'s text), which carry no
# more than the item's own text. Not sent on.
_SENT_BACK: dict[str, dict[str, Any]] = {
    "message": {"phase": lambda v: v in (None, "commentary", "final_answer")},
    "output_text": {"parsed": lambda v: True},
    "function_call": {"namespace": lambda v: v is None or isinstance(v, str),  # (see _messages)
                      "caller": lambda v: v is None or v == {"type": "direct"},
                      "async": lambda v: v in (None, False), "parsed_arguments": lambda v: True},
    "function_call_output": {"namespace": lambda v: v is None,
                             "name": lambda v: v is None or isinstance(v, str),
                             "caller": lambda v: v is None or v == {"type": "direct"}},
}


def _sent_back(item: Mapping[str, Any], p: str, kind: str) -> tuple[str, ...]:
    """The keys of ``_SENT_BACK[kind]`` ``item`` has, each checked (a 400 naming it if not at
    a value served here)."""
    checks = _SENT_BACK[kind]
    for k in checks:
        if k in item and not checks[k](item[k]):
            raise oa.bad(f"{p}.{k}", f"'{p}.{k}' = {_shown(item[k])} is not supported by this service",
                         "unsupported_value")
    return tuple(checks)


@dataclass(frozen=True)
class ResponseShape:
    """What a response object repeats of its request (OpenAI's echo of the settings)."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text_format: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"type": "text"})
    reasoning_effort: str | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    user: str | None = None
    truncation: str = "disabled"
    top_logprobs: int = 0
    # a namespace tool's functions, by the flat name the model is offered: (namespace, name)
    namespaced: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)

    def call_name(self, flat: str) -> dict[str, str]:
        """A called function's name as the client offered it: a namespace tool's function by
        its own name and its ``namespace`` (as vLLM answers), any other as the model wrote it."""
        if (named := self.namespaced.get(flat)) is not None:
            return {"name": named[1], "namespace": named[0]}
        return {"name": flat}


def _type_of(v: Any, param: str, kind: type, what: str) -> Any:
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise oa.bad(param, f"'{param}' must be {what}, got {oa._type_name(v)}", "invalid_type")
    return v


def _shown(v: Any) -> str:
    """A value for a 400's message: a scalar as JSON, cut short; an array or object by its type
    (the answers' JSON encoder takes no integer past 64 bits, nor a value nested deep)."""
    if isinstance(v, list | dict):
        return f"an {oa._type_name(v)}"
    return json.dumps(v)[:60]


def _parts_text(content: Any, p: str, role: str) -> str:
    """A message item's ``content``: a string, or text parts (``input_text``; an assistant's
    ``output_text`` sent back, with its annotations and logprobs, which are not sent on)."""
    if isinstance(content, str):
        return oa._text(content, p)
    if not isinstance(content, list):
        raise oa.bad(p, f"'{p}' must be a string or an array of text parts, got {oa._type_name(content)}",
                     "invalid_type")
    texts = []
    for j, part in enumerate(content):
        pp = f"{p}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS[role]:
            kinds = " or ".join(TEXT_PARTS[role])
            raise oa.bad(pp, f"'{pp}' must be a part of type {kinds} (only text is served: images, "
                         "audio and files are not)", "invalid_type")
        key = "refusal" if part["type"] == "refusal" else "text"
        allowed = {"type", key, "annotations", "logprobs", *_sent_back(part, pp, "output_text")} \
            if part["type"] == "output_text" else {"type", key}
        for k in part:
            if k not in allowed:
                raise oa.bad(f"{pp}.{k[:64]}", f"unrecognized field '{pp}.{k[:64]}'", "unknown_parameter")
        if part.get(key) is None:
            raise oa.bad(f"{pp}.{key}", f"'{pp}.{key}' is required", "missing_required_parameter")
        texts.append(oa._text(part[key], f"{pp}.{key}"))
    return "\n".join(texts)  # as the chat path joins text parts (and vLLM)


ITEM_STATUSES = ("in_progress", "completed", "incomplete")


def _item_id(item: Mapping[str, Any], p: str) -> None:
    """An item sent back: its ``id`` and ``status`` as the SDK has them (checked, not sent on)."""
    if item.get("id") is not None:
        oa._id_text(item["id"], f"{p}.id")
    if item.get("status") is not None and item["status"] not in ITEM_STATUSES:
        raise oa.bad(f"{p}.status", f"'{p}.status' must be one of {', '.join(ITEM_STATUSES)}, got "
                     f"{_shown(item['status'])}")


def _messages(v: Any, instructions: str | None, tool_calls: bool) -> list[dict[str, Any]]:
    """``input`` (and ``instructions``, first, as a system message) as chat messages."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(v, str):
        return [*out, {"role": "user", "content": oa._text(v, "input")}]
    if not isinstance(v, list) or not v:
        raise oa.bad("input", "'input' must be a string or a non-empty array of items", "invalid_type")
    for i, item in enumerate(v):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise oa.bad(p, f"'{p}' must be an object, got {oa._type_name(item)}", "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            oa._keys(item, p, ("type", "role", "content", "id", "status", *_sent_back(item, p, "message")),
                     ("role", "content"))
            role = item["role"]
            if role not in INPUT_ROLES:
                raise oa.bad(f"{p}.role", f"'{p}.role' must be one of {', '.join(INPUT_ROLES)}")
            _item_id(item, p)
            text = _parts_text(item["content"], f"{p}.content", role)
            last = out[-1] if out else None
            if role == "assistant" and last is not None and last["role"] == "assistant" \
                    and not last["content"] and "tool_calls" not in last:
                last["content"] = text  # the answer after its thinking: one assistant turn
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind in ("function_call", "function_call_output") and not tool_calls:
            raise oa.bad(f"{p}.type", f"'{p}.type' {kind!r} is served by a pool with tool_calls = true, in "
                         "front of a model server that calls tools", "unsupported_value")
        elif kind == "function_call":
            oa._keys(item, p, ("type", "call_id", "name", "arguments", "id", "status",
                               *_sent_back(item, p, "function_call")), ("call_id", "name", "arguments"))
            _item_id(item, p)
            name = oa._id_text(item["name"], f"{p}.name")
            if item.get("namespace"):  # a namespace tool's function, by its flat name (as offered)
                name = flat_name(oa._id_text(item["namespace"], f"{p}.namespace"), name)
            call = {"id": oa._id_text(item["call_id"], f"{p}.call_id"), "type": "function",
                    "function": {"name": name,
                                 "arguments": oa._text(item["arguments"], f"{p}.arguments")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                # one assistant turn: its text and its (parallel) calls, as a chat has them
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            oa._keys(item, p, ("type", "call_id", "output", "id", "status",
                               *_sent_back(item, p, "function_call_output")), ("call_id", "output"))
            _item_id(item, p)
            out.append({"role": "tool", "tool_call_id": oa._id_text(item["call_id"], f"{p}.call_id"),
                        "content": _parts_text(item["output"], f"{p}.output", "user")})
        elif kind == "reasoning":
            out.extend(_thinking(item, p, out[-1] if out else None))
        elif kind == "item_reference":
            raise oa.bad(f"{p}.type", f"'{p}.type' item_reference needs stored items; this service "
                         "keeps none: send the item itself", "unsupported_value")
        else:
            raise oa.bad(f"{p}.type", f"'{p}.type' {str(kind)[:40]!r} is not served (message, "
                         "function_call, function_call_output and reasoning items are)", "unsupported_value")
    if not any(m["role"] != "system" for m in out):
        raise oa.bad("input", "'input' holds no message to answer", "invalid_value")
    return out


def _thinking(item: dict[str, Any], p: str, last: dict[str, Any] | None) -> list[dict[str, Any]]:
    """An earlier answer's thinking sent back (the Agents SDK does): the ``reasoning`` of its
    assistant turn, as the chat path sends a message's (vLLM does the same), for the chat
    templates of interleaved-thinking models; the others drop it. Its text is the content's,
    else the summary's. Encrypted thinking is OpenAI's own: none can be read here."""
    oa._keys(item, p, ("type", "id", "summary", "content", "encrypted_content", "status"))
    _item_id(item, p)
    if item.get("encrypted_content") not in (None, ""):  # (any other value: none can be read either)
        raise oa.bad(f"{p}.encrypted_content", f"'{p}.encrypted_content' cannot be read by this service (it "
                     "is encrypted for OpenAI's models): send the thinking as text, or leave it out",
                     "unsupported_value")
    texts = []
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        _type_of(parts, f"{p}.{key}", list, "an array")
        for j, part in enumerate(parts):
            pp = f"{p}.{key}[{j}]"
            if not isinstance(part, dict) or part.get("type") != kind:
                raise oa.bad(pp, f"'{pp}' must be a part of type {kind}", "invalid_type")
            oa._keys(part, pp, ("type", "text"), ("text",))
            texts.append(oa._text(part["text"], f"{pp}.text"))
        if texts:
            break
    if not texts:
        return []
    thought = "\n".join(texts)
    if last is not None and last["role"] == "assistant" and "reasoning" not in last:
        last["reasoning"] = thought
        return []
    return [{"role": "assistant", "content": "", "reasoning": thought}]


def flat_name(namespace: str, name: str) -> str:
    """A namespace tool's function as the model is offered it (vLLM's
    ``flat_namespace_tool_name``)."""
    return f"{namespace}__{name}"


def _function(t: Any, p: str, namespace: str | None = None) -> dict[str, Any]:
    if not isinstance(t, dict):
        raise oa.bad(p, f"'{p}' must be an object, got {oa._type_name(t)}", "invalid_type")
    if t.get("type") != "function":
        raise oa.bad(f"{p}.type", f"'{p}.type' {str(t.get('type'))[:40]!r} is not served in a namespace: "
                     "only function tools are", "unsupported_value")
    oa._keys(t, p, ("type", "name", "description", "parameters", "strict"), ("name",))
    f = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
    if namespace is not None:
        f["name"] = flat_name(namespace, oa._id_text(t["name"], f"{p}.name"))
    return {"type": "function", "function": f}


def _tools(v: Any) -> tuple[list[dict[str, Any]], list[str], dict[str, tuple[str, str]]]:
    """Responses' function tools (``{type: "function", name, description?, parameters?,
    strict?}``) in the chat's shape, a ``namespace`` tool's functions each by its flat name
    (``<namespace>__<name>``, as vLLM offers them); and each one's place in the body (for a
    400 of the chat's checks), and the flat names' (namespace, name). Hosted tools (web
    search, files, MCP, ...) are not offered to the model -- this service runs none -- as vLLM
    ignores them: Codex sends ``web_search`` with every request."""
    tools = _type_of(v, "tools", list, "an array")
    out, paths = [], []
    namespaced: dict[str, tuple[str, str]] = {}
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise oa.bad(p, f"'{p}' must be an object, got {oa._type_name(t)}", "invalid_type")
        if t.get("type") == "namespace":
            oa._keys(t, p, ("type", "name", "description", "tools"), ("name", "tools"))
            ns = oa._id_text(t["name"], f"{p}.name")
            for j, f in enumerate(_type_of(t["tools"], f"{p}.tools", list, "an array")):
                out.append(_function(f, f"{p}.tools[{j}]", ns))
                paths.append(f"{p}.tools[{j}]")
                namespaced[out[-1]["function"]["name"]] = (ns, f["name"])
        elif t.get("type") == "function":
            out.append(_function(t, p))
            paths.append(p)
        elif not isinstance(t.get("type"), str):
            raise oa.bad(f"{p}.type", f"'{p}.type' must be a string", "invalid_type")
    return out, paths, namespaced


def _tool_choice(v: Any) -> Any:
    if isinstance(v, str):
        return v  # (the chat's check names it: none | auto | required)
    tc = oa._keys(v, "tool_choice", ("type", "name"), ("type",))
    if tc["type"] != "function":
        raise oa.bad("tool_choice.type", f"'tool_choice.type' {str(tc['type'])[:40]!r} is not served (a "
                     "function is)", "unsupported_value")
    if tc.get("name") is None:
        raise oa.bad("tool_choice.name", "'tool_choice.name' is required", "missing_required_parameter")
    return {"type": "function", "function": {"name": oa._id_text(tc["name"], "tool_choice.name")}}


def _text_format(v: Any) -> dict[str, Any] | None:
    """``text``: ``{format?, verbosity?}``; the format as the chat's ``response_format`` (None:
    plain text)."""
    text = oa._keys(v, "text", ("format", "verbosity"))
    if text.get("verbosity") not in (None, "medium"):
        raise oa.bad("text.verbosity", "'text.verbosity' is not supported by this service (only its "
                     "neutral value, medium, is accepted)", "unsupported_value")
    fmt = text.get("format")
    if fmt is None:
        return None
    keys = ("name", "schema", "description", "strict")
    f = oa._keys(fmt, "text.format", ("type", *keys), ("type",))
    if f["type"] in ("text", "json_object") and (extra := next((k for k in keys if k in f), None)):
        # (a schema beside another type would be dropped unseen)
        raise oa.bad(f"text.format.{extra}", f"'text.format.{extra}' is only allowed with type json_schema",
                     "unknown_parameter")
    if f["type"] == "text":
        return None
    if f["type"] == "json_object":
        return {"type": "json_object"}
    if f["type"] != "json_schema":
        raise oa.bad("text.format.type", "'text.format.type' must be one of text, json_object, json_schema")
    if f.get("name") is None:
        raise oa.bad("text.format.name", "'text.format.name' is required", "missing_required_parameter")
    return {"type": "json_schema", "json_schema": {k: f[k] for k in keys if k in f}}


# The chat's names of what a Responses body calls otherwise (longest first), for the 400s of
# the chat's own checks: a field's name, or its start (a tool's fields are its function's in a
# chat).
_PARAM_NAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                ("max_completion_tokens", "max_output_tokens"), ("reasoning_effort", "reasoning.effort"),
                ("tool_choice.function", "tool_choice"), ("messages", "input"))
_TOOL_FUNCTION = re.compile(r"(tools\[\d+\])\.function(?=[.\[]|$)")


def _renamed(exc: ApiError, tool_paths: list[str]) -> ApiError:
    """``exc`` naming the field as the Responses body calls it (a message's place in
    ``input`` is not kept: the chat's messages are not the items one for one; a tool's is,
    ``tool_paths``)."""
    old = exc.param
    if not old:
        return exc
    new = _TOOL_FUNCTION.sub(lambda m: tool_paths[int(m.group(1)[6:-1])], old, count=1)
    for chat_name, name in _PARAM_NAMES:
        if old == chat_name or old.startswith((chat_name + ".", chat_name + "[")):
            new = name if chat_name == "messages" else name + old[len(chat_name):]
            break
    # (and the chat's max tokens named in another field's message: min_tokens' bound)
    exc.message = exc.message.replace(f"'{old}'", f"'{new}'").replace("max_completion_tokens",
                                                                      "max_output_tokens")
    exc.param = new
    return exc


def _refuse_what_is_not_served(body: Mapping[str, Any]) -> None:
    """The settings that change nothing here, checked: what needs stored responses, the
    fields taken only at their neutral values, ``include``, ``stream_options`` (a 400 naming
    the field)."""
    for k in _STATEFUL:
        if body.get(k) is not None:
            raise oa.bad(k, f"'{k}' needs stored responses; this service keeps none: send the whole "
                         "conversation in 'input'", "unsupported_value")
    if body.get("background") not in (None, False):
        raise oa.bad("background", "'background' responses are not served (nothing is stored to fetch "
                     "later)", "unsupported_value")
    if body.get("store") is not None:
        _type_of(body["store"], "store", bool, "a boolean")
    # truncation "auto" (the Agents SDK's ModelSettings may set it) is taken: nothing is cut
    # here, so a conversation past the context is the same 400 as with "disabled", which names
    # it; one that fits is answered the same either way
    for name, neutral in (("truncation", ("disabled", "auto")), ("service_tier", ("auto", "default")),
                          ("prompt_cache_retention", ("in-memory", "24h"))):
        # (by type too: false is no 0, and 0.0 no integer count)
        if body.get(name) is not None and not any(type(body[name]) is type(n) and body[name] == n
                                                  for n in neutral):
            raise oa.bad(name, f"'{name}' = {_shown(body[name])} is not supported by this "
                         "service (only its neutral value is accepted)", "unsupported_value")
    if body.get("max_tool_calls") is not None:
        raise oa.bad("max_tool_calls", "'max_tool_calls' is not supported by this service",
                     "unsupported_value")
    include = body.get("include")
    if include is not None:
        for i, name in enumerate(_type_of(include, "include", list, "an array")):
            if name not in INCLUDABLE:
                raise oa.bad(f"include[{i}]", f"'include[{i}]' {str(name)[:60]!r} is not served (only "
                             f"{', '.join(INCLUDABLE)} may be asked for)", "unsupported_value")
    if body.get("stream_options") is not None:
        so = oa._keys(body["stream_options"], "stream_options", ("include_obfuscation",))
        if not body.get("stream"):
            raise oa.bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if so.get("include_obfuscation") is not None:
            _type_of(so["include_obfuscation"], "stream_options.include_obfuscation", bool, "a boolean")


def parse_request(body: Mapping[str, Any], cfg: QosConfig,
                  pool: PoolConfig) -> tuple[ResponseShape, oa.Draft]:
    """A Responses body checked, as the chat it asks for (a :class:`oa.Draft`, finished as
    any chat's) and what its answer repeats of it."""
    chat: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
    for k, v in body.items():
        if k in _SAME or k in _OWN:
            continue
        if k in pool.upstream_fields:
            chat[k] = v
            continue
        raise oa.bad(k, f"Unrecognized request argument supplied: {k[:100]}", "unknown_parameter")
    _refuse_what_is_not_served(body)
    instructions = body.get("instructions")
    if instructions is not None:
        oa._text(instructions, "instructions")
    chat["messages"] = _messages(body.get("input"), instructions, pool.tool_calls)
    if body.get("max_output_tokens") is not None:  # (checked as the chat's, its 400 renamed)
        chat["max_completion_tokens"] = body["max_output_tokens"]

    if body.get("client_metadata") is not None:  # (Codex's; nothing here reads it)
        _type_of(body["client_metadata"], "client_metadata", dict, "an object")

    tools: list[dict[str, Any]] = []
    tool_paths: list[str] = []
    namespaced: dict[str, tuple[str, str]] = {}
    if body.get("tools") is not None:
        tools, tool_paths, namespaced = _tools(body["tools"])
        if tools:
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = _type_of(body["parallel_tool_calls"], "parallel_tool_calls", bool,
                                               "a boolean")
    fmt = None
    if body.get("text") is not None:
        fmt = _text_format(body["text"])
        if fmt is not None:
            chat["response_format"] = fmt
    # logprobs as vLLM asks its engine for them: top_logprobs alternatives of each token when
    # the output's logprobs are included, none otherwise (top_logprobs alone asks for nothing)
    top = oa._count_field(body, "top_logprobs", pool.max_logprobs)
    if OUTPUT_LOGPROBS in (include := body.get("include") or []):
        if not pool.logprobs:
            at = f"include[{include.index(OUTPUT_LOGPROBS)}]"
            raise oa.bad(at, f"'{at}' {OUTPUT_LOGPROBS!r} is not served"
                         f"{oa._served_by('chat', 'logprobs')}", "unsupported_value")
        chat["logprobs"] = True
        if top:
            chat["top_logprobs"] = top
    effort = None
    if body.get("reasoning") is not None:
        r = oa._keys(body["reasoning"], "reasoning", ("effort", "summary", "generate_summary"))
        effort = r.get("effort")
        if effort is not None:
            chat["reasoning_effort"] = effort
        for k in ("summary", "generate_summary"):  # asked of OpenAI's models; there is none here
            if r.get(k) is not None and r[k] not in ("auto", "concise", "detailed"):
                raise oa.bad(f"reasoning.{k}", f"'reasoning.{k}' must be auto, concise or detailed")
    try:
        draft = oa.parse_request("chat", chat, cfg, pool)
    except ApiError as exc:
        raise _renamed(exc, tool_paths) from None
    draft = dataclasses.replace(draft, prompt_param="input", max_param="max_output_tokens")
    shape = ResponseShape(
        instructions=instructions, max_output_tokens=draft.max_tokens,
        tools=tuple({"type": "function", "description": None, "parameters": None, "strict": None,
                     **t["function"]} for t in tools),
        tool_choice=body.get("tool_choice") or "auto",
        parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
        text_format=_format_echo(fmt), reasoning_effort=effort,
        metadata=body.get("metadata") or {}, user=body.get("user"),
        truncation=body.get("truncation") or "disabled", top_logprobs=top or 0, namespaced=namespaced)
    return shape, draft


def _format_echo(fmt: dict[str, Any] | None) -> dict[str, Any]:
    if fmt is None:
        return {"type": "text"}
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", **fmt["json_schema"]}
    return dict(fmt)
