"""The token log probabilities of a model server's streamed choice, checked and made compact.

A request that asked for logprobs (a pool with ``logprobs`` on: the frontend put ``logprobs``
among the payload's fields for the model server) gets them in each chunk's choice, as vLLM
and OpenAI stream them:

* a chat's ``logprobs.content``: ``[{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]``, one entry per token of the chunk;
* a completion's ``logprobs``: the arrays ``tokens``, ``token_logprobs``, ``top_logprobs``
  (one ``{token: logprob}`` object, or null, per token) and ``text_offset``.

Both become the same compact entries (limiter/reply_text.py ``Logprob``), which the push
carries marked in the text; the frontend writes them back in its endpoint's shape. The
offsets are not kept: the frontend counts them over the whole answer (a resumed attempt's
server counts from its own start). A shape no client could read is :class:`MalformedStream`
(the request fails as a malformed response), as the tool-call deltas'.
"""

from __future__ import annotations

import math
from typing import Any

from limiter.reply_text import Logprob
from worker.sse_events import MalformedStream

# vLLM's floor for a token it reports as impossible (-inf has no JSON); a server built on
# Python's json may write -Infinity, which the chunk parser reads (sse_events.parse_chunk)
LOGPROB_FLOOR = -9999.0


def _value(v: Any) -> float | None:
    """A logprob as stored: a number (-inf at vLLM's floor), or None for null (and NaN)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"a logprob that is no number: {str(v)[:40]!r}")
    return max(float(v), LOGPROB_FLOOR)


def _bytes(v: Any) -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= 255
                                          for b in v):
        raise ValueError("bytes that are no list of byte values")
    return v


def _token(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"a token that is no string: {str(v)[:40]!r}")
    return v


def _chat(lp: Any) -> list[Logprob]:
    if not isinstance(lp, dict):
        raise ValueError("logprobs that are no object")
    content = lp.get("content")
    if content is None:
        return []
    if not isinstance(content, list):
        raise ValueError("logprobs.content that is no list")
    out: list[Logprob] = []
    for e in content:
        if not isinstance(e, dict):
            raise ValueError("a logprobs.content entry that is no object")
        top = e.get("top_logprobs") or []
        if not isinstance(top, list) or not all(isinstance(a, dict) for a in top):
            raise ValueError("top_logprobs that are no list of objects")
        alts = [[_token(a.get("token")), _value(a.get("logprob")), _bytes(a.get("bytes"))] for a in top]
        out.append([_token(e.get("token")), _value(e.get("logprob")), _bytes(e.get("bytes")), alts])
    return out


def _completion(lp: Any) -> list[Logprob]:
    if not isinstance(lp, dict):
        raise ValueError("logprobs that are no object")
    tokens, values = lp.get("tokens") or [], lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list) or len(values) != len(tokens):
        raise ValueError("tokens and token_logprobs that are no lists of one length")
    if tops is None:
        tops = [None] * len(tokens)
    if not isinstance(tops, list) or len(tops) != len(tokens):
        raise ValueError("top_logprobs that is no list as long as tokens")
    out: list[Logprob] = []
    for t, v, top in zip(tokens, values, tops, strict=True):
        if top is not None and not isinstance(top, dict):
            raise ValueError("a top_logprobs entry that is no object")
        alts = None if top is None else [[_token(a), _value(alp), None] for a, alp in top.items()]
        out.append([_token(t), _value(v), None, alts])
    return out


def choice_logprobs(choice: dict[str, Any], chat: bool, data: str) -> list[Logprob]:
    """``choice``'s token logprobs as compact entries ([] without any); raises
    :class:`MalformedStream` (quoting the chunk, ``data``) for a shape no client reads."""
    lp = choice.get("logprobs")
    if lp is None:
        return []
    try:
        return _chat(lp) if chat else _completion(lp)
    except ValueError as exc:
        raise MalformedStream(f"{exc} in {data[:200]!r}") from None


def past_seam(entries: list[Logprob], repeated: str) -> list[Logprob]:
    """``entries`` less the first tokens that spell ``repeated`` (or its start): the
    whitespace a resumed answer's first chunk repeated and worker/upstream.py _past_seam took
    off its text, which the client read with its logprobs before the break. A token that
    goes past it (" Ten" after a space) stays: it is of the text that is kept."""
    k = 0
    while k < len(entries) and entries[k][0] and repeated.startswith(entries[k][0]):
        repeated = repeated[len(entries[k][0]):]
        k += 1
    return entries[k:]
