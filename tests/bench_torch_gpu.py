"""The torch engine on a GPU, measured: ``python tests/bench_torch_gpu.py --device cuda``.

What the sim engine models and the tests can only show on a CPU, with the 1B preset in the
dtype the worker uses there (bf16 on CUDA). Three parts, each printed:

1. **Step costs.** Prefill steps (``L`` prompt tokens at context offset ``S``) and decode
   steps (``B`` sequences at context ``C``) of the model, timed around a device
   synchronisation, median of ``--reps``; then a least-squares fit of the sim engine's cost
   model ``t = c0 + c_prefill P + c_decode D + c_kv K`` (worker/engines/sim.py) to them,
   printed beside its defaults, with each point's error under the fit.
2. **The long-prefill stall**, with real steps: a short P0 request is streaming when a
   32K-token P2 prompt arrives (``worker.local_run.run_local``, the worker's own scheduler):
   prefill in one step against chunked prefill at two token budgets. The short request's
   median and largest gap between tokens, and the long one's time to first token.
3. **Resumption in the engine's dtype.** A sequence handed back and claimed again is
   re-added with prompt + generated tokens; its continuation should be the tokens it would
   have produced. Sampling noise is keyed on the position, so only the logits' rounding
   (re-prefill rows against one-row decodes) can turn a near-tie: how many of the resumed
   tokens agree, in fp32 and in the device's default dtype.

Not collected by pytest (no ``test_`` prefix); ``tests/gpu/check.sh`` runs it on a GPU
machine, ``tests/test_bench_torch_gpu.py`` runs its quick form on CPU so it cannot rot.
docs/worker.md quotes its output.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from worker.batch_policy import Limits
from worker.engines.base import SamplingParams
from worker.engines.sim import CostModel
from worker.engines.torch_engine import TorchEngine, default_dtype, default_kv_capacity
from worker.local_run import LocalRequest, LocalRun, run_local
from worker.model import Transformer
from worker.tokenizer import BOS_ID


@dataclass(frozen=True)
class StepPoint:
    """One timed step shape: prompt tokens, decoding sequences, context tokens attended."""

    label: str
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    seconds: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, reps: int, fn) -> float:
    fn()  # warm-up: kernels chosen, allocator primed
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _cache_at(model: Transformer, length: int, room: int):
    """A cache that already holds ``length`` tokens (zeros: a step's time does not depend on them)."""
    cache = model.new_cache(capacity=length + room, limit=length + room)
    cache.length = length
    return cache


def measure_steps(
    model: Transformer, prefills: list[tuple[int, int]], decodes: list[tuple[int, ...]], reps: int
) -> list[StepPoint]:
    device = model.embed.weight.device
    vocab = model.cfg.vocab_size
    points = []
    with torch.inference_mode():
        for length, start in prefills:
            ids = torch.randint(0, vocab, (length,), device=device)
            cache = _cache_at(model, start, length)

            def prefill(ids=ids, cache=cache, start=start) -> None:
                cache.length = start
                model.prefill(ids, cache)[-1].cpu()  # the last row is what gets sampled

            try:
                s = _timed(device, reps, prefill)
            except torch.OutOfMemoryError:
                print(f"  prefill {length} at {start}: out of device memory (left out of the fit)")
                continue
            points.append(StepPoint(f"prefill {length:>6} at {start:>6}", length, 0, start + length, s))
            del cache
        for contexts in decodes:  # one context per sequence of the batch
            seqs = len(contexts)
            caches = [_cache_at(model, context, 1) for context in contexts]
            ids = torch.randint(0, vocab, (seqs,), device=device)

            def decode(ids=ids, caches=caches, contexts=contexts) -> None:
                for c, context in zip(caches, contexts, strict=True):
                    c.length = context
                model.decode(ids, caches).cpu()

            shape = (f"{seqs:>3} seqs at {contexts[0]:>6}" if len(set(contexts)) == 1
                     else f"{seqs:>3} seqs, 1 at {max(contexts)}")
            try:
                s = _timed(device, reps, decode)
            except torch.OutOfMemoryError:
                print(f"  decode {shape}: out of device memory (left out of the fit)")
                continue
            points.append(StepPoint(f"decode {shape}", 0, seqs, sum(c + 1 for c in contexts), s))
            del caches
    return points


def attention_at_offset(
    cfg, device: torch.device, dtype: torch.dtype, chunk: int, context: int, reps: int
) -> str:
    """One layer's attention for a ``chunk`` of queries at the end of ``context`` keys (a
    chunked prefill's late slice): the boolean mask the model passes (worker/model.py) against
    ``causal_lower_right``, the same mask as a bias CUDA's flash kernel may take without a
    mask tensor. Which one a GPU worker should use is this line's to say."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    q = torch.randn(1, cfg.n_head, chunk, cfg.head_dim, device=device, dtype=dtype)
    k = torch.randn(1, cfg.kv_heads, context, cfg.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    gqa = cfg.kv_heads != cfg.n_head
    pos = context - chunk + torch.arange(chunk, device=device)
    boolean = (torch.arange(context, device=device)[None, :] <= pos[:, None])[None, None]
    bias = causal_lower_right(chunk, context)
    with torch.inference_mode():
        a = _timed(
            device, reps, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa)
        )
        b = _timed(
            device, reps, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=boolean, enable_gqa=gqa)
        )
    return (
        f"  one layer's attention, {chunk} queries at {context} keys: causal_lower_right {a * 1e3:.2f} ms,"
        f" boolean mask {b * 1e3:.2f} ms"
    )


def fit_cost_model(points: list[StepPoint]) -> CostModel:
    """Least squares over the points, relative error weighted (a 2 s prefill and a 5 ms decode
    step count alike), coefficients clipped at 0."""
    rows = np.array([[1.0, p.prefill_tokens, p.decode_seqs, p.context_tokens] for p in points])
    t = np.array([p.seconds for p in points])
    coef, *_ = np.linalg.lstsq(rows / t[:, None], np.ones_like(t), rcond=None)
    c0, cp, cd, ck = (max(0.0, float(c)) for c in coef)
    return CostModel(c0=c0, c_prefill=cp, c_decode=cd, c_kv=ck)


def print_steps(points: list[StepPoint], fitted: CostModel) -> None:
    sim = CostModel()
    print(f"  {'step':<28} {'measured':>10} {'fit':>10} {'fit err':>8} {'sim model':>10}")
    for p in points:
        f = fitted.cost(p.prefill_tokens, p.decode_seqs, p.context_tokens)
        m = sim.cost(p.prefill_tokens, p.decode_seqs, p.context_tokens)
        print(
            f"  {p.label:<28} {p.seconds * 1e3:>8.2f}ms {f * 1e3:>8.2f}ms {(f / p.seconds - 1) * 100:>+7.0f}%"
            f" {m * 1e3:>8.2f}ms"
        )
    print(
        f"  fit:       c0 {fitted.c0 * 1e3:.2f} ms, c_prefill {fitted.c_prefill * 1e6:.2f} us/token, "
        f"c_decode {fitted.c_decode * 1e3:.3f} ms/seq, c_kv {fitted.c_kv * 1e6:.4f} us/token"
    )
    print(
        f"  sim model: c0 {sim.c0 * 1e3:.2f} ms, c_prefill {sim.c_prefill * 1e6:.2f} us/token, "
        f"c_decode {sim.c_decode * 1e3:.3f} ms/seq, c_kv {sim.c_kv * 1e6:.4f} us/token (a 7B-class model)"
    )


def stall_scenario(engine: TorchEngine, long_tokens: int, short_tokens: int, budget: int | None) -> LocalRun:
    """A short P0 request streaming; a ``long_tokens`` P2 prompt arrives 50 ms in. ``budget``
    None: whole-prompt prefill (chunked prefill off)."""
    short = LocalRequest(
        "short",
        (BOS_ID, *(65 + i % 26 for i in range(63))),
        SamplingParams(max_tokens=short_tokens, eos_min_len=-1),
        class_rank=0,
    )
    long = LocalRequest(
        "long",
        (BOS_ID, *(32 + (i * 31) % 95 for i in range(long_tokens - 1))),
        SamplingParams(max_tokens=2, eos_min_len=-1),
        class_rank=2,
        arrival_s=0.05,
    )
    limits = Limits(
        token_budget=budget or 512,
        max_seqs=8,
        kv_capacity=engine.kv_capacity_tokens,
        chunked_prefill=budget is not None,
    )
    return asyncio.run(run_local(engine, [short, long], limits))


def print_stall(engine: TorchEngine, long_tokens: int, short_tokens: int, budgets: list[int]) -> None:
    print(f"  {'prefill':<16} {'short gap p50':>14} {'p99':>9} {'max':>9} {'long TTFT':>10} {'steps':>6}")
    for budget in [None, *budgets]:
        run = stall_scenario(engine, long_tokens, short_tokens, budget)
        short, long = run.traces["short"], run.traces["long"]
        gaps = sorted(short.gaps_s)
        p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
        during = [t for t in short.token_times if long.arrival_s < t <= (long.token_times or [0])[0]]
        name = "whole prompt" if budget is None else f"chunks of {budget}"
        print(
            f"  {name:<16} {short.median_gap_s * 1e3:>12.1f}ms {p99 * 1e3:>7.1f}ms"
            f" {short.max_gap_s * 1e3:>7.1f}ms {long.ttft_s:>9.3f}s {len(run.steps):>6}"
            f"   ({len(during)} short tokens during the long prefill)"
        )


def generate(engine: TorchEngine, prompt: tuple[int, ...], params: SamplingParams) -> list[int]:
    run = asyncio.run(
        run_local(engine, [LocalRequest("r", prompt, params)], Limits(token_budget=512, max_seqs=4))
    )
    return run.traces["r"].tokens


def print_resumption(model_name: str, device: torch.device, prompts: int, tokens: int) -> None:
    for dtype in dict.fromkeys([torch.float32, default_dtype(device)]):
        engine = TorchEngine.from_preset(
            model_name, seed=0, device=device, dtype=dtype, kv_capacity_tokens=65536
        )
        same_twice, agree, total, first_split = 0, 0, 0, []
        for i in range(prompts):
            prompt = (BOS_ID, *(32 + (i * 17 + j * 7) % 95 for j in range(200)))
            params = SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, eos_min_len=-1)
            straight = generate(engine, prompt, params)
            same_twice += straight == generate(engine, prompt, params)
            half = tokens // 2
            resumed = generate(
                engine,
                prompt + tuple(straight[:half]),
                SamplingParams(temperature=1.0, seed=i, max_tokens=tokens - half, eos_min_len=-1),
            )
            pairs = list(zip(straight[half:], resumed, strict=True))
            agree += sum(a == b for a, b in pairs)
            total += len(pairs)
            first_split.append(next((k for k, (a, b) in enumerate(pairs) if a != b), len(pairs)))
        print(
            f"  {str(dtype).removeprefix('torch.'):<9} same run twice: {same_twice}/{prompts};"
            f" resumed tokens equal to the straight run's: {agree}/{total}; first difference at resumed token"
            f" {sorted(first_split)} (of {tokens - tokens // 2})"
        )
        del engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="1b", help="preset (default 1b)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of each step shape")
    p.add_argument("--quick", action="store_true", help="small shapes (the CPU smoke test)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"
    else:
        where = f"CPU, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    engine = TorchEngine.from_preset(args.model, seed=0, device=device, kv_capacity_tokens=40_000)
    cfg = engine.model.cfg
    print(
        f"[torch engine] model {args.model} ({cfg.num_params() / 1e9:.2f}B params, {engine.dtype}), {where}"
    )
    if device.type == "cuda":
        print(
            f"  default KV capacity here: {default_kv_capacity(cfg, device, engine.dtype):,} tokens"
            f" ({cfg.kv_bytes_per_token(engine.dtype) // 1024} KiB a token)"
        )
    top = cfg.max_seq_len
    if args.quick:
        prefills = [(64, 0), (256, 0), (256, 256)]
        decodes = [(64,), (64,) * 4, (256,) * 4, (64, 64, 64, 512)]
        long_tokens, short_tokens, budgets, resume = min(top - 8, 1024), 40, [128], (1, 16)
    else:
        prefills = [(n, s) for n in (256, 512, 2048, 8192) for s in (0, 8192, 24576) if n + s <= top]
        prefills.append((min(top, 32768) - 768, 0))
        decodes = [(c,) * b for b in (1, 8, 32, 64) for c in (1024, 4096, 16384) if b * c <= 262144]
        # a ragged batch: the model pads every sequence to the longest, each layer, each step
        # (worker/model.py): 63 short ones beside one near the context's end
        decodes.append((1024,) * 63 + (min(top, 32768) - 768,))
        long_tokens, short_tokens, budgets, resume = min(top, 32768) - 768, 1000, [2048, 512], (4, 120)
    print("\n1. step costs (median of", args.reps, "timed steps each)")
    points = measure_steps(engine.model, prefills, decodes, args.reps)
    chunk, context = (256, 512) if args.quick else (2048, min(top, 32768))
    try:
        print(attention_at_offset(cfg, device, engine.dtype, chunk, context, args.reps))
    except torch.OutOfMemoryError:
        print(f"  one layer's attention, {chunk} queries at {context} keys: out of device memory")
    print_steps(points, fit_cost_model(points))
    print(f"\n2. long-prefill stall: a short P0 request streaming, a {long_tokens:,}-token P2 prompt arrives")
    print_stall(engine, long_tokens, short_tokens, budgets)
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"\n3. resumption: {resume[0]} prompts, {resume[1]} tokens sampled at T=1, resumed halfway")
    print_resumption(args.model, device, *resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
