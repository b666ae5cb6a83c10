"""The interface every engine implements, and the bookkeeping they share.

The batching policy (:mod:`worker.batch_policy`) is the same for every engine; an engine only
executes a :class:`~worker.batch_policy.StepPlan`. Two engines exist: ``torch`` runs the real
model of :mod:`worker.model`, ``sim`` sleeps for a GPU cost model and emits placeholder
text (and says so: ``simulated = True``), so the whole system can run without a GPU.

:class:`SequenceTable` holds what both engines must track per sequence (tokens so far,
how many are in the KV cache) and rejects a plan that does not match that state, so a
scheduler bug surfaces as a clear error instead of silently wrong text.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Protocol

from limiter.errors import InvalidArgument
from worker.batch_policy import StepPlan
from worker.tokenizer import IncrementalDecoder

__all__ = ["Engine", "IncrementalDecoder", "SamplingParams", "SeqEntry", "SequenceTable", "request_seed"]

MAX_SEED = 2**63 - 1


def request_seed(seed: int | None, request_id: str) -> int:
    """``seed`` if the client gave one, else one derived from the request id (63 bits of
    its SHA-256). Sampling is keyed on (seed, position), so a request resumed on another
    worker - which derives the same seed - produces exactly the tokens it would have."""
    if seed is not None:
        return int(seed)
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature`` 0 is greedy. ``seed`` makes sampling reproducible: the randomness for
    the token at absolute sequence position ``p`` is derived from ``(seed, p)`` only, so a
    sequence resumed from prompt + generated tokens continues exactly as it would have.
    ``seed=None`` draws a fresh seed when the sequence is added (not reproducible across
    a resume). ``stop`` strings are carried for the worker, which checks them on text.
    """

    temperature: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    # vLLM's ignore_eos / min_tokens, as an absolute sequence length: the end-of-sequence token
    # is never sampled at a position below ``eos_min_len`` (prompt length + min_tokens; -1 =
    # never, ignore_eos). Absolute, so a sequence paused or resumed with its generated tokens
    # re-prefilled as part of its prompt keeps the same rule.
    eos_min_len: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidArgument("temperature", f"temperature must be a finite number >= 0, got {t!r}")
        s = self.seed
        if s is not None and (not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= MAX_SEED):
            raise InvalidArgument("seed", f"seed must be an int in 0..2**63-1 or null, got {s!r}")
        m = self.max_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise InvalidArgument("max_tokens", f"max_tokens must be an int >= 1, got {m!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(x, str) and x for x in self.stop):
            raise InvalidArgument("stop", "stop must be a tuple of non-empty strings")
        e = self.eos_min_len
        if not isinstance(e, int) or isinstance(e, bool) or e < -1:
            raise InvalidArgument("eos_min_len", f"eos_min_len must be an int >= -1, got {e!r}")

    def eos_allowed(self, position: int) -> bool:
        """May the token at absolute sequence ``position`` be the end-of-sequence token?"""
        return self.eos_min_len != -1 and position >= self.eos_min_len

    @staticmethod
    def eos_rule(prompt_len: int, ignore_eos: bool, min_tokens: int) -> int:
        """``eos_min_len`` for a request: -1 with ignore_eos, else prompt + min_tokens."""
        return -1 if ignore_eos else (prompt_len + min_tokens if min_tokens > 0 else 0)


class Engine(Protocol):
    """What the worker loop needs from an engine."""

    name: str
    simulated: bool
    kv_capacity_tokens: int
    eos_id: int | None
    # Engines may also expose ``max_seq_len`` (the longest prompt + output a sequence can
    # reach); the scheduler finishes a sequence there with reason "length".

    def encode(self, text: str) -> list[int]:
        """Prompt text -> the ids this engine's model expects (BOS included)."""
        ...

    def new_decoder(self) -> IncrementalDecoder:
        """A fresh streaming decoder: ids -> valid text pieces."""
        ...

    def add(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Allocate a sequence. ``prompt_ids`` may end with tokens generated before a pause;
        ``params.max_tokens`` counts the tokens still to generate after them (an engine may
        size the sequence's KV for ``prompt_ids`` + ``max_tokens``)."""
        ...

    def remove(self, seq_id: str) -> None:
        """Free a sequence's KV cache (finished, cancelled or preempted)."""
        ...

    async def step(self, plan: StepPlan) -> dict[str, int]:
        """Run ``plan``; return the next token of every sequence that produced one.

        Decoders each produce one; a prefill chunk that completes its prompt produces the
        first token after it. The produced tokens are appended to the engine's own state.
        """
        ...


@dataclass
class SeqEntry:
    """One sequence inside an engine: all its tokens and how many are in the KV cache."""

    ids: list[int]
    prompt_len: int
    params: SamplingParams
    seed: int
    kv_len: int = 0

    @property
    def decoding(self) -> bool:
        return self.kv_len >= self.prompt_len


class SequenceTable:
    """Per-sequence state shared by engines, with plan validation."""

    def __init__(self, *, vocab_size: int, max_seq_len: int, kv_capacity_tokens: int) -> None:
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.kv_capacity_tokens = kv_capacity_tokens
        self.seqs: dict[str, SeqEntry] = {}

    def add(self, seq_id: str, prompt_ids: list[int], params: SamplingParams, seed: int) -> SeqEntry:
        if not isinstance(seq_id, str) or not seq_id:
            raise InvalidArgument("seq_id", "seq_id must be a non-empty string")
        if seq_id in self.seqs:
            raise InvalidArgument("seq_id", f"sequence {seq_id!r} is already allocated")
        if not isinstance(params, SamplingParams):
            raise InvalidArgument("params", "params must be SamplingParams")
        ids = list(prompt_ids)
        if not ids:
            raise InvalidArgument("prompt_ids", "prompt_ids must not be empty")
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size:
                raise InvalidArgument("prompt_ids", f"token id {i!r} is outside 0..{self.vocab_size - 1}")
        if len(ids) + 1 > self.max_seq_len:
            raise InvalidArgument(
                "prompt_ids", f"prompt of {len(ids)} tokens leaves no room in max_seq_len {self.max_seq_len}"
            )
        if len(ids) + 1 > self.kv_capacity_tokens:
            raise InvalidArgument(
                "prompt_ids", f"prompt of {len(ids)} tokens exceeds KV capacity {self.kv_capacity_tokens}"
            )
        entry = SeqEntry(ids=ids, prompt_len=len(ids), params=params, seed=seed)
        self.seqs[seq_id] = entry
        return entry

    def remove(self, seq_id: str) -> SeqEntry:
        try:
            return self.seqs.pop(seq_id)
        except KeyError:
            raise InvalidArgument("seq_id", f"unknown sequence {seq_id!r}") from None

    def validate(self, plan: StepPlan) -> tuple[list[SeqEntry], list[SeqEntry]]:
        """Reject a plan that does not match the sequences' state (before any compute).
        Returns the entries of its decoders and of its chunks, in the plan's order: a step
        looks each sequence up once (the engine's lookups were a tenth of a null-engine
        step's CPU at 128 sequences)."""
        seqs, most = self.seqs, self.max_seq_len
        decoders: list[SeqEntry] = []
        for sid in plan.decode:
            e = seqs.get(sid)
            if e is None:
                raise InvalidArgument("plan", f"plan names unknown sequence {sid!r}")
            if not e.decoding:
                raise InvalidArgument("plan", f"{sid!r} cannot decode (still prefilling)")
            if len(e.ids) > most:  # the decode writes position len(ids) - 1
                raise InvalidArgument("plan", f"{sid!r} reached max_seq_len {most}")
            decoders.append(e)
        chunks: list[SeqEntry] = []
        new_tokens = len(decoders)
        for c in plan.prefill:
            e = seqs.get(c.request_id)
            if e is None:
                raise InvalidArgument("plan", f"plan names unknown sequence {c.request_id!r}")
            if c.start != e.kv_len or c.length < 1:
                raise InvalidArgument(
                    "plan", f"chunk {c} does not continue {c.request_id!r} at KV length {e.kv_len}"
                )
            if c.start + c.length > e.prompt_len:
                raise InvalidArgument("plan", f"chunk {c} runs past the prompt ({e.prompt_len} tokens)")
            chunks.append(e)
            new_tokens += c.length
        named = len(decoders) + len(chunks)
        if len({*plan.decode, *(c.request_id for c in plan.prefill)}) != named:
            raise InvalidArgument("plan", "plan names a sequence twice")
        used = sum(e.kv_len for e in self.seqs.values())
        if used + new_tokens > self.kv_capacity_tokens:
            raise InvalidArgument(
                "plan", f"plan needs {used + new_tokens} KV tokens, capacity is {self.kv_capacity_tokens}"
            )
        return decoders, chunks
