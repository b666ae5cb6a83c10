"""What the frontend and the worker must agree on about a prompt, in one place.

* :func:`count_tokens` — the byte tokenizer (a pool's default, ``tokenizer = "bytes"``): one
  token per UTF-8 byte plus one BOS token. For such pools the frontend charges admission
  with it and checks the context limit, and the step engines report usage with it: one
  function keeps the charge honest. Pools with another tokenizer: :mod:`limiter.token_count`.
* :func:`render_chat` — the chat template. Each message becomes ``<|role|>\\ncontent\\n``
  and the prompt ends with ``<|assistant|>\\n`` so the model answers as the assistant.
* :class:`Payload` — the msgpack map the frontend stores with the request in Redis and
  the worker decodes after ``claim``::

      {"v": 1 | 2 | 3, "kind": "chat"|"completion", "prompt": str, "max_tokens": int,
       "temperature": float, "top_p": float, "stop": [str], "seed": int|None, "model": str,
       "ignore_eos": bool, "min_tokens": int, "messages": [{"role", "content", "name"?, "tool_call_id"?,
       "tool_calls"?, "reasoning"? | "reasoning_content"?}],
       "stream": bool, "grouped_tokens": bool, "aside_logprobs": bool}

  The last six are optional (a payload without them decodes to their defaults; ``stream``
  is written only when false, and a payload without it, from an older frontend, is taken
  for a streamed one: pushed as often as before; ``grouped_tokens`` only when true, and a
  payload without it, from an older frontend, gets one reply entry per token batch, the
  only kind that frontend reads; ``aside_logprobs`` the same, and without it a chunk's
  logprobs are all marked as that frontend reads them, limiter/reply_text.py). ``messages``
  are the chat messages as data: the openai engine sends them upstream as they are, never
  parsed back out of the rendered ``prompt`` (a user message that contains ``<|system|>``
  must stay a user message).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from limiter.reply_text import REASONING_FIELDS

PAYLOAD_VERSION = 1
# A payload with fields for the model server (upstream) is written as version 2: a worker of
# an older release, which would drop them and answer another question, refuses it instead
# ("not a version-1 map": the request fails, 503 worker_failed). Workers first, then list them.
PAYLOAD_VERSION_UPSTREAM = 2
# A payload that carries tools or earlier tool calls is version 3: a worker of the release
# before tool calling reads version 2, sends the tools upstream and drops the server's
# `delta.tool_calls` (the client got an empty answer ending "stop"), and reads an assistant
# message without its calls; it refuses version 3 instead. Workers first, then tool_calls.
PAYLOAD_VERSION_TOOLS = 3
# A payload that asks for logprobs is version 4: a worker of the release before reads version
# 3, sends `logprobs` upstream and drops the server's (the client got `logprobs: null`, which
# an eval reads as a failure of the model); it refuses version 4 instead. Workers first.
PAYLOAD_VERSION_LOGPROBS = 4
# A token-id prompt is version 5: a worker of the release before would send its empty text.
PAYLOAD_VERSION_TOKEN_IDS = 5
VERSIONS = (PAYLOAD_VERSION, PAYLOAD_VERSION_UPSTREAM, PAYLOAD_VERSION_TOOLS, PAYLOAD_VERSION_LOGPROBS,
            PAYLOAD_VERSION_TOKEN_IDS)
# The sampling fields a client may leave to the model server's defaults (Payload.defaulted).
DEFAULTABLE = ("temperature", "top_p")
BOS_TOKENS = 1
CHAT_ROLES = ("system", "user", "assistant", "tool")


def count_tokens(text: str) -> int:
    """Tokens the byte tokenizer produces for ``text``: UTF-8 bytes + BOS."""
    return len(text.encode("utf-8")) + BOS_TOKENS


@dataclass(frozen=True)
class ChatMessage:
    """One validated chat message (text content; parts already joined)."""

    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None
    reasoning: tuple[str, str] | None = None  # (field name, text): an earlier answer's thinking
    # An assistant message's tool calls, as the client sent them back: [{id, type: "function",
    # function: {name, arguments}}] (the frontend checked their shape; only a tool_calls pool)
    tool_calls: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        # An assistant turn that only called tools has no content: null, as OpenAI writes it
        # (and as chat templates that test for content expect)
        content = None if self.tool_calls and not self.content else self.content
        d: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            d["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.reasoning is not None:
            d[self.reasoning[0]] = self.reasoning[1]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> ChatMessage:
        if not isinstance(d, Mapping) or d.get("role") not in CHAT_ROLES:
            raise ValueError("payload message is not {role, content}")
        calls = d.get("tool_calls") or ()
        if not isinstance(calls, list | tuple) or not all(isinstance(c, Mapping) for c in calls):
            raise ValueError("payload message's tool_calls is not a list of maps")
        content = d.get("content")
        if not isinstance(content, str) and not (content is None and calls):
            raise ValueError("payload message is not {role, content}")
        name, call = d.get("name"), d.get("tool_call_id")
        reasoning = next(((k, d[k]) for k in REASONING_FIELDS if isinstance(d.get(k), str)), None)
        return cls(str(d["role"]), content or "", None if name is None else str(name),
                   None if call is None else str(call), reasoning, tuple(dict(c) for c in calls))

    def text_for_count(self) -> str:
        """The message's text as the frontend's own counters count it: the content, and
        its tool calls' JSON (a model server's template renders them into the prompt)."""
        if not self.tool_calls:
            return self.content
        return self.content + "\n" + json.dumps(list(self.tool_calls), ensure_ascii=False)


def render_chat(messages: Iterable[tuple[str, str]]) -> str:
    """Render ``(role, content)`` pairs into the single prompt the engine sees."""
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _flag(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"payload field {name!r} is not a boolean: {v!r}")
    return v


def is_token_id(t: Any) -> bool:
    """An integer (JSON's true and false are none)."""
    return isinstance(t, int) and not isinstance(t, bool)


def _token_ids(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list | tuple) or not all(is_token_id(t) for t in v):
        raise ValueError(f"payload field 'prompt_ids' is not a list of token ids: {str(v)[:80]}")
    return tuple(v)


def _upstream(v: Any) -> dict[str, Any]:
    if not isinstance(v, Mapping) or not all(isinstance(k, str) for k in v):
        raise ValueError(f"payload field 'upstream' is not a map of field names: {str(v)[:80]}")
    return dict(v)


@dataclass(frozen=True)
class Payload:
    """The request as the worker needs it; ``kind`` only matters for logs and samples."""

    kind: str  # "chat" | "completion"
    prompt: str
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    model: str = ""
    ignore_eos: bool = False
    min_tokens: int = 0
    messages: tuple[ChatMessage, ...] = ()
    # Whether the client reads the answer as it is made (SSE). A worker pushes the tokens of
    # an unstreamed request far less often (worker/settings.py unstreamed_flush_ms): nobody
    # reads them before the end, and each push is Redis time.
    stream: bool = True
    # Whether the request's frontend reads a push's token batches for several of its requests
    # from one reply-stream entry (lua/include/notify.lua notify_grouped). Every frontend of
    # this release does; False (absent) from an older one, which reads one entry per batch.
    grouped_tokens: bool = False
    # Whether the request's frontend reads the logprobs of a chunk without text marked apart
    # (limiter/reply_text.py NUL L). Every frontend of this release does; False (absent) from
    # an older one, which kept the mark as text (the logprobs' JSON in its client's thinking).
    aside_logprobs: bool = False
    # Sampling fields the client left out (of DEFAULTABLE): the values above are the
    # service's defaults for the step engines, while a model server in front of which the
    # openai engine sits is sent nothing for them, so it applies its own (vLLM: the model's
    # generation_config), as it would for the client directly. Absent: all were given.
    defaulted: tuple[str, ...] = ()
    # Fields for the model server, as the client sent them (the pool's upstream_fields): the
    # openai engine adds them to its request; a step engine refuses a request with any.
    upstream: Mapping[str, Any] = field(default_factory=dict)
    # A completion's prompt as the model's token ids (then ``prompt`` is ""): the openai
    # engine sends them as they are; a step engine refuses them.
    prompt_ids: tuple[int, ...] = ()

    def version(self) -> int:
        """The oldest payload version that holds this request (a worker that reads fewer
        refuses it rather than answer without what it does not know)."""
        if self.prompt_ids:
            return PAYLOAD_VERSION_TOKEN_IDS
        if "logprobs" in self.upstream:
            return PAYLOAD_VERSION_LOGPROBS
        if "tools" in self.upstream or any(m.tool_calls for m in self.messages):
            return PAYLOAD_VERSION_TOOLS
        return PAYLOAD_VERSION_UPSTREAM if self.upstream else PAYLOAD_VERSION

    def pack(self) -> bytes:
        d: dict[str, Any] = {
            "v": self.version(),
            "kind": self.kind, "prompt": self.prompt, "max_tokens": self.max_tokens,
            "temperature": float(self.temperature), "top_p": float(self.top_p), "stop": list(self.stop),
            "seed": self.seed, "model": self.model,
        }
        if self.ignore_eos:
            d["ignore_eos"] = True
        if self.min_tokens:
            d["min_tokens"] = self.min_tokens
        if self.messages:
            d["messages"] = [m.to_dict() for m in self.messages]
        if not self.stream:
            d["stream"] = False
        if self.grouped_tokens:
            d["grouped_tokens"] = True
        if self.aside_logprobs:
            d["aside_logprobs"] = True
        if self.defaulted:
            d["defaulted"] = list(self.defaulted)
        if self.upstream:
            d["upstream"] = dict(self.upstream)
        if self.prompt_ids:
            d["prompt_ids"] = list(self.prompt_ids)
        return msgpack.packb(d, use_bin_type=True)

    @classmethod
    def unpack(cls, blob: bytes) -> Payload:
        """Decode a stored payload; raises ValueError on anything that is not of VERSIONS."""
        try:
            d: Any = msgpack.unpackb(blob, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ValueError(f"payload is not msgpack: {exc}") from exc
        if not isinstance(d, Mapping) or d.get("v") not in VERSIONS:
            raise ValueError(f"payload is not a version-{'/'.join(map(str, VERSIONS))} map")
        try:
            return cls(kind=str(d["kind"]), prompt=str(d["prompt"]), max_tokens=int(d["max_tokens"]),
                       temperature=float(d.get("temperature", 1.0)), top_p=float(d.get("top_p", 1.0)),
                       stop=tuple(str(s) for s in d.get("stop") or ()), seed=d.get("seed"),
                       model=str(d.get("model", "")), ignore_eos=bool(d.get("ignore_eos", False)),
                       min_tokens=int(d.get("min_tokens", 0)),
                       messages=tuple(ChatMessage.from_dict(m) for m in d.get("messages") or ()),
                       stream=_flag(d.get("stream", True), "stream"),
                       grouped_tokens=_flag(d.get("grouped_tokens", False), "grouped_tokens"),
                       aside_logprobs=_flag(d.get("aside_logprobs", False), "aside_logprobs"),
                       defaulted=tuple(n for n in DEFAULTABLE if n in (d.get("defaulted") or ())),
                       upstream=_upstream(d.get("upstream") or {}),
                       prompt_ids=_token_ids(d.get("prompt_ids") or ()))
        except (KeyError, TypeError, OverflowError) as exc:  # OverflowError: int(inf)
            raise ValueError(f"payload is malformed: {exc}") from exc
