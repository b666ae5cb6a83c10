"""Building a worker process from its settings: the engine, the loop, and running it."""

from __future__ import annotations

import logging
from typing import Any

from limiter.config import QosConfig
from limiter.errors import RedisUnavailable
from worker.batch_policy import Limits
from worker.engines.base import Engine
from worker.runtime import WorkerRuntime
from worker.settings import WorkerSettings, shown_upstream

log = logging.getLogger("qos.worker")


def build_engine(s: WorkerSettings) -> Engine:
    """The torch or sim engine the settings name (imports torch only when needed)."""
    kv = s.kv_capacity_tokens or None
    if s.engine == "sim":
        from worker.engines.sim import SimEngine

        return SimEngine(time_scale=s.time_scale, kv_capacity_tokens=kv or 1 << 20)
    import torch

    from worker.engines.torch_engine import TorchEngine

    if s.torch_threads:
        torch.set_num_threads(s.torch_threads)
    if s.checkpoint:
        return TorchEngine.from_checkpoint(s.checkpoint, device=s.device, kv_capacity_tokens=kv)
    return TorchEngine.from_preset(s.model, seed=s.seed, device=s.device, kv_capacity_tokens=kv)


def build_limits(s: WorkerSettings, engine: Engine) -> Limits:
    return Limits(token_budget=s.token_budget, max_seqs=s.max_seqs, kv_capacity=engine.kv_capacity_tokens,
                  chunked_prefill=s.chunked_prefill)


def describe(s: WorkerSettings, engine: Engine | None) -> str:
    if engine is None:
        return f"openai engine -> {shown_upstream(s.upstream_url)} (max_inflight {s.max_inflight})"
    what = s.checkpoint or s.model if engine.name == "torch" else f"time_scale {s.time_scale}"
    chunked = "on" if s.chunked_prefill else "OFF"
    return (f"{engine.name} engine ({what}) on {s.device}; token_budget {s.token_budget}, "
            f"max_seqs {s.max_seqs}, kv {engine.kv_capacity_tokens} tokens, chunked prefill {chunked}")


def build_worker(s: WorkerSettings, cfg: QosConfig,
                 engine: Engine | None = None) -> tuple[WorkerRuntime, Any]:
    """The runtime and the serving loop for ``s`` (tests build workers in-process with it)."""
    if s.engine == "openai":
        from worker.upstream import UpstreamLoop

        rt = WorkerRuntime(s, cfg, engine="openai", simulated=False)
        return rt, UpstreamLoop(rt)
    from worker.claim_step_loop import StepLoop

    engine = engine or build_engine(s)
    rt = WorkerRuntime(s, cfg, engine=engine.name, simulated=engine.simulated)
    loop = StepLoop(rt, engine, build_limits(s, engine))
    m = rt.metrics
    m.kv_capacity.set(engine.kv_capacity_tokens)
    # Read when scraped, not set every step: KV in use and the waiting count are each a pass
    # over the sequences, made every step for a scrape every few seconds.
    m.batch_size.set_function(lambda: loop.last_batch_size)
    m.waiting.set_function(lambda: len(loop.sched.waiting))
    m.kv_used.set_function(lambda: loop.sched.kv_used)
    return rt, loop


async def run_worker(rt: WorkerRuntime, loop: Any) -> int:
    """Open, serve until drained, close. Returns the exit status (0)."""
    engine = getattr(loop, "engine", None)
    s = rt.settings
    log.info("worker %s, pool %s: %s%s", s.worker_id, s.pool, describe(s, engine),
             " -- SIMULATED: placeholder text, modelled step times" if rt.simulated else "")
    if engine is not None and engine.kv_capacity_tokens < rt.pool_cfg.context_tokens:
        log.warning("KV capacity %d tokens is below pool %s's context_tokens %d: requests needing more "
                    "(prompt + max_tokens) are left to other workers", engine.kv_capacity_tokens, s.pool,
                    rt.pool_cfg.context_tokens)
    try:
        await rt.open()
        await loop.run()
    except RedisUnavailable:
        if not rt.draining.is_set():
            raise
        log.warning("stopped before Redis came back")
    finally:
        await rt.close()
    log.info("worker %s stopped", s.worker_id)
    return 0


async def serve(s: WorkerSettings, cfg: QosConfig) -> int:
    """The ``qos worker`` process: build, drain on SIGTERM/SIGINT, exit 0."""
    rt, loop = build_worker(s, cfg)
    rt.install_signal_handlers()
    return await run_worker(rt, loop)
