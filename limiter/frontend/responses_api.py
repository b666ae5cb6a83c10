"""OpenAI's Responses API (``POST /v1/responses``), stateless: the answer.

The request is a chat (limiter/frontend/responses_request.py turns the body into it), queued,
scheduled, charged and run as any other: the worker and the model server see a chat. Only
the answer differs: a ``response`` object (:func:`response_object`, its output items from the
chat's answer by :func:`output_of`), or its stream of typed events, ``response.created`` to
``response.completed`` (:class:`ResponseEvents`), as OpenAI and vLLM send them, written by
:class:`ResponseGeneration`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from limiter.frontend import openai_api as oa
from limiter.frontend.errors import LABELS, ApiError
from limiter.frontend.generation import Generation
from limiter.frontend.replies import Reply
from limiter.frontend.responses_request import ResponseShape
from limiter.reply_text import Logprob, unpack_in_order

# --- the answer ----------------------------------------------------------------------------

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(shape: ResponseShape, req: oa.GenerationRequest, response_id: str, created_at: int,
                    status: str, output: list[dict[str, Any]], usage: tuple[int, int] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's ``response`` object (``status``: in_progress, completed, incomplete, failed)."""
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "background": False, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": shape.instructions, "max_output_tokens": shape.max_output_tokens,
        "max_tool_calls": None, "metadata": dict(shape.metadata), "model": req.model, "output": output,
        "parallel_tool_calls": shape.parallel_tool_calls, "previous_response_id": None,
        "reasoning": {"effort": shape.reasoning_effort, "summary": None}, "service_tier": "auto",
        "store": False, "temperature": req.temperature, "text": {"format": dict(shape.text_format),
                                                                  "verbosity": "medium"},
        "tool_choice": shape.tool_choice, "tools": list(shape.tools), "top_logprobs": shape.top_logprobs,
        "top_p": req.top_p, "truncation": shape.truncation,
        "usage": None if usage is None else {
            "input_tokens": usage[0], "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage[1], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage[0] + usage[1]},
        "user": shape.user,
    }


def _text_or(v: Any) -> str:
    """A model server's id or name: its text, else '' (a worker passes its deltas as sent)."""
    return v if isinstance(v, str) else ""


def text_logprobs(entries: Any) -> list[dict[str, Any]]:
    """An ``output_text``'s ``logprobs`` from the model server's (limiter/reply_text.py
    Logprob): each token's with its bytes and its alternatives', as OpenAI and vLLM give them
    (the bytes of a token's text where the server sent none)."""
    def token(text: str, logprob: Any, utf8: Any) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": utf8 if utf8 is not None else list(text.encode())}

    return [{**token(t, lp, b), "top_logprobs": [token(*alt) for alt in top or ()]}
            for t, lp, b, top in entries]


def delta_logprobs(entries: Any) -> list[dict[str, Any]]:
    """A text delta's (or done) event's ``logprobs``: each token's and its alternatives', no
    bytes (OpenAI's and vLLM's event shape)."""
    return [{"token": t, "logprob": lp,
             "top_logprobs": [{"token": a, "logprob": alp} for a, alp, _ in top or ()]}
            for t, lp, _, top in entries]


def message_item(item_id: str, text: str, status: str, logprobs: Any = ()) -> dict[str, Any]:
    """``logprobs``: the text's tokens' (limiter/reply_text.py Logprob entries)."""
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": text_logprobs(logprobs)}]}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str,
                       shape: ResponseShape | None = None) -> dict[str, Any]:
    """``name`` as the model called it; with ``shape``, as the client offered it
    (:meth:`ResponseShape.call_name`)."""
    named = shape.call_name(name) if shape is not None else {"name": name}
    return {"id": item_id, "type": "function_call", "call_id": call_id, **named, "arguments": arguments,
            "status": status}


def output_of(chat_answer: Mapping[str, Any], shape: ResponseShape | None = None,
              logprobs: Any = ()) -> tuple[list[dict[str, Any]], str]:
    """A whole chat answer's output items, and the response's status (``shape``: the
    request's, whose namespace tools name the calls; ``logprobs``: the answer text's tokens',
    limiter/reply_text.py Logprob entries)."""
    choice = chat_answer["choices"][0]
    msg = choice["message"]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    out = []
    thought = next((msg[k] for k in ("reasoning", "reasoning_content") if msg.get(k)), "")
    if thought:
        out.append(reasoning_item(_id("rs"), thought))
    calls = msg.get("tool_calls") or []
    text = msg.get("content") or ""
    if text.strip() or not calls:  # (a tool parser's newlines between calls are no message)
        # incomplete only where the answer was cut (the last item), as a stream closes it
        out.append(message_item(_id("msg"), text, "completed" if calls else status, logprobs))
    for c in calls:  # (a call without an id is given one, as a streamed one is)
        out.append(function_call_item(_id("fc"), c["id"] or _id("call"), c["function"]["name"],
                                      c["function"]["arguments"], "completed", shape))
    return out, status


class ResponseEvents:
    """A streamed response's events, in OpenAI's order: ``response.created`` and
    ``response.in_progress``; per output item (reasoning, the message, each function call)
    ``output_item.added``, its deltas, its ``.done`` events and ``output_item.done``; last
    ``response.completed`` with the whole response (its status ``incomplete`` at
    max_output_tokens). Every event carries its ``sequence_number``; an item's id is the
    same in its events and in the final response."""

    def __init__(self, shape: ResponseShape, req: oa.GenerationRequest, response_id: str,
                 created_at: int) -> None:
        self.shape, self.req, self.response_id, self.created_at = shape, req, response_id, created_at
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # every item so far, as it stands
        self.open_kind = ""  # "reasoning" | "message" | "calls" | "" (none)
        self.open_text: list[str] = []
        self.open_logprobs: list[Logprob] = []  # the open message's tokens'
        self.calls: dict[Any, int] = {}  # a call's stream index -> its place in output
        self.blank = ""  # whitespace with no message open yet: a message only if text follows
        self.blank_logprobs: list[Logprob] = []  # its tokens'

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + oa.compact_json(data).encode() + b"\n\n"

    def response(self, status: str, usage: tuple[int, int] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.shape, self.req, self.response_id, self.created_at, status,
                               [dict(i) for i in self.output], usage, error)

    def opening(self) -> list[bytes]:
        r = self.response("in_progress")
        return [self.event("response.created", response=r), self.event("response.in_progress", response=r)]

    def _open(self, kind: str, item: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.open_kind, self.open_text, self.open_logprobs = kind, [], []
        self.output.append(item)
        index = len(self.output) - 1
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        if kind in ("message", "reasoning"):
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} \
                if kind == "message" else {"type": "reasoning_text", "text": ""}
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
        return out

    def text(self, delta: str, logprobs: Any = ()) -> list[bytes]:
        """The answer's next text, and its tokens' logprobs (limiter/reply_text.py Logprob)."""
        out: list[bytes] = []
        if self.open_kind != "message":
            if not delta.strip():
                self.blank += delta
                self.blank_logprobs += logprobs
                return out
            delta, self.blank = self.blank + delta, ""
            logprobs, self.blank_logprobs = [*self.blank_logprobs, *logprobs], []
            out += self._open_message()
        out.append(self._text_delta(delta, logprobs))
        return out

    def _open_message(self) -> list[bytes]:
        return self._open("message", message_item(_id("msg"), "", "in_progress") | {"content": []})

    def _text_delta(self, delta: str, logprobs: Any = ()) -> bytes:
        """The open message's next text."""
        self.open_text.append(delta)
        self.open_logprobs += logprobs
        return self.event("response.output_text.delta", item_id=self.output[-1]["id"],
                          output_index=len(self.output) - 1, content_index=0, delta=delta,
                          logprobs=delta_logprobs(logprobs))

    def reasoning(self, delta: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open_kind != "reasoning":
            out += self._open("reasoning", reasoning_item(_id("rs"), "", "in_progress") | {"content": []})
        self.open_text.append(delta)
        item = self.output[-1]
        out.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                              output_index=len(self.output) - 1, content_index=0, delta=delta))
        return out

    def tool_calls(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        """One chunk's tool-call deltas (the chat's: ``{index, id?, function: {name?,
        arguments?}}``), each call an item of its own."""
        out: list[bytes] = []
        for d in deltas:
            key = d.get("index") if isinstance(d.get("index"), int) else ("next", len(self.calls))
            f = d.get("function") if isinstance(d.get("function"), dict) else {}
            if key not in self.calls:
                if self.open_kind != "calls":
                    out += self.close()
                    self.open_kind = "calls"
                # (a call's id is its identity to the SDK from here on: one the server did not
                # send is made, unique; its name may come in a later delta)
                item = function_call_item(_id("fc"), _text_or(d.get("id")) or _id("call"),
                                          _text_or(f.get("name")), "", "in_progress", self.shape)
                self.output.append(item)
                self.calls[key] = len(self.output) - 1
                out.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                      item=dict(item)))
            index = self.calls[key]
            item = self.output[index]
            if not item["name"] and (name := _text_or(f.get("name"))):
                item.update(self.shape.call_name(name))
            if isinstance(f.get("arguments"), str) and f["arguments"]:
                item["arguments"] += f["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=f["arguments"]))
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        """The open item's (or calls') end."""
        kind, self.open_kind = self.open_kind, ""
        out: list[bytes] = []
        if kind in ("message", "reasoning"):
            index = len(self.output) - 1
            item, text = self.output[index], "".join(self.open_text)
            if kind == "message":
                done = message_item(item["id"], text, status, self.open_logprobs)
                part = done["content"][0]
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=text,
                                      logprobs=delta_logprobs(self.open_logprobs)))
            else:
                part = {"type": "reasoning_text", "text": text}
                out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=text))
                done = reasoning_item(item["id"], text)
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
            self.output[index] = done
            out.append(self.event("response.output_item.done", output_index=index, item=done))
        elif kind == "calls":
            for index in sorted(i for i in self.calls.values() if self.output[i]["status"] == "in_progress"):
                item = self.output[index]
                item["status"] = "completed"
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
                out.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        return out

    def end(self, finish: str, usage_in: int, usage_out: int) -> list[bytes]:
        status = "incomplete" if oa.finish_reason(finish) == "length" else "completed"
        out = []
        # an answer of whitespace alone is still a message, and one of nothing (or of thinking
        # alone) an empty one, as the whole answer's (output_of)
        if not self.calls and (self.blank or not any(i["type"] == "message" for i in self.output)):
            out += self._blank_message()
        out += self.close(status)
        # response.completed whatever the status, as vLLM sends it: the OpenAI SDK's stream
        # helper reads a final response only from that event (response.incomplete is OpenAI's)
        out.append(self.event("response.completed", response=self.response(status, (usage_in, usage_out))))
        return out

    def _blank_message(self) -> list[bytes]:
        text, self.blank = self.blank, ""
        logprobs, self.blank_logprobs = self.blank_logprobs, []
        out = self._open_message()
        if text or logprobs:
            out.append(self._text_delta(text, logprobs))
        return out

    def failed(self, exc: ApiError) -> list[bytes]:
        """A failure after the stream opened: OpenAI's ``error`` event, then the response
        ``failed``."""
        # (the response's error code is one of OpenAI's few: every failure after the stream
        # opened is the service's; the error event carries this service's own code)
        err = {"code": "server_error", "message": exc.message}
        return [self.event("error", code=exc.code or exc.err_type, message=exc.message, param=exc.param),
                self.event("response.failed", response=self.response("failed", error=err))]


class ResponseGeneration(Generation):
    """A generation answered in the Responses API's shape (the request itself is a chat)."""

    def __init__(self, shape: ResponseShape, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shape = shape
        # the client's own X-Request-Id, as vLLM takes it, else the record's id
        own = self.public_id if self.public_id != self.request_id else self.request_id[1:]
        self.response_id = "resp_" + own.removeprefix("resp_")
        self.events = ResponseEvents(shape, self.req, self.response_id, self.created)
        self.finish = "stop"

    async def answer(self) -> dict[str, Any]:
        text, r = await self.whole_reply()
        chat = self.full_answer(text, r)
        # the logprobs of the answer's text (a chunk of thinking or calls alone has tokens of
        # its own, which no output_text holds; so has a run of calls and no text, where a stop
        # token after them lands: a stream's message closed at the calls, as the same token
        # there joins no text)
        logprobs = [p for run in unpack_in_order(text) if run.content or not run.tool_calls
                    for p in run.text_logprobs]
        output, status = output_of(chat, self.shape, logprobs)
        usage = chat["usage"]
        return response_object(self.shape, self.req, self.response_id, self.created, status, output,
                               (usage["prompt_tokens"], usage["completion_tokens"]))

    def sse_opener(self, index: int = 0) -> list[bytes]:
        return self.events.opening()

    def sse_chunks(self, r: Reply, text: str, index: int = 0) -> list[bytes]:
        ev = self.events
        out: list[bytes] = []
        for piece in unpack_in_order(text) if text else ():
            if piece.reasoning:
                out += ev.reasoning(piece.reasoning)
            for calls in piece.tool_calls:
                out += ev.tool_calls(calls)
            # (a push of no text may still hold a token's logprob: vLLM's stop token, whose
            # text is left out, in its last chunk; the whole answer's output_text holds it)
            if piece.content or piece.text_logprobs:
                out += ev.text(piece.content, piece.text_logprobs)
        if r.kind == "done":
            self.observe_done(r)
            self.finish = r.finish
        return out

    def sse_end(self, usage_in: int, usage_out: int) -> list[bytes]:
        return self.events.end(self.finish, usage_in, usage_out)

    async def end_with_error(self, resp: web.StreamResponse, exc: ApiError,
                             before: bytes = b"") -> web.StreamResponse:
        self.request[LABELS].outcome = exc.outcome
        await self.bounded_write(resp.write_eof(before + b"".join(self.events.failed(exc))))
        return resp
