"""The text a token push carries: the answer's text, and the reasoning, tool calls and token
log probabilities a model server sent apart from it.

A model server with a reasoning parser (vLLM ``--reasoning-parser``) streams a reasoning
model's thinking in its own delta field (``reasoning``; ``reasoning_content`` before vLLM
removed that name) and the answer in ``content``. The openai worker forwards both; the
pushes, the reply stream and ``complete`` carry one text per batch (lua/push_tokens.lua:
the scripts never read it), so the reasoning rides inside it, marked:

* ``NUL r`` starts reasoning under the field ``reasoning``, ``NUL R`` under
  ``reasoning_content`` (the frontend answers under the name the server used);
* ``NUL t`` starts one chunk's tool calls (vLLM's ``delta.tool_calls`` with a tool parser):
  their JSON array, which holds no NUL (JSON escapes it), up to the next mark;
* ``NUL l`` starts one chunk's token log probabilities (``logprobs`` asked of a pool with
  ``logprobs`` on): their JSON array up to the next mark, an entry per token (:data:`Logprob`);
  ``NUL L`` the same of a chunk of thinking or tool calls and no text, whose tokens are no
  part of the answer's text (a Responses ``output_text`` holds its text's alone), written
  only for a request whose payload says its frontend reads it (``aside_logprobs``: an older
  one kept the mark as text);
* ``NUL c`` goes back to the answer's text;
* ``NUL NUL`` is one NUL of the text it is in.

Every packed piece ends in the answer's text, so pieces joined in order (a push takes all
that is pending; a non-streamed answer joins its pushes) unpack as a whole. Text without a
NUL -- every answer without reasoning, tool calls or logprobs -- is carried as it is, and
unpacking it is one scan.
A frontend of an earlier release shows the marks of a reasoning answer as text (and of tool
calls and logprobs, which only a pool with ``tool_calls`` or ``logprobs`` on asks for): deploy
frontends before workers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

NUL = "\x00"
REASONING_FIELDS = {"reasoning": "r", "reasoning_content": "R"}
_FIELD_OF = {mark: field for field, mark in REASONING_FIELDS.items()}
# One token's log probability as a push carries it, compact (a token with 20 alternatives is
# stored in Redis until its frontend reads it): [token, logprob, bytes, top], ``top`` a list of
# [token, logprob, bytes] (or None: a completions server's null), ``bytes`` a list of byte
# values or None (a completions answer has none), ``logprob`` a number or None.
Logprob = list[Any]


class ReplyText(NamedTuple):
    content: str
    reasoning: str = ""
    field: str = ""  # the reasoning's field name ("" when there is none)
    # The model server's tool-call deltas, one array per chunk that had any, in order: each
    # entry an OpenAI ``tool_calls`` delta ({index, id?, type?, function: {name?, arguments?}})
    tool_calls: tuple[list[dict[str, Any]], ...] = ()
    # The tokens' log probabilities (of the text and the thinking), in order
    logprobs: tuple[Logprob, ...] = ()
    # Those of the answer's text alone (NUL l, not NUL L): a chunk of thinking or tool calls alone
    # has tokens of its own (a Responses output_text holds its text's); a chunk with text, or
    # with nothing but logprobs (vLLM's stop token), counts as text
    text_logprobs: tuple[Logprob, ...] = ()


def pack(content: str, reasoning: str = "", field: str = "reasoning",
         tool_calls: list[dict[str, Any]] | None = None, logprobs: list[Logprob] | None = None,
         aside: bool = True) -> str:
    """One batch's text as a push carries it (module docstring). ``aside``: the reader knows
    ``NUL L`` (a request's payload says so: its frontend's release reads it); else a chunk's
    logprobs are all marked ``NUL l``, as before the mark: an older frontend kept a mark it
    did not know as text, and its client read the logprobs' JSON in the thinking."""
    if NUL in content:
        content = content.replace(NUL, NUL + NUL)
    if not reasoning and not tool_calls and not logprobs:
        return content
    if NUL in reasoning:
        reasoning = reasoning.replace(NUL, NUL + NUL)
    thought = f"{NUL}{REASONING_FIELDS[field]}{reasoning}" if reasoning else ""
    calls = f"{NUL}t{orjson.dumps(tool_calls).decode()}" if tool_calls else ""
    mark = "L" if aside and not content and (reasoning or tool_calls) else "l"
    probs = f"{NUL}{mark}{orjson.dumps(logprobs).decode()}" if logprobs else ""
    return f"{thought}{calls}{probs}{NUL}c{content}"


def _record(record: str, item: type) -> list[Any] | None:
    """A record's JSON array of ``item``s (objects: tool calls; arrays: logprobs), else None."""
    try:
        items = orjson.loads(record)
    except orjson.JSONDecodeError:
        return None
    return items if isinstance(items, list) and all(isinstance(c, item) for c in items) else None


def unpack(text: str) -> ReplyText:
    """The answer's text, reasoning, tool calls and logprobs of packed text, each joined in
    order. A mark this module does not write (text from elsewhere) is kept as text."""
    if NUL not in text:
        return ReplyText(text)
    runs = unpack_in_order(text)
    if len(runs) == 1:
        return runs[0]
    return ReplyText("".join(r.content for r in runs), "".join(r.reasoning for r in runs),
                     next((r.field for r in runs if r.field), ""),
                     tuple(c for r in runs for c in r.tool_calls), tuple(p for r in runs for p in r.logprobs),
                     tuple(p for r in runs for p in r.text_logprobs))


def unpack_in_order(text: str) -> list[ReplyText]:
    """Packed text as the model server sent it, in order: runs each of thinking, then tool
    calls, then answer text (one chunk's as :func:`pack` writes them; text of the chunks
    after it with neither runs on). Text between two tool calls (a parser's newline between
    parallel calls) stays between them: a stream of the runs keeps the server's order. A
    chunk's logprobs belong to the run its text (or thinking, or calls) is in."""
    if NUL not in text:
        return [ReplyText(text)]
    runs: list[ReplyText] = []
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[list[dict[str, Any]]] = []
    probs: list[Logprob] = []
    text_probs: list[Logprob] = []
    mode, field = "c", ""

    def close() -> None:
        if any(content) or any(reasoning) or calls or probs:
            thought = "".join(reasoning)
            runs.append(ReplyText("".join(content), thought, field if thought else "", tuple(calls),
                                  tuple(probs), tuple(text_probs)))
        content.clear()
        reasoning.clear()
        calls.clear()
        probs.clear()
        text_probs.clear()

    out = {"c": content, "r": reasoning}
    i, n = 0, len(text)
    while i < n:
        j = text.find(NUL, i)
        if j < 0:
            out[mode].append(text[i:])
            break
        out[mode].append(text[i:j])
        mark = text[j + 1:j + 2]
        if mark == NUL:
            out[mode].append(NUL)
        elif mark == "c":
            mode = "c"
        elif mark in _FIELD_OF:
            if any(content) or calls:  # thinking after text or calls: the next run
                close()
            mode, field = "r", field or _FIELD_OF[mark]
        elif mark in ("t", "l", "L"):  # a JSON array up to the next mark (pack: it holds no NUL)
            if mark == "t" and any(content):  # calls after text: the next run
                close()
            end = text.find(NUL, j + 2)
            end = n if end < 0 else end
            if mark == "t":
                if record := _record(text[j + 2:end], dict):
                    calls.append(record)
            else:
                record = _record(text[j + 2:end], list) or []
                probs.extend(record)
                if mark == "l":
                    text_probs.extend(record)
            i = end
            continue
        else:  # not a mark: the NUL is text
            out[mode].append(NUL)
            i = j + 1
            continue
        i = j + 2
    close()
    return runs or [ReplyText("")]
