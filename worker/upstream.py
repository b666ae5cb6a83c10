"""The ``openai`` engine: front an upstream OpenAI-compatible server (vLLM, SGLang, TGI).

Such a server batches on its own (continuous batching, its own KV cache), so the step-based
:class:`~worker.batch_scheduler.BatchScheduler` does not apply. This is a separate small loop
that shares everything else with the step loop through :class:`~worker.runtime.WorkerRuntime`:
claim, lease renewal, batched ``push_tokens``, ``complete`` with its latency sample, drain.

* At most ``max_inflight`` requests are open upstream; the worker claims only that many,
  so the pool's priority queue (not the upstream's FIFO) decides what runs next.
* The class goes upstream as ``priority`` (vLLM's field: lower runs earlier; the class
  rank, 0 for the highest class, and 0 for a request its class's starvation floor claimed).
  vLLM only honours it with ``--scheduling-policy priority`` and otherwise refuses a
  non-zero one: the worker then sends none (a warning, once) and sends that request again
  without it; ``upstream_priority = false`` never sends it.
* Each upstream chunk is pushed as it arrives (``upstream_forward_chunks``, default on), so
  the client sees the upstream's chunks and inter-token times, not the worker's push
  batching (``flush_ms`` / ``flush_tokens``, which applies when it is off: fewer Redis writes).
  The chunks that arrived together (in one read of the stream: the worker was busy, the
  server sent a burst) go in one push, and the read that holds the end of the answer goes
  in ``complete`` with no push before it: a worker that falls behind catches up in fewer
  Redis calls, not one a chunk. The pushes of all the streams read in one turn of the event
  loop (a server's decode step feeds them all at once) go in one ``push_tokens`` call
  (:mod:`worker.push_merge`), as a step worker's pushes of one step do.
  Not for a client that does not stream: its request is pushed as the step worker pushes
  one (``WorkerRuntime.push_due``: the first token, then every ``unstreamed_flush_ms``).
* Tokens are the upstream's (the model's), end to end: ``max_tokens`` goes upstream as it is
  (less what earlier attempts delivered) and the upstream stops there itself; each chunk's
  tokens are counted from the running ``usage`` vLLM puts on every chunk when asked with
  ``stream_options.continuous_usage_stats`` (``upstream_chunk_usage``, default on); a chunk
  without it counts one token per chunk with text (what vLLM, SGLang and OpenAI stream),
  and the final ``usage`` tops the count up to the upstream's own figure. So delivered
  counts, ``usage`` and the refund are the upstream's ``completion_tokens``, and the prompt
  side of ``usage`` is its ``prompt_tokens``. An upstream that overshoots ``max_tokens`` is
  cut off there (finish ``length``).
* What is stored for a resume is the text, as byte-level ids (one per UTF-8 byte, the
  ``n_ids`` of ``push_tokens``), apart from the token count: a resuming worker decodes them
  back to the delivered text.
* Chat payloads are sent to ``/v1/chat/completions`` with the messages the frontend
  validated, carried as data in the payload (``Payload.messages``): the upstream applies its
  own chat template to them, and no text is ever parsed back into roles, so a user message
  that contains ``<|system|>`` stays a user message. Completions go to ``/v1/completions``.
* vLLM's ``ignore_eos`` and ``min_tokens`` are passed through when the client set them
  (``min_tokens`` less what an earlier attempt delivered, on resume).
* Resume after a worker died: the delivered text is appended to the prompt (for chat, as a
  partial assistant message with vLLM's ``continue_final_message``) and the stream continues
  at the delivered offset. Upstream tokenisation of that text may differ from the original
  run, so unlike the torch engine this is best effort, not bit-identical.
* An upstream that cannot be reached is handled like a dead worker, not like a bad request
  (:class:`Breaker`): a connection refused or reset, a connect or read timeout, a stream
  broken off (or ended with vLLM's ``finish_reason`` ``abort``: its engine aborted it), or
  HTTP 408/429/502/503/504 hands the request back (``release``: requeued at the head
  of its class with what was delivered, so another worker resumes it; when the answer broke
  off, the attempt counts, as a worker's death does, so a prompt that breaks the server every
  time ends at max_attempts),
  and this worker stops claiming. After a back-off (``upstream_retry_min_s``, doubling up to
  ``upstream_retry_max_s``) it probes the upstream with ``GET <root>/health`` (``/v1/models``
  where that is 404 or 405; a 408, 429, any 5xx or a redirect counts as down) and claims again only
  once that answers (after a stall, only once a one-token generation answers too: ``_unwell``).
  The state is in the heartbeat (``upstream_state`` closed | open, ``upstream_failures``,
  ``upstream_probes``).
  A dead upstream therefore leaves the queue to workers that can serve it (or to its max
  wait) instead of failing every queued request within milliseconds.
* Other errors (an HTTP 4xx/500, an ``error`` chunk, a malformed chunk, a stream without a
  finish reason) finish the request as ``failed``. What the client reads names what the
  model server did, never its address or an exception's text; the log has the details.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from limiter.backoff import Backoff
from limiter.errors import LeaseLost, PolicyMissing, RedisUnavailable
from limiter.reply_text import REASONING_FIELDS, Logprob
from limiter.tasks import raise_if_cancelled, stop_tasks
from limiter.token_count import MODEL_SERVER_KEEPALIVE_S
from worker.breaker import Breaker
from worker.busy_meter import FULL_SHARE
from worker.delivery import Delivery
from worker.logprobs import choice_logprobs, past_seam
from worker.push_merge import MergedPushes
from worker.runtime import IDLE_HELD_S, MAX_BACKOFF_INTERVALS, WorkerRuntime
from worker.settings import shown_upstream
from worker.sse_events import MAX_SSE_LINE, MalformedStream, echo_line_bytes, parse_chunk, sse_batches
from worker.stall_clock import StallClock
from worker.tokenizer import EOS_ID, PAD_ID, decode

log = logging.getLogger("qos.worker")
Result = tuple[str, str, str]  # outcome, finish_reason, message
# The server (or a proxy before it) cannot serve now. 408 too: the request did not come whole
# in time (a proxy's timeout; Node's HTTP server writes one on a keep-alive connection it times
# out, which the next request sent on it reads), nothing of the request's own, and the OpenAI
# SDK retries it as it does the others. It failed the client's request (found by a review).
DOWN_STATUSES = (408, 429, 502, 503, 504)
CREDENTIAL_STATUSES = (401, 403, 407)  # the worker's key (QOS_UPSTREAM_API_KEY) refused
# Redirects are not followed: a model server that redirects is a deployment's mistake (http
# to https, a path moved), a re-sent POST may run twice, and a redirect loop's error named the
# URL with its query (which may carry a key) in the log. The server is taken as down instead.
REDIRECT_ADVICE = "set upstream_url to the address the model server redirects to"
HEALTH_TIMEOUT_S = 5.0  # a health check (the breaker's probe, or after an HTTP 5xx)
CANARY_TIMEOUT_S = 30.0  # after a stall, the most a probe's one-token generation may take
# The request itself is at fault (vLLM's 400 for a prompt past the model's context, a 413, a
# 422): another try fails the same way, so its client gets a 400, not a 503 to retry. A 401,
# 403 or 404 is the worker's configuration (its key, its model name), a 500 the server's own.
REFUSED_STATUSES = (400, 413, 422)
ERROR_BODY_LIMIT = 64 << 10  # the most of an error body read (_error_text)
# After [DONE], how long the worker reads on for the body's end (a chunked response's last
# chunk, the server's next write: microseconds) before it gives the connection up. The
# answer is landed first: this holds a connection of the pool, not the request.
END_OF_BODY_S = 0.1
# ... unless the refusal names a field the worker adds of its own accord (a server that takes
# no `priority`: the worker's configuration, upstream_priority) or refuses a resume (the
# continuation is the worker's): failed, as the server's own error.
WORKER_FIELDS = ("priority", "stream_options", "continuous_usage_stats", "continue_final_message",
                 "add_generation_prompt")
# vLLM's words when its engine died (EngineDeadError; the V0 engine's AsyncEngineDeadError):
# every request it held gets them, as a chunk of its stream, and new ones as an HTTP 500
# until the server exits. Read as the request's own error, each such request failed --
# though any other server would have answered it. They are the server going away: handed
# back for resume. Matched at the message's start, as vLLM writes it: a request's own error
# that quotes them (a stop string, a bad regex) is not an engine's death.
ENGINE_DEAD = ("EngineCore encountered an issue", "Engine loop has died",
               "Background loop has errored already", "Background loop is not running")


# The codes an engine's death comes with in an `error` chunk (none, vLLM's default 400, 500)
ENGINE_DEAD_CODES = (None, 400, 500, "400", "500")


def _engine_died(message: str) -> bool:
    return message.lstrip().startswith(ENGINE_DEAD)


class UpstreamDown(Exception):
    """The upstream could not be reached or broke off. ``spent``: the request reached it and
    the answer broke off (the request may be why: the attempt counts, as when a worker dies);
    not for a refused connection or a busy status, which say nothing about the request."""

    def __init__(self, message: str, *, spent: bool) -> None:
        super().__init__(message)
        self.spent = spent


# Failures to connect at all: the request never reached the model server.
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


_URL = re.compile(r"\w+://[^\s)'\"]+")  # a URL in an exception's text, up to a space, quote or ')'


def _said(exc: BaseException) -> str:
    """An exception's type and text for the log, any URL in it shown as upstream_url is
    (shown_upstream: user part and query as ***). aiohttp's ConnectionTimeoutError names the
    URL whole, with the query that may carry the worker's key (a gateway's ``?api-key=``)."""
    return f"{type(exc).__name__}: {_URL.sub(lambda m: shown_upstream(m.group()), str(exc))}"


def _count(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _refusal_outcome(status: int, text: str, d: Delivery, model: str = "") -> str:
    """``refused`` for a model server's refusal of the request itself (REFUSED_STATUSES, not of
    a resume, naming no field of the worker's own nor ``model``, the name the worker sends: a
    proxy's 400 "Invalid model name" is the worker's configuration), else ``failed``."""
    if status not in REFUSED_STATUSES or d.total_tokens > 0:
        return "failed"
    said = text.lower()
    if any(f in said for f in WORKER_FIELDS) or (model and _names(said, model.lower())):
        return "failed"
    return "refused"


def _names(text: str, name: str) -> bool:
    """Whether ``text`` names the model ``name`` as servers and proxies write one: quoted
    (`` `x` ``, ``'x'``, ``"x"``), after ``=`` (LiteLLM's ``model=x``), after a colon, or
    as the message's first word (OpenRouter's "x is not a valid model ID"). Not
    as a word of the message: a server run with ``--served-model-name model`` refused a
    too-long prompt with "This model's maximum context length...", which read as its model
    name refused, and the client got a 503 to retry instead of its 400."""
    n = re.escape(name)
    # ... or as the message's first word (OpenRouter's 400 "x is not a valid model ID")
    pattern = rf"(?:[`'\"=]|:\s?){n}(?:[`'\".,;)\s]|$)|^\s*{n}\s"
    return re.search(pattern, text) is not None


def _choices(chunk: dict[str, Any], data: str, chat: bool) -> list[dict[str, Any]]:
    """A chunk's ``choices``, each an object whose ``finish_reason`` is a string or null and,
    in a chat's chunk, whose ``delta``, if any, an object; else :class:`MalformedStream` (an
    AttributeError in the stream's loop read as the worker's own error: "internal error in
    the worker")."""
    choices = chunk.get("choices") or []
    if not isinstance(choices, list) or not all(
            isinstance(ch, dict) and isinstance(ch.get("finish_reason"), str | None)
            and (not chat or isinstance(ch.get("delta") or {}, dict)) for ch in choices):
        raise MalformedStream(f"choices that are no list of objects in {data[:200]!r}")
    return choices


def _ended(finish: str) -> Result:
    """An answer the model server ended with ``finish``: stop, length and tool_calls as they
    are, any other reason (vLLM's repetition, say) as a stop."""
    return ("ok", finish if finish in ("stop", "length", "tool_calls") else "stop", "")


def _tool_call_deltas(delta: dict[str, Any], data: str) -> list[dict[str, Any]]:
    """A chat delta's ``tool_calls`` (a model server with a tool parser: vLLM's
    --enable-auto-tool-choice), forwarded as the server sent them; [] when there are none,
    :class:`MalformedStream` when they are not a list of objects."""
    calls = delta.get("tool_calls")
    if not calls:
        return []
    if not isinstance(calls, list) or not all(_tool_call_delta(c) for c in calls):
        raise MalformedStream(f"tool_calls that are no list of OpenAI tool-call deltas in {data[:200]!r}")
    return calls


def _tool_call_delta(c: Any) -> bool:
    """Whether ``c`` has a tool-call delta's shape: an integer ``index``, and ``id``, ``type``
    and the function's ``name`` and ``arguments`` strings (each may be absent or null). The
    frontend merges the deltas of an unstreamed answer by index: an unhashable one (a list)
    was a 500 there, and the client's SDK fails on the others."""
    if not isinstance(c, dict):
        return False
    index, f = c.get("index"), c.get("function")
    if index is not None and (not isinstance(index, int) or isinstance(index, bool)):
        return False
    if any(c.get(k) is not None and not isinstance(c[k], str) for k in ("id", "type")):
        return False
    if f is None:
        return True
    return isinstance(f, dict) and all(f.get(k) is None or isinstance(f[k], str)
                                       for k in ("name", "arguments"))


SEAM_SPACE = " \t"  # not line ends: a continuation after "one.\n" sent as "one." began " Line two"
# Stored among a request's resume ids, one per upstream token of thinking (a reasoning model's
# text apart from its answer): a resume sends the answer's text alone, so its prompt holds
# those tokens and not these (_usage). The byte vocabulary's PAD: never one of a text's bytes,
# and a special id every decoder drops, so a worker of an earlier release resuming the request
# reads the text as before. An id outside the vocabulary made that worker fail the request
# (its decoder refuses one; found by a review).
THOUGHT_ID = PAD_ID
# Stored among a request's resume ids, one per chunk of tool calls. A tool call broken off
# cannot be resumed: the model server's parser reads a call from the model's own text, which a
# continuation does not send back (the client read a call's first pieces, and a second answer
# would call again or write text). The byte vocabulary's EOS: never a text's byte, and dropped
# by every decoder, as THOUGHT_ID.
TOOL_CALL_ID = EOS_ID


def _thought_tokens(tokens: int, thought: str, text: str) -> int:
    """How many of a chunk's ``tokens`` were thinking (each is stored as a THOUGHT_ID, which a
    resume does not count among the prompt's tokens: _usage). A chunk of thinking alone: all;
    of answer text alone: none. A chunk of both (a server that sends several tokens a chunk,
    across the thought's end) does not say where its tokens part: by the two texts' shares of
    its characters, at least one token each (a chunk of one token: the text's, which the
    resume's prompt holds). Counted all as text, the resume's prompt was charged the chunk's
    tokens of thinking short (found by a review)."""
    if not thought or tokens <= 0:
        return 0
    if not text:
        return tokens
    if tokens < 2:
        return 0
    share = round(tokens * len(thought) / (len(thought) + len(text)))
    return min(max(share, 1), tokens - 1)


@dataclasses.dataclass(frozen=True, slots=True)
class Delivered:
    """What earlier attempts delivered, as a resume needs it: the answer's text less the
    spaces and tabs that end it (``prior``), those (``seam``), and how many of the delivered
    tokens were thinking (``thought_tokens``)."""

    prior: str = ""
    seam: str = ""
    thought_tokens: int = 0
    tool_calls: bool = False  # part of a tool call was delivered: no resume is possible


# vLLM's own fields that hold an answer to a format, which a pool may pass on (upstream_fields)
FORMAT_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def _holds_format(upstream: Mapping[str, Any]) -> bool:
    """Whether a request's fields for the model server hold its answer to a format: a
    ``response_format`` (json_object, json_schema, a server's own: anything but
    ``{"type": "text"}``), or one of vLLM's own (:data:`FORMAT_FIELDS`)."""
    rf = upstream.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        return True
    return any(upstream.get(name) is not None for name in FORMAT_FIELDS)


def _delivered(d: Delivery) -> Delivered:
    """What was delivered before this attempt. A resume sends the text without its seam
    (_body), and the continuation's first whitespace, as far as it is the same, is not sent
    again (:func:`_past_seam`): the client has it. Sent with it, the continuation often began
    with its own (" 4." after "It is "; a chat template that trims the message to continue,
    as Llama 3's does, always gave it one), and the client read two."""
    if not d.claimed.generated:
        return Delivered()
    ids = [i for i in d.claimed.generated if i != THOUGHT_ID]
    text = decode(ids)
    prior = text.rstrip(SEAM_SPACE)
    return Delivered(prior, text[len(prior):], len(d.claimed.generated) - len(ids), TOOL_CALL_ID in ids)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _whole_chars(text: str, held: str) -> tuple[str, str]:
    """(``held`` + ``text`` as characters, a high surrogate that ends it, held for the next
    chunk). JSON may write a character past the BMP as two ``\\u`` escapes, and a server that
    slices its text in UTF-16 units may send the halves in two chunks: each half alone is no
    character (its UTF-8 encoding failed the request). A pair becomes its character, a lone
    half U+FFFD."""
    text = held + text
    if not _SURROGATE.search(text):
        return text, ""
    held = text[-1] if "\ud800" <= text[-1] <= "\udbff" else ""
    if held:
        text = text[:-1]
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace"), held


def _past_seam(text: str, seam: str) -> tuple[str, str]:
    """(``text`` less its start that repeats ``seam``, what of the seam is still to match): the
    matching stops at the first character that differs, or goes on in the next text when
    all of this one matched."""
    k, n = 0, min(len(text), len(seam))
    while k < n and text[k] == seam[k]:
        k += 1
    return ("", seam[k:]) if k == len(text) else (text[k:], "")


def _unresumable(d: Delivery, before: Delivered) -> str:
    """What of ``d``'s delivered answer no continuation can follow ("" when one can)."""
    if before.tool_calls:
        return "during a tool call"
    if d.payload.prompt_ids and d.claimed.delivered:
        # the text delivered cannot follow the ids (a prompt is one or the other), and its
        # tokens are the worker's bytes, not the model's
        return "an answer to a token-id prompt"
    if before.prior and _holds_format(d.payload.upstream):
        # the server holds an answer to the format from its first token: a continuation of
        # the text delivered is held to it anew, a whole object after the client's half
        return "an answer held to a format (response_format, guided_json, ...)"
    return ""


def _past_echo(text: str, echo: str, data: str) -> tuple[str, str]:
    """(``text`` less its start that is the echoed prompt, what of the prompt is still to come):
    a server asked to ``echo`` sends the prompt before the answer (vLLM: in the first chunk,
    with the prompt's tokens' logprobs). Anything else is :class:`MalformedStream`: the frontend
    puts the prompt before the answer itself, and the client would read something else."""
    k = min(len(text), len(echo))
    if text[:k] != echo[:k]:
        raise MalformedStream(f"an echo that is not the prompt in {data[:200]!r}")
    return text[k:], echo[k:]


async def _connected(_session: aiohttp.ClientSession, ctx: Any, _params: Any) -> None:
    """A trace hook (``on_connection_create_end``, ``on_connection_reuseconn``): aiohttp
    runs it inside ``connect``, once the request has its connection and before it writes a
    byte of it. The request's attempt is marked sent from here: a cancel that comes after
    it never reads as unsent (one between it and the first write reads as sent: charged,
    the safe side)."""
    if (attempt := (ctx.trace_request_ctx or {}).get("attempt")) is not None:
        attempt.upstream_sent = True


async def _read_to_end(resp: aiohttp.ClientResponse) -> None:
    """Read a stream's body to its end after its ``[DONE]``, then let it go: the connection
    goes back to the pool for the next request. Left at ``[DONE]`` where the body's end had
    not come in the same read, aiohttp closed it: a new TCP connection per request, and a
    TIME_WAIT socket each (at 1,000 requests/s the ephemeral ports run out). What a server
    sends after ``[DONE]`` is not part of the answer; one that never ends its body loses the
    connection after END_OF_BODY_S."""
    try:
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
            async with asyncio.timeout(END_OF_BODY_S):
                while await resp.content.readany():
                    pass
    finally:
        resp.release()  # read to its end, it went back to the pool; else its connection closes


async def _error_text(resp: aiohttp.ClientResponse, unsaid: str | None = None) -> str:
    """What the model server said went wrong: OpenAI's ``{"error": {"message"}}``, an older
    vLLM's ``{"message"}``, FastAPI's ``{"detail"}`` (each was once read as "None"), or a plain
    text body -- never an HTML page (a proxy's error page may name an internal address).
    A body that says nothing gives ``unsaid``, else the reason phrase.

    At most ERROR_BODY_LIMIT bytes are read (the body was read whole: a server's endless or
    huge error body held the worker's memory), and the JSON is parsed whole, not its first
    500 characters (a longer error, vLLM's validation errors say, was read as its reason
    phrase, "Bad Request")."""
    # content.read(n) returns what has come so far (up to n), not the body: a body that came
    # in two reads (a proxy forwarding it as it comes, two TCP segments) was cut, its JSON
    # unparsed, and the client read the reason phrase (a priority refusal was missed).
    # What has come after HEALTH_TIMEOUT_S is taken as it is: a body that never ends must not
    # hold the request for the socket's read timeout (upstream_timeout_s).
    raw = b""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            while len(raw) < ERROR_BODY_LIMIT:
                if not (more := await resp.content.read(ERROR_BODY_LIMIT - len(raw))):
                    break
                raw += more
    try:
        body = raw.decode(resp.charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        body = raw.decode("utf-8", errors="replace")
    with contextlib.suppress(ValueError):
        doc = json.loads(body)
        if isinstance(doc, dict):
            err = doc.get("error")
            if isinstance(err, dict) and err.get("message"):
                return str(err["message"])
            for found in (err, doc.get("message"), doc.get("detail")):
                if isinstance(found, str) and found:
                    return found
    text = body.strip()[:500]
    if not text or text.startswith("<") or text.startswith("{"):
        return (resp.reason or "") if unsaid is None else unsaid
    return text


class UpstreamLoop:
    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        s = rt.settings
        # A query (a gateway's `?api-key=`) goes after each endpoint's path: appended to the
        # whole URL, the paths went into the query ("...?api-key=k/v1/completions").
        url, q, query = s.upstream_url.partition("?")
        self.query = q + query
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.shown = shown_upstream(self.base + self.query)  # in logs and the heartbeat
        self.shown_base = shown_upstream(self.base)  # a request's log lines add its path to it
        self.model = s.upstream_model or rt.pool_cfg.model_name
        self.api_key = os.environ.get("QOS_UPSTREAM_API_KEY", "")
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._empty_claims = 0  # claims in a row that left a backlog this worker could not take
        self._marker_taken = False  # the last wait took a wake marker no claim has acted on yet
        # request id -> why its task was interrupted (cancel | lost | release), or "settle": a
        # task landing a decided answer, which only the drain's deadline interrupts
        self.why: dict[str, str] = {}
        self.breaker = Breaker(s.upstream_retry_min_s, s.upstream_retry_max_s, rt.metrics)
        # upstream_priority is on and the server refused the field (vLLM without
        # --scheduling-policy priority): sent no more by this process (a warning, once)
        self.priority_refused = False
        self.pushes = MergedPushes(rt)
        self._gen_tokens = 0
        self._work = 0.0  # weighted tokens streamed (prompt x weight at the first token, bytes x out_weight)
        # Capacity is measured only while the upstream is saturated (at least FULL_SHARE of
        # max_inflight requests open): with fewer open it serves what is asked, so tokens/s
        # would measure demand (one sequential client read as 2 % of the server's capacity).
        self._full = max(1, math.ceil(FULL_SHARE * s.max_inflight))
        self._busy_s = 0.0  # saturated time since the last heartbeat
        self._busy_since: float | None = None
        self._busy_work = 0.0  # work streamed during that time
        self._work_at_busy = 0.0  # self._work when the current saturated stretch began
        self._last_stats_t = time.monotonic()
        rt.on_lost = lambda ids: self._interrupt(ids, "lost")
        rt.on_stop = lambda ids: self._interrupt(ids, "cancel")
        rt.stats = self.stats
        self.session: aiohttp.ClientSession
        # Streams answered ([DONE] read) whose body's end is still to come: read on beside the
        # next requests (_read_to_end), so that a server slow to end its body does not hold
        # the answer's landing. Each holds its connection until then.
        self.ending_bodies: dict[aiohttp.ClientResponse, asyncio.Task[None]] = {}
        self.stall = StallClock(s.upstream_stall_s, time.monotonic())  # the hang watch's clock
        self._last_path = "/chat/completions"  # the generation endpoint the last stream used
        self._hung = False  # a stall tripped the breaker: a probe must see the server generate
        # the server refused the worker's key: a probe must see it take the key (its /health
        # asks for none, and a rotated key kept failing every request the worker claimed)
        self._key_refused = False

    @contextlib.asynccontextmanager
    async def _post(self, path: str, body: dict[str, Any],
                    attempt: Delivery | None = None) -> AsyncIterator[aiohttp.ClientResponse]:
        """``session.post`` as ``async with``, except that a response handed to
        :meth:`_end_body_later` is left open for that task to end. ``attempt``'s
        ``upstream_sent`` is set once the request has a connection (:func:`_connected`)."""
        resp = await self.session.post(self.base + path + self.query, json=body, headers=self._headers(),
                                       allow_redirects=False,
                                       trace_request_ctx=None if attempt is None else {"attempt": attempt})
        try:
            yield resp
        finally:
            if resp not in self.ending_bodies:
                resp.release()

    def _end_body_later(self, resp: aiohttp.ClientResponse) -> None:
        """After ``[DONE]``: the body's end is read (and the connection let go) beside what
        follows, at once where it has come already."""
        if resp.content.at_eof():
            return  # _post releases it: back to the pool now
        task = asyncio.create_task(_read_to_end(resp))
        self.ending_bodies[resp] = task
        task.add_done_callback(lambda _t: self.ending_bodies.pop(resp, None))

    async def run(self) -> None:
        s = self.rt.settings
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=s.upstream_timeout_s)
        # Idle connections are dropped before the model server drops them (MODEL_SERVER_KEEPALIVE_S).
        # Twice max_inflight: a body's end read after [DONE] (_end_body_later) holds its
        # connection while the request that took the slot opens another (at max_inflight, the
        # next request waited for that end: a review), and a health check never waits for one.
        connector = aiohttp.TCPConnector(limit=2 * s.max_inflight, keepalive_timeout=MODEL_SERVER_KEEPALIVE_S)
        # marks a request sent once it has a connection (a cancel before that is charged nothing)
        sent = aiohttp.TraceConfig()
        sent.on_connection_create_end.append(_connected)
        sent.on_connection_reuseconn.append(_connected)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                         trace_configs=[sent]) as session:
            self.session = session
            watches = [asyncio.create_task(self._watch_cancels()), asyncio.create_task(self._watch_stalls()),
                       asyncio.create_task(self._watch_idle_health())]
            try:
                await self._loop()
            finally:
                # (re-cancelled where a redis-py call swallowed it; the bodies' connections
                # close with the session)
                await stop_tasks([*watches, *self.ending_bodies.values()], "openai worker")

    async def _loop(self) -> None:
        while True:
            if self.rt.draining.is_set():
                # Read once a pass: a task made below and cancelled by the deadline's interrupt
                # before its first step never runs its body (nor its finally), and stayed in
                # self.tasks, done, the wait below returning at once: a spinning drain.
                expired = self.rt.drain_expired
                if not expired:
                    self._settle_decided()  # after the deadline, one hand-back each is the bound
                for rid in [rid for rid, task in self.tasks.items() if task.done()]:
                    del self.tasks[rid]  # only such a task: the others leave on their own
                    self.why.pop(rid, None)
                if not self.tasks:
                    return
                if self.rt.drain_hopeless:
                    # Nothing streamed can be delivered and the leases lapse on their own: stop
                    # the streams (closing them upstream) without a word to Redis.
                    log.warning("draining with Redis out of reach for a whole lease: stopping now; "
                                "the %d requests held resume on another worker once their leases "
                                "expire", len(self.rt.held))
                    for rid, task in self.tasks.items():
                        self.why[rid] = "lost"  # also over a cancel whose completion cannot land
                        task.cancel()
                    await asyncio.gather(*self.tasks.values(), return_exceptions=True)
                    return
                if expired:
                    # Those interrupted already (a cancel) are not again: one still landing its
                    # completion through an outage is awaited here, a look at a time (awaiting
                    # them all held the drain for as long as Redis stayed down), until Redis
                    # has been gone for a lease (drain_hopeless, above).
                    self._interrupt(list(self.tasks), "release")
                await asyncio.wait(list(self.tasks.values()), timeout=0.2)
                continue
            await self.rt.guard("worker", self._pull())

    def _settle_decided(self) -> None:
        """A completion decided outside a stream (an unusable payload at claim) that met a
        Redis outage is held with its final and no task: nothing else would ever retry it."""
        for rid, d in self.rt.held.items():
            if rid not in self.tasks and d.final is not None:
                # Not to be interrupted by a client's cancel (the answer stands; cancelled, the
                # task was made again at the next look, to be cancelled again): see _interrupt.
                self.why[rid] = "settle"
                self.tasks[rid] = asyncio.create_task(self._settle(d))

    async def _pull(self) -> None:
        self._settle_decided()
        if self.breaker.state != "closed":
            if self._marker_taken:
                # A stream failed while this worker waited on the wake list, and the marker
                # the wait took announced work it will not claim now: another idle worker
                # would have learnt of that work only when its own wait ran out (idle_block_s).
                self._marker_taken = False
                await self.rt.announce_work()
            await self._probe_when_due()
            return
        room = self.rt.settings.max_inflight - len(self.rt.held)
        if room <= 0:
            if self.tasks:
                await asyncio.wait(list(self.tasks.values()), timeout=1.0,
                                   return_when=asyncio.FIRST_COMPLETED)
            else:  # held, none of it ours to run (asyncio.wait([]) raised and killed the worker)
                await asyncio.sleep(IDLE_HELD_S)
            return
        got = await self.rt.claim(room, 0)
        self._marker_taken = False
        for d in got:
            if (old := self.tasks.get(d.request_id)) is not None:
                old.cancel()  # its attempt's lease had lapsed: this claim is the request now
            self.why.pop(d.request_id, None)  # news for an old attempt, not this one
            self.tasks[d.request_id] = asyncio.create_task(self._serve(d))
        self._track_busy()
        if got:
            self._empty_claims = 0
            if not self.rt.claim_left_backlog and len(got) < room:
                # It took everything queued: more work comes with a wake marker, so wait for
                # one (the BLPOP returns at once when one is there) instead of the claim that
                # used to follow every claim and find nothing (~150 us of the shard's time).
                # Not before what this claim decided is on its way (its settling, retried).
                self._settle_decided()
                self._marker_taken = await self.rt.wait_for_work()  # in-flight streams carry on meanwhile
        elif self.rt.claim_left_backlog:
            # Work is queued that this worker cannot take now (a class held by its ceiling):
            # claim announces it again, and without a back-off the marker it left woke this
            # loop at once (~1,000 claims a second). As the step loop does: 20 ms doubling to 100.
            self._empty_claims += 1
            s = self.rt.settings
            await asyncio.sleep(min(s.idle_block_s, s.claim_interval_ms / 1e3
                                    * min(2 ** (self._empty_claims - 1), MAX_BACKOFF_INTERVALS)))
        else:
            self._empty_claims = 0
            self._marker_taken = await self.rt.wait_for_work()  # in-flight streams carry on meanwhile

    async def _settle(self, d: Delivery) -> None:
        """Land a held request's decided completion (retried through outages; at the drain's
        deadline for as long as a hand-back retries one)."""
        task = asyncio.current_task()
        try:
            assert d.final is not None
            await self._finish(d, d.final)
        except asyncio.CancelledError:
            if self.tasks.get(d.request_id) is not task or self.why.get(d.request_id) != "release":
                raise  # a newer attempt's claim, or the loop ending
            await self.rt.hand_back([d])
        except Exception:  # not an outage (a refusal of the worker's own): made again, it would fail again
            log.exception("%s: its decided answer cannot be landed; left to its lease", d.request_id)
            self.rt.drop(d.request_id, "given_up", d)
        finally:
            if self.tasks.get(d.request_id) is task:
                self.tasks.pop(d.request_id)
                self.why.pop(d.request_id, None)  # not to be read by a later attempt's task

    async def _probe_when_due(self) -> None:
        """Wait out the back-off (a drain ends the wait), then ask the upstream once."""
        wait_s = self.breaker.retry_at - time.monotonic()
        if wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.rt.draining.wait(), wait_s)
            return  # the loop comes back here (or drains)
        self.breaker.probes += 1
        # a drain does not wait for the probe (its health checks, or a canary's 30 s)
        probe = await self.rt.unless_draining(self._probe())
        if probe is None:
            return  # drained: the breaker as it was
        if why := probe.result():
            self.breaker.probe_failed(why)
        else:
            self._hung = self._key_refused = False
            self.breaker.probe_ok()

    async def _probe(self) -> str:
        """Why the upstream cannot serve now ("" when it can): its health, and after a stall
        a one-token generation."""
        why = await self._unwell()
        if not why and (self._hung or self._key_refused):
            why = await self._no_generation()
        return why

    async def _no_generation(self) -> str:
        """After a stall (_watch_stalls): why the server does not generate ("" when it does).
        A hung engine's server may answer /health, and the worker claimed again, took up to
        max_inflight requests into the same silence, and handed them back each stall (an
        attempt spent each time: a request failed after max_attempts on one hung server that
        a healthy one could have served; found by a review). So a one-token completion must
        bring an event within min(upstream_stall_s, CANARY_TIMEOUT_S). It goes to the endpoint
        the worker's streams last used, then the other: one that refuses it (a 4xx but 408 and
        429, or a 501: a proxy whose key allows chat alone, say) is no answer either way (it
        kept the breaker open for good: a review); a busy or failing one (429, 5xx) is down."""
        timeout_s = min(self.rt.settings.upstream_stall_s, CANARY_TIMEOUT_S)
        base = {"model": self.model, "max_tokens": 1, "stream": True}
        asks = [("/completions", {**base, "prompt": "ping"}),
                ("/chat/completions", {**base, "messages": [{"role": "user", "content": "ping"}]})]
        asks.sort(key=lambda ask: ask[0] != self._last_path)
        status = 0
        try:
            async with asyncio.timeout(timeout_s):
                for path, body in asks:
                    async with self._post(path, body) as resp:
                        status = resp.status
                        if status in CREDENTIAL_STATUSES:
                            return f"the model server refuses the worker's credentials (HTTP {status})"
                        if status == 501 or (400 <= status < 500 and status not in DOWN_STATUSES):
                            continue
                        if status != 200:
                            return f"a one-token generation: HTTP {status}"
                        async for _events in sse_batches(resp.content):
                            self.stall.heard(time.monotonic())
                            return ""
                        return "a one-token generation ended without an event"
        except TimeoutError:
            return f"no event from a one-token generation in {timeout_s:g} s"
        except (aiohttp.ClientError, MalformedStream) as exc:
            return f"a one-token generation: {_said(exc)}"
        log.warning("the model server refuses a one-token generation (HTTP %d): taken as generating", status)
        return ""

    async def _unwell(self) -> str:
        """Why the model server cannot serve now ("" when it can), by its own health: GET
        /health first (vLLM, SGLang, TGI: 200 when the engine serves, vLLM 503 once it died).
        vLLM kept up after its engine died (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH, or the seconds
        before it exits) still lists its models, and a probe of those said "up". A server
        without one (404/405) is asked for its models."""
        status = 0
        try:
            for path in (self.base.removesuffix("/v1") + "/health", self.base + "/models"):
                async with self.session.get(path + self.query, headers=self._headers(), allow_redirects=False,
                                            timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as resp:
                    status = resp.status
                    await resp.read()
                if status not in (404, 405):
                    break
        except (TimeoutError, aiohttp.ClientError) as exc:
            return _said(exc)
        if 300 <= status < 400:
            return f"HTTP {status}, a redirect: {REDIRECT_ADVICE}"
        return f"HTTP {status}" if status in DOWN_STATUSES or status >= 500 else ""

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _interrupt(self, ids: list[str], why: str) -> None:
        for rid in ids:
            task = self.tasks.get(rid)
            # A task interrupted already is not again; one landing a decided answer
            # (_settle_decided) only by the drain's deadline, which bounds it as a hand-back.
            now = self.why.get(rid)
            if task is not None and (now is None or (now == "settle" and why == "release")):
                self.why[rid] = why
                task.cancel()

    async def _watch_cancels(self) -> None:
        """Cancellation check for every stream: pushes do not say it (lua/push_tokens.lua).
        Every ``flush_ms``, as the step worker checks its own: one SMISMEMBER."""
        period = self.rt.settings.flush_ms / 1e3
        while True:
            await asyncio.sleep(period)
            if self.tasks:
                ids = await self.rt.guard("cancels", self.rt.cancelled(list(self.tasks)), backoff=0)
                self._interrupt(ids or [], "cancel")
                raise_if_cancelled()  # one the redis-py call swallowed: the worker's stop waited on it

    async def _watch_stalls(self) -> None:
        """The hang watch: when the server has sent no event on any of its open streams for
        ``upstream_stall_s``, it is taken as hung, and every open stream is handed back as if
        it had broken off (the breaker trips; another worker resumes them). Each stream alone
        would wait ``upstream_timeout_s`` (600 s), and a server whose engine hung took a new
        request into that wait every time one ended. A healthy server under load always
        streams some request's tokens; all of them silent that long is no prefill."""
        stall_s = self.stall.stall_s
        if stall_s <= 0:
            return
        while True:
            await asyncio.sleep(min(1.0, stall_s / 4))
            now = time.monotonic()
            silent = self.stall.silent_s(now)
            if ids := self.stall.stalled(now):
                log.warning("%s sent nothing on any of its %d open streams for %.0f s (upstream_stall_s "
                            "%g): taken as hung, the requests handed back; claiming again once a "
                            "one-token generation answers", self.shown, len(ids), silent, stall_s)
                self._hung = True
                self._interrupt(ids, "stalled")

    async def _watch_idle_health(self) -> None:
        """While nothing is in flight, the server's health every ``upstream_idle_check_s``: a
        server that died while the pool sat idle kept the breaker closed, `/readyz` 200 and
        the worker "up" in `qos status` until a request was claimed into it (a newcomer's walk
        waited 20 s and more). Unwell, the breaker opens as a request's failure opens it (not
        counted as one): the worker stops claiming and probes as after any failure. Not while
        requests are in flight: their streams tell, and a busy server may answer health late."""
        period = self.rt.settings.upstream_idle_check_s
        if period <= 0:
            return
        while True:
            await asyncio.sleep(period)
            if self.breaker.state != "closed" or self.tasks or self.rt.held or self.rt.draining.is_set():
                continue
            why = await self._unwell()
            # a claim may have started a request meanwhile: its own stream decides then
            if why and self.breaker.state == "closed" and not self.tasks and not self.rt.draining.is_set():
                self.breaker.trip(f"an idle health check: {why}", request=False)

    # --- one request ------------------------------------------------------------------------
    async def _serve(self, d: Delivery) -> None:
        # Everything below acts on this attempt only: when this worker's lease lapsed and it
        # claimed the request back, the old attempt's LeaseLost dropped the new one from
        # ``held`` and its task from ``tasks`` (the new stream ran on, unrenewed, uncancellable).
        rid = d.request_id
        task = asyncio.current_task()
        d.usage_in = d.claimed.input_tokens  # the frontend's count, until the upstream reports its own
        try:
            result = await self._stream(d)
            if result[0] == "ok":
                self.breaker.success()
            self._settling(d, task)
            await self._finish(d, result)
        except UpstreamDown as exc:
            await self._upstream_down(d, task, exc)
        except asyncio.CancelledError:
            why = self.why.get(rid, "release") if self.tasks.get(rid) is task else "lost"
            if why == "lost":
                self.rt.drop(rid, "lost", d)
            elif why == "cancel":
                if d.claimed.delivered == 0 and not d.upstream_sent:
                    # This attempt was never sent (no connection yet: the pool's were all held,
                    # or the server was slow to accept one) and no attempt delivered a token:
                    # complete's usage_in says no prompt was processed -- charged nothing, as
                    # the step worker's look-ahead cancelled before it started. (An earlier
                    # attempt that reached a server and delivered nothing is not charged
                    # either: which it was is not recorded.) Sent, it is charged its prompt
                    # though no byte came back: the server may have prefilled it.
                    d.usage_in = 0
                await self._finish(d, ("cancelled", "cancelled", ""))
            elif why == "stalled":  # (_watch_stalls) as if the stream had broken off
                await self._upstream_down(d, task, UpstreamDown(
                    f"{self.shown}: no event on any stream for more than "
                    f"{self.rt.settings.upstream_stall_s:g} s (upstream_stall_s)", spent=True))
            else:  # the drain's deadline, or the loop ending: a decided answer is finished
                await self.rt.hand_back([d])
        except LeaseLost:
            self.rt.drop(rid, "lost", d)
        except Exception as exc:  # a bug must fail one request, not the worker
            log.exception("%s: upstream stream failed: %s", rid, exc)
            self._settling(d, task)
            await self._finish(d, ("failed", "error", "internal error in the worker (details in its log)"))
        finally:
            if self.tasks.get(rid) is task:
                self.tasks.pop(rid)
                self.why.pop(rid, None)
            self._track_busy()

    def _settling(self, d: Delivery, task: asyncio.Task[Any] | None) -> None:
        """``d``'s answer is decided and its task lands it: from now on only the drain's
        deadline interrupts it (_interrupt), as a task of _settle_decided. A client's cancel
        seen meanwhile interrupted the `complete` in flight, and the worker completed the
        request again, `cancelled`: before the first landed, the cancel replaced the answer
        (its last tokens, its sample's `ok`); after, the second found the request finished and
        it was counted `lost` (found by a review). A cancel that came before the answer was
        decided still applies (setdefault: its interrupt is on its way)."""
        if self.tasks.get(d.request_id) is task:
            self.why.setdefault(d.request_id, "settle")

    async def _upstream_down(self, d: Delivery, task: asyncio.Task[Any] | None, exc: UpstreamDown) -> None:
        """As if this worker had died: the request goes back with what it delivered, and
        another worker (or this one, once the upstream answers) resumes it."""
        rid = d.request_id
        self.breaker.trip(str(exc))
        if self.tasks.get(rid) is task:
            # Handing back already: not to be interrupted meanwhile by the cancel watcher or
            # the drain's deadline (a cancel interrupting the retry dropped the request to
            # wait out its lease; `release` cancels a request whose client is gone).
            self.why.setdefault(rid, "release")
        try:
            # An answer that broke off spends the attempt (as when a worker dies): a prompt the
            # model server always breaks on went round for ever, max_attempts never applying.
            # Through a passing Redis outage it is tried again (rt.hand_back).
            await self.rt.hand_back([d], spent=exc.spent)
        finally:
            # If it could not be handed back, or a cancel or lost lease interrupted it, the
            # lease expires (held, it was renewed for ever with no task to end it). Unless
            # its answer got decided meanwhile (its tokens refused, the failure's completion
            # meeting an outage): _settle_decided lands that, not a requeue and a new answer.
            if d.final is None:
                self.rt.drop(rid, "released", d)

    def _track_busy(self) -> None:
        self.rt.metrics.batch_size.set(len(self.tasks))
        now = time.monotonic()
        saturated = len(self.tasks) >= self._full
        if saturated and self._busy_since is None:
            self._busy_since, self._work_at_busy = now, self._work
        elif not saturated and self._busy_since is not None:
            self._busy_s += now - self._busy_since
            self._busy_work += self._work - self._work_at_busy
            self._busy_since = None

    async def _finish(self, d: Delivery, result: Result) -> None:
        backoff = Backoff(f"{d.request_id}: complete", first_s=0.2, max_s=5.0, logger=log)
        while self.rt.held.get(d.request_id) is d:  # not a newer attempt's: it has its own
            try:
                await self.rt.finish(d, *result)
            except PolicyMissing:  # Redis restarted empty: re-create the pool; the record is gone
                await self.rt.guard("pool", self.rt.ensure_pool())
            except RedisUnavailable as exc:
                await backoff.failed(exc)
            else:
                backoff.succeeded()

    def _body(self, d: Delivery, allowance: int, prior: str,
              priority: bool = True) -> tuple[str, dict[str, Any]]:
        """The upstream request, continuing ``prior`` (:func:`_delivered`). Raises ValueError
        for a chat payload without its messages."""
        p = d.payload
        body: dict[str, Any] = {
            "model": self.model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": allowance}
        # What the client left out stays out: the server applies its own defaults (vLLM: the
        # model's generation_config), as it would for the client directly; and no seed the
        # client did not give (vLLM: a seeded request gets a generator of its own, off its
        # batched sampler; a resume upstream is not reproducible by a seed anyway).
        for name, value in (("temperature", p.temperature), ("top_p", p.top_p)):
            if name not in p.defaulted:
                body[name] = value
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        if self.rt.settings.upstream_chunk_usage:
            body["stream_options"]["continuous_usage_stats"] = True
        if priority and self.rt.settings.upstream_priority and not self.priority_refused:
            # A request its class's starvation floor claimed goes as the top class: sent as
            # its own class, the server's priority scheduler held it behind every P0 request a
            # flood kept arriving (the floor then held only at claim). The floor tier claims
            # only while its class is below its floor, so at most about that share of the
            # server's work goes at the top class's rank this way (the step worker keeps such
            # requests' slots instead: worker/batch_policy.py).
            body["priority"] = 0 if d.claimed.by_floor else d.class_rank
        if p.ignore_eos:
            body["ignore_eos"] = True
        if p.min_tokens > d.total_tokens:
            body["min_tokens"] = min(p.min_tokens - d.total_tokens, allowance)
        for name, value in p.upstream.items():  # the pool's upstream_fields, as the client sent them
            body.setdefault(name, value)  # (config refuses a name the worker sets; it wins anyway)
        if p.kind != "chat":
            body["prompt"] = list(p.prompt_ids) if p.prompt_ids else p.prompt + prior
            if d.claimed.delivered:  # a resume: the prompt's logprobs reached the client before
                body.pop("echo", None)
            return "/completions", body
        if not p.messages:
            raise ValueError("chat payload without structured messages (written by an older frontend?)")
        msgs = [m.to_dict() for m in p.messages]
        if prior:
            msgs.append({"role": "assistant", "content": prior})
            body.update(continue_final_message=True, add_generation_prompt=False)
        body["messages"] = msgs
        return "/chat/completions", body

    def _failed(self, d: Delivery, url: str, client_message: str, detail: str = "",
                outcome: str = "failed") -> Result:
        """A request the upstream refused or botched: the log names the upstream and the
        details, the client reads only what the model server did. ``outcome`` "refused": the
        request itself is at fault (lua/complete.lua), its client is told not to retry it."""
        log.warning("%s: upstream %s: %s%s", d.request_id, url, client_message,
                    f" ({detail})" if detail else "")
        return (outcome, "error", client_message)

    async def _stream(self, d: Delivery, priority: bool = True) -> Result:
        """Stream one attempt (``priority``: send the class's, unless the server refused it).
        Raises :class:`UpstreamDown` when the upstream cannot be reached or breaks off (the
        caller hands the request back)."""
        max_tokens = min(d.payload.max_tokens, d.claimed.max_tokens)
        if d.total_tokens >= max_tokens:
            return ("ok", "length", "")
        try:
            before = _delivered(d)
            if what := _unresumable(d, before):
                log.warning("%s: the model server broke off %s; it cannot be resumed", d.request_id, what)
                return ("failed", "error", f"the model server broke off {what}, which cannot be resumed; "
                        "retry the request")
            seam = before.seam
            path, body = self._body(d, max_tokens - d.total_tokens, before.prior, priority)
        except ValueError as exc:
            return ("failed", "error", f"unusable request: {exc}")  # an older frontend's payload?
        url = self.shown_base + path  # in what is logged: never the credentials of upstream_url
        chat = path == "/chat/completions"
        # A resume after the answer's text began continues that text (the assistant message
        # to continue): all the model writes is answer, whichever field the server puts it in.
        # vLLM's deepseek_r1 parser (DeepSeek-R1, QwQ) calls everything before a `</think>`
        # thinking, and a continuation has none: the rest of the answer came as thinking.
        continues_text = chat and bool(before.prior)  # (what _body sends: whitespace alone is not)
        # A resume after thinking alone sends the client's prompt as it was: the model thinks
        # again from the start. That second thought is counted and charged, not forwarded:
        # the client read the first (as far as it came); a second after it began the same
        # reasoning anew.
        thinks_again = chat and not continues_text and before.thought_tokens > 0
        allowance = max_tokens - d.total_tokens
        wants_logprobs = "logprobs" in d.payload.upstream  # (a logprobs pool's: worker/logprobs.py)
        # a completion that asked for the prompt's logprobs: the server echoes the prompt before
        # the answer, which the frontend adds itself (_past_echo; a token-id prompt has no text
        # here: its echo, of a text the frontend does not have, is forwarded as it comes)
        echo = d.payload.prompt if body.get("echo") else ""
        # its first chunk carries the prompt's tokens' logprobs, a line as long as the prompt
        max_line = MAX_SSE_LINE if not body.get("echo") else echo_line_bytes(
            d.payload.prompt_ids or d.payload.prompt, int(body.get("logprobs") or 0))
        counted = 0  # upstream tokens taken in this attempt
        halves = ["", ""]  # a high surrogate that ended the last chunk's text, its thinking (_whole_chars)
        reasoning_field = "reasoning"
        finish: str | None = None
        done = False
        last = time.monotonic()
        flush_tried = -math.inf

        def flush_at() -> float | None:
            """When the read gives way to push the tokens pending, which waited for the next
            chunk however long the server paused (:meth:`WorkerRuntime.push_due_at`): batched
            (forwarding off, an unstreamed request), or left by a push that met an outage. At
            most once a period after the last such try: an outage is not retried in a loop."""
            due = self.rt.push_due_at(d)
            return None if due is None else max(due, flush_tried + self.rt.settings.flush_ms / 1e3)

        self.stall.opened(d.request_id, d, last)
        self._last_path = path
        try:
            try:
                async with self._post(path, body, d) as resp:
                    if resp.status in DOWN_STATUSES:
                        raise UpstreamDown(f"HTTP {resp.status} from {url}", spent=False)
                    if 300 <= resp.status < 400:
                        raise UpstreamDown(f"{url}: HTTP {resp.status}, a redirect: {REDIRECT_ADVICE}",
                                           spent=False)
                    if resp.status != 200:
                        text = (await _error_text(resp))[:300]
                        if resp.status >= 500 and _engine_died(text):
                            # vLLM checks its engine before it takes the request: this one never
                            # ran, and its attempt is not spent (the breaker bounds the retries)
                            raise UpstreamDown(f"{url}: HTTP {resp.status}, the model server's engine died: "
                                               f"{text}", spent=False)
                        if resp.status >= 500:
                            # Not in the words of a death vLLM writes today (an older vLLM's 500
                            # had no body), so the server's health decides: unwell, it is the
                            # server going away; well, the request's own failure. The attempt
                            # counts here: a request that itself breaks the server before its
                            # answer starts would go round the fleet's servers, breaking each,
                            # where max_attempts now stops it. The connection goes back first:
                            # with every slot of the pool held by a failing stream, the health
                            # check would wait for one. Once the breaker is open (another stream
                            # found the server down), it is not asked again.
                            resp.release()
                            why = "open" if self.breaker.state == "open" else await self._unwell()
                            if why:
                                raise UpstreamDown(f"{url}: HTTP {resp.status} ({text}), and the model "
                                                   f"server's health says {why}", spent=True)
                        if resp.status == 400 and "priority" in body and "priority" in text.lower():
                            # A vLLM left at its default (first come, first served) refuses every
                            # non-zero priority: every class but the top one failed. The pool's
                            # queue still orders the work; the server's own queue then goes FIFO.
                            # Sent again without it, and given up for good only once that answer
                            # comes whole: a 400 that merely quotes the word (a validation error
                            # echoing a client's own field) turned priority off for every tenant
                            # of the worker (a review).
                            result = await self._stream(d, priority=False)
                            if result[0] == "ok" and not self.priority_refused:
                                log.warning("the model server refuses `priority` (%s): sending none from "
                                            "now on (vLLM: --scheduling-policy priority, or "
                                            "upstream_priority = false to silence this)", text[:200])
                                self.priority_refused = True
                            return result
                        if resp.status in CREDENTIAL_STATUSES:
                            # The worker's key, not the request: as if the server were down for
                            # this worker (its breaker opens, it claims nothing until a probe's
                            # one-token generation is taken with the key), the request handed
                            # back to a worker whose key works. Failed here, a rotated key made
                            # the worker fail every request it claimed, in milliseconds each: it
                            # claimed more than any other and emptied the queue into errors.
                            # The attempt is spent: a request refused with a key that a probe
                            # saw taken goes round max_attempts times, not for ever. The
                            # server's words (OpenAI's "Incorrect API key provided:
                            # sk-...abcd") are for the log alone.
                            log.warning("%s: upstream %s refused the worker's credentials (HTTP %d): %s",
                                        d.request_id, url, resp.status, text)
                            self._key_refused = True
                            raise UpstreamDown(f"{url}: the model server refuses the worker's credentials "
                                               f"(HTTP {resp.status})", spent=True)
                        return self._failed(d, url, f"the model server refused the request (HTTP "
                                            f"{resp.status}): {text}",
                                            outcome=_refusal_outcome(resp.status, text, d, self.model))
                    if resp.content_type == "application/json":
                        # A 200 that is not a stream: an error a proxy or server put in a JSON body
                        # (`{"error": ...}`), or an answer that ignored `stream`. Read as a stream,
                        # it "ended mid-answer": every attempt spent on it, the breaker tripped, and
                        # the server's message lost.
                        # (a body with no message in it: "OK" was all the client read)
                        unsaid = ("a whole answer, not the stream asked for (a server or proxy ignoring "
                                  "`stream`)")
                        text = (await _error_text(resp, unsaid))[:300]
                        return self._failed(d, url, f"the model server answered without a stream: {text}")
                    cut = False
                    async for events in sse_batches(resp.content, self.rt.settings.upstream_timeout_s,
                                                    wake_at=flush_at, max_line=max_line):
                        if not events:
                            # No chunk since tokens fell due (a server that paused: a preemption,
                            # a long prefill beside): they go now, not with the next chunk.
                            flush_tried = time.monotonic()
                            with contextlib.suppress(RedisUnavailable):  # stays pending; retried
                                await self.pushes.push(d)
                            continue
                        self.stall.heard(time.monotonic())
                        for data in events:
                            if data.strip() == "[DONE]":
                                done = True
                                break
                            try:
                                chunk = parse_chunk(data)
                            except ValueError:
                                chunk = None
                            if not isinstance(chunk, dict):
                                await self._forward_before_failing(d)
                                return self._failed(d, url, "the model server sent a malformed response",
                                                    f"chunk {data[:200]!r}")
                            if chunk.get("error"):
                                err = chunk["error"]
                                msg = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
                                code = err.get("code") if isinstance(err, dict) else None
                                # vLLM 0.8 to 0.10 write a stream's error with their default
                                # code, 400 (create_streaming_error_response(str(e))); later
                                # ones map the death to 500
                                if _engine_died(msg) and code in ENGINE_DEAD_CODES:
                                    if finish is not None and finish not in ("abort", "error"):
                                        return _ended(finish)  # the answer was over: as a break after it
                                    raise UpstreamDown(f"{url}: the model server's engine died mid-answer: "
                                                       f"{msg}", spent=True)
                                await self._forward_before_failing(d)
                                return self._failed(d, url, f"the model server reported an error: {msg}")
                            running = self._usage(d, chunk.get("usage"), before)
                            text = thought = ""
                            calls: list[dict[str, Any]] = []
                            probs: list[Logprob] = []
                            for ch in _choices(chunk, data, chat):
                                finish = ch.get("finish_reason") or finish
                                if wants_logprobs:
                                    probs += choice_logprobs(ch, chat, data)
                                if not chat:
                                    piece = ch.get("text")
                                else:
                                    delta = ch.get("delta") or {}
                                    piece = delta.get("content")
                                    calls += _tool_call_deltas(delta, data)
                                    # vLLM's --reasoning-parser: the thinking of a reasoning model
                                    # comes apart from the answer (`reasoning`; `reasoning_content`
                                    # before vLLM renamed it): forwarded under the same name
                                    for name in REASONING_FIELDS:
                                        if isinstance(r := delta.get(name), str) and r:
                                            if continues_text:
                                                text += r  # (before this delta's content)
                                            else:
                                                thought += r
                                                reasoning_field = name
                                            break
                                if isinstance(piece, str):
                                    text += piece
                            if text or halves[0]:
                                text, halves[0] = _whole_chars(text, halves[0])
                            if thought or halves[1]:
                                thought, halves[1] = _whole_chars(thought, halves[1])
                            if finish is not None and (halves[0] or halves[1]):
                                # the answer's end: no low half comes for a held one (U+FFFD)
                                text += "\ufffd" * len(halves[0])
                                thought += "\ufffd" * len(halves[1])
                                halves = ["", ""]
                            if echo and text:
                                text, echo = _past_echo(text, echo, data)
                            if seam and text:
                                was = text
                                text, seam = _past_seam(text, seam)
                                if probs:  # the repeated whitespace's tokens went with it
                                    probs = past_seam(probs, was[:len(was) - len(text)])
                            if thinks_again and thought and not (text or calls):
                                probs = []  # a second thought's, which the client does not read
                            # This chunk's tokens: the running usage says exactly; without it, one per
                            # chunk with text. The final usage (a chunk of its own, no text) brings the
                            # count up to the upstream's completion_tokens.
                            new = (max(running - counted, 0) if running is not None
                                   else int(bool(text or thought or calls)))
                            cut = counted + new > allowance
                            if cut:  # the upstream went past max_tokens: stop there
                                new = allowance - counted
                                if new == 0:  # all of this chunk is past it: none of its text either
                                    text = thought = ""
                                    calls = []
                                    probs = []
                            if new or text or thought or calls or probs:
                                self._take(d, text, new, thought, reasoning_field,
                                           forward_thought=not thinks_again, tool_calls=calls, logprobs=probs)
                                counted += new
                            if cut:
                                break
                        if done or cut:  # what is pending rides on complete: no push before it
                            break
                        now = time.monotonic()
                        gap, last = now - last, now
                        # As the upstream chunked it, for a client that reads the chunks as they come;
                        # chunks that came together (the worker was busy, the server sent a burst) go
                        # in one push: one Redis call and one reply entry, not one a chunk.
                        if self._forwards(d) or self.rt.push_due(d, now, step_s=gap):  # next ~gap away
                            with contextlib.suppress(RedisUnavailable):  # stays pending; retried
                                await self.pushes.push(d)  # with the other streams' of this turn
                    if cut:
                        return ("ok", "length", "")
                    if done:
                        self._end_body_later(resp)
            finally:
                self.stall.closed(d.request_id, d, time.monotonic())
        except MalformedStream as exc:
            await self._forward_before_failing(d)
            return self._failed(d, url, "the model server sent a malformed response", str(exc))
        except (TimeoutError, aiohttp.ClientError) as exc:
            if finish is not None and finish not in ("abort", "error"):
                # The answer was over (its finish_reason came) and the connection broke before
                # the usage chunk or [DONE]: finish it. Handed back, it was resumed from its
                # whole text and the model wrote on past its own stop.
                log.warning("%s: upstream %s: the connection broke after the answer's end (%s)",
                            d.request_id, url, _said(exc))
                return _ended(finish)
            raise UpstreamDown(f"{url}: {_said(exc)}",
                               spent=not isinstance(exc, CONNECT_ERRORS)) from exc
        if finish == "abort":  # vLLM: its engine aborted the request (POST /pause, a shutdown)
            raise UpstreamDown(f"{url}: the model server aborted the request (finish_reason abort)",
                               spent=True)
        if finish == "error":  # vLLM: the engine failed the request; what came is not the answer
            await self._forward_before_failing(d)
            return self._failed(d, url, "the model server ended the answer with an error (finish_reason "
                                "error)")
        if finish is None:
            if not done:  # the connection ended mid-answer: the server went away
                raise UpstreamDown(f"{url}: the stream ended without a finish_reason or [DONE]", spent=True)
            return self._failed(d, url, "the model server ended its answer without a finish reason")
        return _ended(finish)

    async def _forward_before_failing(self, d: Delivery) -> None:
        """A streamed answer that fails after text came in the same read as the failure: the
        client sees that text before the error, as when each chunk was pushed as it came (a
        failed completion counts its tokens as usage but sends the client only the error)."""
        if self._forwards(d):
            with contextlib.suppress(RedisUnavailable):  # the failure goes on; complete retries
                await self.pushes.push(d)

    def _forwards(self, d: Delivery) -> bool:
        """Whether ``d``'s pending chunks are pushed as they come: for a client that reads
        them as they come (upstream_forward_chunks)."""
        return self.rt.settings.upstream_forward_chunks and d.payload.stream and d.pending_tokens > 0

    def _usage(self, d: Delivery, u: Any, before: Delivered) -> int | None:
        """Record an upstream ``usage`` object; returns its ``completion_tokens`` (None: absent).
        ``before``: what earlier attempts delivered (how many of its tokens were thinking, and
        whether the resume's prompt holds any of its text)."""
        if not isinstance(u, dict):
            return None
        prompt, completion = _count(u.get("prompt_tokens")), _count(u.get("completion_tokens"))
        d.sample_extra.update(upstream_prompt_tokens=prompt, upstream_completion_tokens=completion)
        if prompt is not None:
            # usage's prompt side is the upstream's count; on a resume its prompt also holds the
            # text delivered before (about that many tokens), which is not prompt -- but not the
            # thinking delivered before, which the resume does not send (a resume cut off
            # mid-thought sends no text at all: its prompt is the client's alone).
            # Whitespace alone is not sent either (_body continues ``prior``, the text less its
            # seam): the prompt is then the client's alone.
            answered = d.claimed.delivered - before.thought_tokens if before.prior else 0
            d.usage_in = max(prompt - answered, 1) if answered > 0 else prompt
        return completion

    def _take(self, d: Delivery, text: str, tokens: int, reasoning: str = "",
              reasoning_field: str = "reasoning", forward_thought: bool = True,
              tool_calls: list[dict[str, Any]] | None = None, logprobs: list[Logprob] | None = None) -> None:
        """Queue ``tokens`` upstream tokens with their text (and reasoning, unless not
        ``forward_thought``: counted and marked all the same); the text's bytes are the ids a
        resuming worker rebuilds the delivered text from. The reasoning is not among them: a
        resume sends the answer's text as the assistant message to continue, which is what a
        chat template renders of an earlier turn (vLLM's parsers drop the thinking there); a
        resume cut mid-thought thinks again (not forwarded: _stream). ``tool_calls``: the
        chunk's tool-call deltas, forwarded as sent and marked among the ids (TOOL_CALL_ID).
        ``logprobs``: the chunk's tokens' (worker/logprobs.py), with its text, or alone where
        its tokens have none (vLLM's stop token: its text is left out, its logprob is not)."""
        t = time.monotonic()
        if tokens > 0:
            w_in, w_out = self.rt.weights(d.claimed.cls)
            self._work += tokens * w_out + (d.usage_in * w_in if d.first_t is None else 0.0)
            d.note_tokens(tokens, t)
            self._gen_tokens += tokens
            self.rt.metrics.generated_tokens.inc(tokens)
        ids = [THOUGHT_ID] * _thought_tokens(tokens, reasoning, text) + list(text.encode())
        if tool_calls:
            ids.append(TOOL_CALL_ID)
        reasoning = reasoning if forward_thought else ""
        d.add(ids, text, t, tokens=tokens, reasoning=reasoning, reasoning_field=reasoning_field,
              tool_calls=tool_calls, logprobs=logprobs)

    def stats(self) -> dict[str, Any]:
        """Heartbeat figures; ``capacity_tokens_s`` is weighted tokens per second of time
        with the upstream saturated (0 = it was not: no measurement), for the controller's
        estimator."""
        now = time.monotonic()
        tokens_s = self._gen_tokens / max(now - self._last_stats_t, 1e-9)
        busy, work = self._busy_s, self._busy_work
        if self._busy_since is not None:
            busy, work = busy + now - self._busy_since, work + self._work - self._work_at_busy
        capacity = work / busy if busy > 0 else 0.0
        self._gen_tokens, self._work, self._last_stats_t = 0, 0.0, now
        self._busy_s, self._busy_work = 0.0, 0.0
        if self._busy_since is not None:
            self._busy_since, self._work_at_busy = now, 0.0
        return {"batch_size": len(self.tasks), "running": len(self.tasks), "waiting": 0,
                "tokens_s": round(tokens_s, 1), "capacity_tokens_s": round(capacity, 1), "step_ms": 0,
                "kv_used": 0, "kv_capacity": 0, "kv_use": 0, "max_inflight": self.rt.settings.max_inflight,
                "upstream": self.shown, "upstream_state": self.breaker.state,
                "upstream_failures": self.breaker.failures, "upstream_probes": self.breaker.probes}
