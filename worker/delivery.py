"""One claimed request as the Redis side of the worker sees it: streaming back and timing.

A :class:`Delivery` buffers the tokens released for a request and pushes them with
``push_tokens`` in batches: per request, when ``flush_tokens`` (16) are pending or before
the oldest would wait more than ``flush_ms`` (50 ms), whichever comes first, and the first
batch of an attempt at once (time to first token is what users feel). A request whose
client does not stream is pushed only every ``unstreamed_flush_ms`` (1 s) after its first
batch (``WorkerRuntime.push_due`` decides; from a request's second push on, the step loop
also pushes it at its period's push steps, shared by every request: worker/push_clock.py).
So Redis sees far fewer than one write per generated token, while no streamed token waits
more than ~50 ms (with steps longer than that, every step pushes). The step loop sends the batches of every
request due at a step in one ``push_tokens`` call (:meth:`Delivery.batch`,
:meth:`Delivery.settle`). The last tokens ride on ``complete``. Offsets make delivery
exactly-once: ``push_tokens`` refuses a batch whose offset is not the number of tokens
already delivered.

It also keeps the timings a latency sample needs (see :mod:`worker.samples`): when this
attempt claimed the request, in Redis time and in local monotonic time, and when each
token came out of the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from limiter.errors import InvalidArgument, LeaseLost
from limiter.keys import PoolKeys
from limiter.prompt import Payload
from limiter.redis_conn import map_redis_errors
from limiter.reply_text import NUL, pack
from limiter.scripts import Claimed, Pushed, Scripts, TokenBatch

# The arguments of push_tokens and complete that are the batch's tokens: Redis refusing one
# of them (past the request's max_tokens, a batch it cannot take) refuses that request's
# tokens, not the worker's; any other refused argument is the worker's own bug.
TOKEN_FIELDS = frozenset({"count", "token_ids", "text", "n_ids"})
# Pending text that is pushed whatever the period: a batch's text may be at most 16 MiB
# (lua/include/tokens.lua), and an unstreamed answer with 20 logprobs a token holds ~1 KB a
# token, pushed once a second. Far within the bound in bytes (a character is at most 4), so
# one chunk's text on top of it fits: an echo's, with its prompt's logprobs, may be MiBs.
PUSH_TEXT_CHARS = 1 << 20


@dataclass
class Delivery:
    claimed: Claimed
    payload: Payload
    claim_now_ms: int  # Redis time of this attempt's claim
    claim_t: float  # time.monotonic() when that claim returned
    # prompt tokens: admission's count (pool tokenizer units); openai: the model server's own
    # once its usage came (the sample's input_tokens; admission's count goes as prompt_tokens)
    usage_in: int
    class_rank: int
    offset: int = 0  # tokens delivered so far (all attempts)
    pending_ids: list[int] = field(default_factory=list)  # resume ids of the pending tokens
    pending_text: str = ""
    pending_tokens: int = 0  # model tokens pending (= len(pending_ids) for the step engines)
    pending_since: float | None = None
    pushes: int = 0
    first_t: float | None = None  # this attempt's first token (monotonic)
    last_t: float | None = None
    produced: int = 0  # tokens this attempt produced
    max_gap_s: float = 0.0
    final: tuple[str, str, str] | None = None  # (outcome, finish_reason, message) once finishing
    # its completion was refused for an argument not its tokens: failed plainly, no sample
    # (WorkerRuntime._fail_unfinishable)
    plain_failure: bool = False
    sample_extra: dict[str, Any] = field(default_factory=dict)  # engine-specific sample fields
    # openai engine: this attempt's request was given a connection to the model server (set
    # before a byte of it is written): from then on the server may have prefilled its prompt
    upstream_sent: bool = False
    # pushes whose reply was lost: token count -> (ids, text chars) (see _reconcile)
    _uncertain: dict[int, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.offset = self.claimed.delivered

    @property
    def request_id(self) -> str:
        return self.claimed.request_id

    @property
    def fence(self) -> int:
        """The lease token of this attempt: every write for the request carries it."""
        return self.claimed.fence

    @property
    def total_tokens(self) -> int:
        """Tokens generated for the request so far (delivered + pending)."""
        return self.offset + self.pending_tokens

    def redis_ms(self, t: float | None = None) -> float:
        """Redis time (ms) estimated for monotonic time ``t`` from this attempt's claim."""
        return self.claim_now_ms + ((time.monotonic() if t is None else t) - self.claim_t) * 1e3

    # --- intake ----------------------------------------------------------------------------
    def note_tokens(self, n: int, t: float) -> None:
        """``n`` tokens came out of the engine at monotonic time ``t`` (for TTFT and TPOT)."""
        if n <= 0:
            return
        if self.first_t is None:
            self.first_t = t
        elif self.last_t is not None:
            self.max_gap_s = max(self.max_gap_s, t - self.last_t)
        self.last_t = t
        self.produced += n

    def add(self, token_ids: list[int] | tuple[int, ...], text: str, t: float,
            tokens: int | None = None, reasoning: str = "", reasoning_field: str = "reasoning",
            tool_calls: list[dict[str, Any]] | None = None, logprobs: list[Any] | None = None) -> None:
        """Queue released tokens and their text for the next push. ``tokens`` is how many
        model tokens they are (default one per id); the openai engine counts the upstream's
        tokens and passes the text's bytes as ``token_ids`` (what a resuming worker needs),
        and the reasoning a model server sent apart from the text (``reasoning``, under the
        field name it used), its tool-call deltas and its tokens' logprobs, which the push
        carries marked in the text (limiter/reply_text)."""
        n = len(token_ids) if tokens is None else tokens
        if reasoning or tool_calls or logprobs or NUL in text:
            text = pack(text, reasoning, reasoning_field, tool_calls, logprobs,
                        aside=self.payload.aside_logprobs)
        if (n or token_ids or text) and self.pending_since is None:
            self.pending_since = t
        self.pending_ids.extend(token_ids)
        self.pending_text += text
        self.pending_tokens += n

    def due(self, t: float, flush_ms: float, flush_tokens: int | None, step_s: float = 0.0) -> bool:
        """Push now? At once for an attempt's first batch, at ``flush_tokens`` pending (None:
        no such bound), or when the oldest pending token would be older than ``flush_ms`` by
        the next chance to push (``step_s`` from now), so no token waits longer than
        ``flush_ms``."""
        if not self.pending_tokens:
            return False  # text alone (no token) waits for the next token or complete
        if self.pushes == 0 or (flush_tokens is not None and self.pending_tokens >= flush_tokens):
            return True
        if len(self.pending_text) >= PUSH_TEXT_CHARS:
            return True
        return self.pending_since is not None and (t - self.pending_since + step_s) * 1e3 >= flush_ms

    # --- Redis --------------------------------------------------------------------------------
    def batch(self) -> TokenBatch | None:
        """What to push now, for ``push_tokens`` (one call may carry several requests'), or
        None: nothing pending, or an earlier push is in doubt and this one could not tell the
        two apart. Hand the reply to :meth:`settle`."""
        if not self.pending_tokens:
            return None
        ids, text, n = list(self.pending_ids), self.pending_text, self.pending_tokens
        if self._uncertain.get(n, (len(ids), len(text))) != (len(ids), len(text)):
            # A push of as many tokens but more text (an upstream chunk with text and no new
            # token) is in doubt already: Redis's token count could not tell which of the two
            # landed. Wait for a token (or complete, offset-checked).
            return None
        # Until its reply comes, this push may or may not have landed (an outage, a lost reply).
        self._uncertain[n] = (len(ids), len(text))
        return TokenBatch(self.request_id, self.fence, self.offset, ids, text, n)

    def settle(self, b: TokenBatch, reply: Pushed) -> None:
        """Apply ``push_tokens``' reply to batch ``b``. Raises LeaseLost, and InvalidArgument
        'count' when Redis refused the batch as past the request's max_tokens (nothing
        written: see :meth:`discard_pending`). On 'offset' (an earlier push whose reply was
        lost did land), the tokens Redis has are taken as delivered and the rest stay pending
        for the next push."""
        if reply.status == "lost":
            raise LeaseLost(f"{self.request_id}: request is not leased to this worker with this fence")
        if reply.status == "max_tokens":
            raise InvalidArgument("count", f"{self.request_id}: {b.offset + b.count} tokens exceed "
                                           f"max_tokens {reply.max_tokens}")
        if reply.status == "offset":
            self._landed(reply.delivered)
            return
        self._sent(b.count, len(b.token_ids), len(b.text))

    async def push(self, scripts: Scripts, keys: PoolKeys, worker_id: str, lease_ms: int = 0) -> None:
        """Push what is pending, alone.

        Raises LeaseLost (another worker owns the request) and RedisUnavailable. Nothing is
        lost on an outage: the batch stays pending, and if it did land (the reply was lost,
        or redis-py's retry sent it twice) the next push's offset check says so."""
        b = self.batch()
        if b is None:
            return
        try:
            await scripts.push_tokens(keys, request_id=self.request_id, worker_id=worker_id, fence=self.fence,
                                      offset=b.offset, token_ids=b.token_ids, text=b.text, lease_ms=lease_ms,
                                      count=b.count, grouped=self.payload.grouped_tokens)
        except InvalidArgument as exc:
            if exc.field != "offset":  # not the message: a request id may contain "offset"
                raise
            await self._reconcile(scripts.client, keys)
            await self.push(scripts, keys, worker_id, lease_ms)
            return
        self._sent(b.count, len(b.token_ids), len(b.text))

    async def complete(self, scripts: Scripts, keys: PoolKeys, worker_id: str, *, outcome: str,
                       finish_reason: str, message: str = "", sample: bytes = b"") -> float:
        """Finish the request with whatever is pending. Raises LeaseLost.

        Offset-checked like a push: when an earlier push's reply was lost but the push landed,
        its tokens were pending still, and complete delivered them a second time (or, past
        max_tokens, was refused and took the worker down)."""
        try:
            return await scripts.complete(keys, request_id=self.request_id, worker_id=worker_id,
                                          fence=self.fence, outcome=outcome, usage_in=self.usage_in,
                                          token_ids=self.pending_ids, text=self.pending_text,
                                          finish_reason=finish_reason, message=message[:4000], sample=sample,
                                          count=self.pending_tokens, offset=self.offset)
        except InvalidArgument as exc:
            if exc.field != "offset":  # not the message: a request id may contain "offset"
                raise
            await self._reconcile(scripts.client, keys)
            return await self.complete(scripts, keys, worker_id, outcome=outcome, finish_reason=finish_reason,
                                       message=message, sample=sample)

    def discard_pending(self) -> None:
        """Forget the tokens not delivered: Redis refused them and the request is failed with
        what was delivered. No earlier push is in doubt any more: a refusal past max_tokens
        comes after the offset check (push_tokens and complete check the offset first), so
        Redis had exactly our offset, and a push whose reply was lost is never sent again (the
        clients do not retry). (A batch refused for its arguments was not offset-checked:
        should a push in doubt have landed, the failure's own offset check finds it, and the
        request, taken for lost, is resumed elsewhere after its lease.)"""
        self.pending_ids.clear()
        self.pending_text = ""
        self.pending_tokens = 0
        self.pending_since = None
        self._uncertain.clear()

    def _sent(self, n_tokens: int, n_ids: int, n_chars: int) -> None:
        self.offset += n_tokens
        self.pending_tokens -= n_tokens
        del self.pending_ids[:n_ids]
        self.pending_text = self.pending_text[n_chars:]
        self.pending_since = time.monotonic() if self.pending_tokens or self.pending_ids else None
        self.pushes += 1
        self._uncertain.clear()

    async def _reconcile(self, client: Any, keys: PoolKeys) -> None:
        """After an offset mismatch: read Redis's token count (see :meth:`_landed`). An
        outage here is one (RedisUnavailable), as in the scripts' own calls."""
        with map_redis_errors():
            out = await client.hget(keys.request(self.request_id), "out_tokens")
        self._landed(int(out) if out is not None else -1)

    def _landed(self, delivered: int) -> None:
        """Redis has ``delivered`` tokens, not our offset: one of our earlier pushes whose reply
        never came back did land, and its tokens count as sent. Anything else means we lost
        the request."""
        landed = delivered - self.offset
        if landed not in self._uncertain:
            raise LeaseLost(f"{self.request_id}: Redis has {delivered} tokens, this worker {self.offset}")
        self._sent(landed, *self._uncertain[landed])
