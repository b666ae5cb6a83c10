"""The ``sim`` engine: no model, a GPU *cost model* and placeholder text.

It exists so the whole system (frontends, Redis, scheduling, the control loop) can run and
be benchmarked on a machine without a GPU, with step times shaped like a real one. Its
output is labelled: ``simulated = True``, and the text is a fixed placeholder phrase.

Cost model, one step (seconds, before ``time_scale``)::

    t = c0 + c_prefill * prefill_tokens + c_decode * decode_seqs + c_kv * context_tokens

* ``prefill_tokens``: prompt tokens processed this step (sum of chunk lengths);
* ``decode_seqs``: sequences decoding one token this step;
* ``context_tokens``: KV tokens attended to: ``kv_len + 1`` per decoder and
  ``start + length`` per prefill chunk (a chunk attends to everything before it).

Defaults (roughly a 7B-class model on one modern GPU, the original design's figures):
``c0 = 10 ms`` (launches, weight reads), ``c_prefill = 60 us/token``, ``c_decode = 1 ms/seq``,
``c_kv = 0.2 us/token``. Then a 32K-token prompt prefilled in one step costs
10 ms + 1.966 s + 6.6 ms ~= 1.98 s (the original "~2 s"), and a decode step of a modest batch,
8 sequences at 4K context, costs 10 + 8 + 6.6 ~= 25 ms (the original "~25 ms TPOT"). Chunking
that 32K prompt into 64 slices of 512 adds 64 * c0 plus re-read context, ~2.85 s in all: the
throughput price paid for bounded decode latency. Attention is charged linearly in context,
not quadratically; at these sizes the linear terms dominate anyway.

Placeholder tokens depend only on the absolute position in the sequence, so they are
deterministic, valid printable ASCII, and a resumed sequence continues identically.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from limiter.errors import InvalidArgument
from worker.batch_policy import StepPlan
from worker.engines.base import SamplingParams, SeqEntry, SequenceTable
from worker.tokenizer import EOS_ID, VOCAB_SIZE, IncrementalDecoder, encode

PLACEHOLDER = b"simulated output "


@dataclass(frozen=True)
class CostModel:
    """Seconds one step would take on the modelled GPU (see the module docstring)."""

    c0: float = 0.010
    c_prefill: float = 60e-6
    c_decode: float = 1e-3
    c_kv: float = 0.2e-6

    def __post_init__(self) -> None:
        for name in ("c0", "c_prefill", "c_decode", "c_kv"):
            if not getattr(self, name) >= 0:
                raise InvalidArgument(name, f"cost coefficient {name} must be >= 0")

    def cost(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return (
            self.c0
            + self.c_prefill * prefill_tokens
            + self.c_decode * decode_seqs
            + self.c_kv * context_tokens
        )


class SimEngine:
    """Engine that sleeps for :class:`CostModel` time and emits placeholder bytes."""

    name = "sim"
    simulated = True
    eos_id: int | None = EOS_ID

    def __init__(
        self,
        *,
        cost: CostModel | None = None,
        time_scale: float = 1.0,
        kv_capacity_tokens: int = 1 << 20,
        max_seq_len: int = 131072,
    ) -> None:
        if not time_scale >= 0:
            raise InvalidArgument("time_scale", "time_scale must be >= 0")
        if not isinstance(kv_capacity_tokens, int) or kv_capacity_tokens < 1:
            raise InvalidArgument("kv_capacity_tokens", "kv_capacity_tokens must be a positive int")
        self.cost = cost or CostModel()
        self.time_scale = float(time_scale)
        self.kv_capacity_tokens = kv_capacity_tokens
        self._table = SequenceTable(
            vocab_size=VOCAB_SIZE, max_seq_len=max_seq_len, kv_capacity_tokens=kv_capacity_tokens
        )
        self.last_step_cost_s = 0.0
        self._busy = False

    @property
    def max_seq_len(self) -> int:
        """Longest sequence (prompt + generated) one request may reach."""
        return self._table.max_seq_len

    def encode(self, text: str) -> list[int]:
        return encode(text, bos=True)

    def new_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder()

    def add(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self._table.add(seq_id, prompt_ids, params, seed=params.seed or 0)

    def remove(self, seq_id: str) -> None:
        self._table.remove(seq_id)

    def plan_cost(self, plan: StepPlan) -> float:
        """Modelled seconds for ``plan`` given current sequence state (before ``time_scale``)."""
        decoders, _ = self._table.validate(plan)
        return self._cost(plan, decoders)

    def _cost(self, plan: StepPlan, decoders: list[SeqEntry]) -> float:
        context = sum(e.kv_len + 1 for e in decoders) + sum(c.start + c.length for c in plan.prefill)
        return self.cost.cost(plan.prefill_tokens, len(decoders), context)

    async def step(self, plan: StepPlan) -> dict[str, int]:
        if self._busy:
            raise RuntimeError("SimEngine.step called while another step is running")
        entries, chunk_entries = self._table.validate(plan)
        seconds = self._cost(plan, entries)
        self.last_step_cost_s = seconds
        self._busy = True
        try:
            await self._elapse(seconds)
        finally:
            self._busy = False
        out: dict[str, int] = {}
        seqs = self._table.seqs
        for sid, e in zip(plan.decode, entries, strict=True):
            if seqs.get(sid) is e:  # skip sequences removed during the step
                e.kv_len += 1
                out[sid] = self._emit(e)
        for c, e in zip(plan.prefill, chunk_entries, strict=True):
            if seqs.get(c.request_id) is e:
                e.kv_len += c.length
                if e.kv_len == e.prompt_len:
                    out[c.request_id] = self._emit(e)
        return out

    async def _elapse(self, seconds: float) -> None:
        """The step's modelled time passing (scaled): where a step is in the engine."""
        await asyncio.sleep(seconds * self.time_scale)

    @staticmethod
    def _emit(e: SeqEntry) -> int:
        token = PLACEHOLDER[len(e.ids) % len(PLACEHOLDER)]
        e.ids.append(token)
        return token
