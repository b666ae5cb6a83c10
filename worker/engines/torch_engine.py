"""The ``torch`` engine: runs :mod:`worker.model` for real, one plan per step.

Device and dtype: the caller names the device (``"cpu"``, ``"cuda"``, ``"cuda:0"``); the
dtype defaults to bf16 on CUDA (half the memory and bandwidth of fp32, and the range
activations need) and fp32 on CPU (CPU bf16 matmuls are slow and the tests compare
logits at fp32 tolerance).

The forward passes run in a worker thread (:func:`asyncio.to_thread`): a step takes from
milliseconds to seconds, and the worker's asyncio loop must keep renewing leases and
streaming tokens meanwhile. Torch releases the GIL inside its kernels, so this works.
Sequence state is only mutated back on the loop thread, after the step, so a
``remove()`` that races a step simply drops that sequence's result.

Sampling: greedy for ``temperature == 0``; otherwise Gumbel-max sampling (exactly a draw
from softmax(logits / T)) with noise from a CPU ``torch.Generator`` seeded by
:func:`derive_seed` ``(seed, position)``. Keying the randomness on the absolute position of
the token, not on a per-request generator's running state, is what makes a preempted or
re-leased sequence - re-added with prompt + generated tokens - continue with the tokens it
would have produced: the same noise at the same position. The logits themselves are not
bit-exact: a re-prefill of the generated tokens (many rows in one matmul) and their decode
(one row a step) round differently, by ~1e-7 in fp32 (more in bf16), so a near-tie of the two
best logits may resolve the other way (in fp32, 2 of 200,000 positions in a review's test;
exact would need matmul kernels whose result does not depend on the row count).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import threading
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from limiter.errors import ConfigError, InvalidArgument
from worker.batch_policy import PrefillChunk, StepPlan
from worker.engines.base import SamplingParams, SeqEntry, SequenceTable
from worker.model import KVCache, ModelConfig, Transformer, build_model, preset
from worker.tokenizer import EOS_ID, VOCAB_SIZE, IncrementalDecoder, encode

CONFIG_METADATA_KEY = "qos_model_config"
_MASK64 = (1 << 64) - 1


def derive_seed(seed: int, position: int) -> int:
    """A well-mixed 63-bit generator seed for token ``position`` of a request (SplitMix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    for mul, shift in ((0xBF58476D1CE4E5B9, 30), (0x94D049BB133111EB, 27)):
        z = ((z ^ (z >> shift)) * mul) & _MASK64
    return (z ^ (z >> 31)) >> 1


def sample_token(logits: torch.Tensor, temperature: float, seed: int, position: int,
                 banned: int | None = None) -> int:
    """Pick the token at ``position`` from 1-D ``logits`` (greedy when ``temperature`` is 0).
    ``banned`` (the EOS id under ignore_eos / min_tokens) is never picked."""
    logits = logits.detach().to("cpu", torch.float64)
    if banned is not None:
        logits = logits.clone()
        logits[banned] = -math.inf
    if temperature == 0:
        return int(torch.argmax(logits))
    gen = torch.Generator(device="cpu")
    gen.manual_seed(derive_seed(seed, position))
    u = torch.rand(logits.shape, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
    gumbel = -torch.log(-torch.log(u))
    # argmax(logits / T + g) is argmax(logits + T g) for T > 0. Neither form is safe at every
    # T: a subnormal T made logits / T infinite, a huge one (above ~5e306) made T g infinite,
    # and argmax picked the first infinite entry either way. Scaling by min(T, 1/T) <= 1
    # never overflows.
    if temperature < 1:
        return int(torch.argmax(logits + temperature * gumbel))
    return int(torch.argmax(logits / temperature + gumbel))


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def default_kv_capacity(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> int:
    """KV tokens to allow: 45 % of free GPU memory, or 2 GiB worth (at most 64K tokens) on
    CPU. A sequence's cache grows by doubling up to its prompt + max_tokens, so the caches
    stay within the KV the held requests reserve; room is left for a look-ahead request
    that starts past its reservation, whose cache may double up to 2x its KV used."""
    per_token = cfg.kv_bytes_per_token(dtype)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return max(1, int(free * 0.45) // per_token)
    return max(1, min(65536, (2 << 30) // per_token))


def save_checkpoint(model: Transformer, path: str | os.PathLike[str]) -> None:
    """Write ``model``'s weights and config to a safetensors file :func:`load_checkpoint` reads."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt", CONFIG_METADATA_KEY: json.dumps(asdict(model.cfg))})


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    config: ModelConfig | None = None,
) -> Transformer:
    """Load a local safetensors state dict of :class:`~worker.model.Transformer`.

    The config comes from ``config`` or else from the file's metadata (written by
    :func:`save_checkpoint`). Missing, extra or mis-shaped tensors are a :class:`ConfigError`
    naming the file, so a checkpoint of another architecture fails loudly at startup.
    """
    dev = torch.device(device)
    dtype = dtype or default_dtype(dev)
    where = str(path)
    try:
        found = Path(path).is_file()
    except OSError:  # a name too long (ENAMETOOLONG) was a traceback at the worker's start
        found = False
    if not found:
        raise ConfigError(where[:200], "checkpoint file not found")
    try:
        with safe_open(where, framework="pt") as f:
            metadata = f.metadata() or {}
        state = load_file(where, device=str(dev))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(where, f"not a readable safetensors file: {exc}") from exc
    if config is None:
        raw = metadata.get(CONFIG_METADATA_KEY)
        if raw is None:
            raise ConfigError(where, f"no {CONFIG_METADATA_KEY!r} metadata; pass the model config explicitly")
        try:
            config = ModelConfig(**json.loads(raw))
        except (TypeError, ValueError) as exc:
            raise ConfigError(where, f"bad {CONFIG_METADATA_KEY!r} metadata: {exc}") from exc
    with torch.device("meta"):
        model = Transformer(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if expected != got:
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        shapes = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])[:3]
        raise ConfigError(
            where, f"tensors do not match the config: missing {missing}, unexpected {extra}, shape {shapes}"
        )
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    return model.eval()


async def _wait_out(work: asyncio.Future[object]) -> None:
    """Wait until ``work`` (a thread's future) is done, whatever cancels the caller meanwhile
    (the caller re-raises what stopped it); its outcome is retrieved and dropped."""
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            continue
        except BaseException:  # the thread's own error: done, and the caller raises
            break
    if not work.cancelled():
        work.exception()


class TorchEngine:
    """Engine over a :class:`~worker.model.Transformer` (see the module docstring)."""

    name = "torch"
    simulated = False
    eos_id: int | None = EOS_ID

    def __init__(self, model: Transformer, *, kv_capacity_tokens: int | None = None) -> None:
        if model.cfg.vocab_size != VOCAB_SIZE:
            # the byte tokenizer's ids (encode, IncrementalDecoder): a larger vocabulary samples
            # ids no decoder takes, a smaller one refuses every prompt's BOS
            raise InvalidArgument("vocab_size", f"the torch engine serves the byte vocabulary of "
                                  f"{VOCAB_SIZE} ids; the model has vocab_size {model.cfg.vocab_size}")
        self.model = model.eval()
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        if kv_capacity_tokens is not None and (
            not isinstance(kv_capacity_tokens, int)
            or isinstance(kv_capacity_tokens, bool)
            or kv_capacity_tokens < 1
        ):
            raise InvalidArgument("kv_capacity_tokens", f"must be a positive int, got {kv_capacity_tokens!r}")
        cap = kv_capacity_tokens or default_kv_capacity(model.cfg, self.device, self.dtype)
        self.kv_capacity_tokens = cap
        self._table = SequenceTable(
            vocab_size=model.cfg.vocab_size, max_seq_len=model.cfg.max_seq_len, kv_capacity_tokens=cap
        )
        self._caches: dict[str, KVCache] = {}
        self._busy = False

    @classmethod
    def from_preset(
        cls,
        name: str = "tiny",
        *,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        kv_capacity_tokens: int | None = None,
    ) -> TorchEngine:
        """A randomly initialised model of preset ``name`` (reproducible from ``seed``)."""
        dev = torch.device(device)
        model = build_model(preset(name), seed=seed, device=dev, dtype=dtype or default_dtype(dev))
        return cls(model, kv_capacity_tokens=kv_capacity_tokens)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        config: ModelConfig | None = None,
        kv_capacity_tokens: int | None = None,
    ) -> TorchEngine:
        model = load_checkpoint(path, device=device, dtype=dtype, config=config)
        if model.cfg.vocab_size != VOCAB_SIZE:
            raise ConfigError(str(path), f"vocab_size {model.cfg.vocab_size} is not the byte "
                              f"vocabulary's {VOCAB_SIZE} ids the torch engine serves")
        return cls(model, kv_capacity_tokens=kv_capacity_tokens)

    @property
    def max_seq_len(self) -> int:
        """Longest sequence (prompt + generated) the model's positions allow."""
        return self.model.cfg.max_seq_len

    def encode(self, text: str) -> list[int]:
        return encode(text, bos=True)

    def new_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder()

    def add(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        entry = self._table.add(seq_id, prompt_ids, params, seed)
        # The most it will hold: its prompt and max_tokens (less the last token, never fed back),
        # what the claim reserves and the scheduler accounts; never more than the KV capacity.
        limit = min(entry.prompt_len + params.max_tokens - 1, self.kv_capacity_tokens)
        try:
            # Room for the prompt and a first stretch of output (within the KV left); the cache
            # doubles beyond that, up to the limit and within the KV left (_kv_room).
            first = entry.prompt_len + max(0, min(64, self._kv_room() - entry.prompt_len))
            self._caches[seq_id] = self.model.new_cache(capacity=first, limit=limit, room=self._kv_room)
        except BaseException:
            # (a CUDA OOM): not in the table either, or the id could never be added again
            self._table.remove(seq_id)
            raise

    def _kv_room(self) -> int:
        """Token slots the caches may still allocate within ``kv_capacity_tokens`` (negative
        once sequences hold more than it). Called from the step's thread as a cache grows:
        list() copies the caches in one step under the GIL, beside an add() or remove()."""
        return self.kv_capacity_tokens - sum(c.capacity for c in list(self._caches.values()))

    def remove(self, seq_id: str) -> None:
        self._table.remove(seq_id)
        del self._caches[seq_id]

    async def step(self, plan: StepPlan) -> dict[str, int]:
        if self._busy:
            raise RuntimeError("TorchEngine.step called while another step is running")
        entries, chunk_entries = self._table.validate(plan)
        caches = self._caches
        decoders = [(sid, e, caches[sid]) for sid, e in zip(plan.decode, entries, strict=True)]
        chunks = [(c, e, caches[c.request_id]) for c, e in zip(plan.prefill, chunk_entries, strict=True)]
        self._busy = True
        stop = threading.Event()
        work = asyncio.ensure_future(asyncio.to_thread(self._compute, decoders, chunks, stop))
        try:
            results = await asyncio.shield(work)
        except BaseException:
            # A thread cannot be stopped: a cancelled step (a drain's deadline, the worker
            # loop's end) waits for its forward passes to end, at most one pass's time: the
            # thread looks at ``stop`` before each (one that had not started yet runs none).
            # Cancelled at once, the thread ran on, writing caches after the roll-back below,
            # beside the next step (the engine no longer busy) or a remove().
            stop.set()
            await _wait_out(work)
            for _, entry, cache in [*decoders, *chunks]:
                cache.length = entry.kv_len  # roll back a half-done step: data past length is ignored
            raise
        finally:
            self._busy = False
        out: dict[str, int] = {}
        for sid, entry, advance, token in results:
            if self._table.seqs.get(sid) is not entry:
                continue  # removed while the step ran
            entry.kv_len += advance
            if token is not None:
                entry.ids.append(token)
                out[sid] = token
        return out

    def _banned(self, e: SeqEntry) -> int | None:
        """The EOS id while ``e`` may not end yet (ignore_eos, min_tokens), else None."""
        if self.eos_id is None or e.params.eos_allowed(len(e.ids)):
            return None
        return self.eos_id

    def _compute(
        self,
        decoders: list[tuple[str, SeqEntry, KVCache]],
        chunks: list[tuple[PrefillChunk, SeqEntry, KVCache]],
        stop: threading.Event | None = None,
    ) -> list[tuple[str, SeqEntry, int, int | None]]:
        """The step's forward passes and sampling (runs in a worker thread). ``stop`` set (the
        step was cancelled): no further pass is started, and what was done is rolled back by
        the caller."""
        results: list[tuple[str, SeqEntry, int, int | None]] = []
        stop = stop or threading.Event()
        with torch.inference_mode():
            if decoders and not stop.is_set():
                ids = torch.tensor([e.ids[e.kv_len] for _, e, _ in decoders], device=self.device)
                logits = self.model.decode(ids, [c for _, _, c in decoders]).cpu()
                for row, (sid, e, _) in enumerate(decoders):
                    token = sample_token(logits[row], e.params.temperature, e.seed, len(e.ids),
                                         self._banned(e))
                    results.append((sid, e, 1, token))
            for chunk, e, cache in chunks:
                if stop.is_set():
                    break
                ids = torch.tensor(e.ids[chunk.start : chunk.start + chunk.length], device=self.device)
                logits = self.model.prefill(ids, cache)
                token: int | None = None
                if chunk.start + chunk.length == e.prompt_len:
                    token = sample_token(logits[-1], e.params.temperature, e.seed, len(e.ids),
                                         self._banned(e))
                results.append((chunk.request_id, e, chunk.length, token))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return results
