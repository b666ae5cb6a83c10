"""What the frontend and the worker must agree on about a prompt, in one place.

* :func:`count_tokens` — the pool tokenizer is byte-level: one token per UTF-8 byte plus
  one BOS token. The frontend charges admission with it and checks the context limit;
  the worker reports usage with it. Keeping one function keeps the charge honest.
* :func:`render_chat` — the chat template. Each message becomes ``<|role|>\\ncontent\\n``
  and the prompt ends with ``<|assistant|>\\n`` so the model answers as the assistant.
* :class:`Payload` — the msgpack map the frontend stores with the request in Redis and
  the worker decodes after ``claim``::

      {"v": 1, "kind": "chat"|"completion", "prompt": str, "max_tokens": int,
       "temperature": float, "top_p": float, "stop": [str], "seed": int|None, "model": str}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

PAYLOAD_VERSION = 1
BOS_TOKENS = 1
CHAT_ROLES = ("system", "user", "assistant", "tool")


def count_tokens(text: str) -> int:
    """Tokens the byte-level pool tokenizer produces for ``text``: UTF-8 bytes + BOS."""
    return len(text.encode("utf-8")) + BOS_TOKENS


def render_chat(messages: Iterable[tuple[str, str]]) -> str:
    """Render ``(role, content)`` pairs into the single prompt the engine sees."""
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


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

    def pack(self) -> bytes:
        return msgpack.packb({
            "v": PAYLOAD_VERSION, "kind": self.kind, "prompt": self.prompt, "max_tokens": self.max_tokens,
            "temperature": float(self.temperature), "top_p": float(self.top_p), "stop": list(self.stop),
            "seed": self.seed, "model": self.model,
        }, use_bin_type=True)

    @classmethod
    def unpack(cls, blob: bytes) -> Payload:
        """Decode a stored payload; raises ValueError on anything that is not version 1."""
        try:
            d: Any = msgpack.unpackb(blob, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ValueError(f"payload is not msgpack: {exc}") from exc
        if not isinstance(d, Mapping) or d.get("v") != PAYLOAD_VERSION:
            raise ValueError("payload is not a version-1 map")
        return cls(kind=str(d["kind"]), prompt=str(d["prompt"]), max_tokens=int(d["max_tokens"]),
                   temperature=float(d.get("temperature", 1.0)), top_p=float(d.get("top_p", 1.0)),
                   stop=tuple(str(s) for s in d.get("stop") or ()), seed=d.get("seed"),
                   model=str(d.get("model", "")))
