"""The ways the benchmark runs the same load: each mode is a config plus worker flags.

* ``fifo`` -- no QoS, the original problem's "before": **one class** that every tenant maps to, served
  in arrival order whoever sent the request (``fair = false``), a capacity so large that no
  wait estimate ever refuses, no floors, no controller, and workers that prefill whole
  prompts (``--no-chunked-prefill``), so a 32K prompt stalls the batch.
* ``fifo-chunked`` -- a reference, not run by default: ``fifo`` with chunked prefill (the
  slices sized exactly as in ``priority`` and ``qos``). Against ``fifo`` it measures what
  chunking itself costs in work; against ``qos``, what the scheduling costs on top.
* ``priority`` -- strict priority only: the three classes (P0 > P1 > P2, each with its own
  max queue wait), arrival order inside a class, chunked prefill, but unbounded capacity
  (nothing refused for its wait), no floors and no controller.
* ``qos`` -- everything on: class guarantees at the original problem's 60/35/5 shares of the measured
  capacity (2 s bursts, ``QOS_BURST_S``) enforced when workers claim, spare capacity by
  priority, tenants of a class by virtual token counters, starvation floors, admission
  refusing only what cannot start within its max wait, chunked prefill and the controller.

Each tenant (``bench-p0``, ``bench-p1``, ``bench-p2``) stands for one assigned class, so the
client and the latency samples both tell which class a request *meant*, even in fifo where
the system sees one class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from limiter.config import (
    DEFAULT_CLASSES,
    ClassConfig,
    PoolConfig,
    QosConfig,
    TenantConfig,
    hash_key,
    validate,
)
from limiter.localstack.toml_writer import config_toml, write_toml

MODES = ("fifo", "priority", "qos")  # the default run
ALL_MODES = (*MODES, "fifo-chunked")
POOL = "bench"
# The sim workers' step cap (``--token-budget``): vLLM's own default max_num_batched_tokens for
# `vllm serve` (2,048 on GPUs under 70 GiB and on A100s, 8,192 above; its arg_utils.py). Each
# step is still sized below it from the TPOT targets (worker/step_budget.py). Before the
# fourteenth stop it was 256, a stress setting: every long prompt paid the step's fixed cost
# once per 256 tokens (docs/benchmarks.md has the figures at both).
SIM_TOKEN_BUDGET = 2048
UNLIMITED = 1e12  # capacity that never throttles (the Lua maxima accept it)
FIFO_CLASS = "fifo"
NO_MAX_WAIT_MS = 600_000  # fifo: requests wait as long as they must (the run's drain bounds it)
# qos: class and pool bursts, in seconds of rate. The shipped 0.5 s is sized for chat-sized
# requests; with output tokens weighted ~20x (calibrate.py) a P0 chat costs ~5K weighted tokens
# and the P0 burst held two, so the trace's own bursts were throttled (429) though P0 asked
# for less than its share. 2 s holds ~8 and still bounds what a burst can queue.
QOS_BURST_S = 2.0


def tenant_name(cls: str) -> str:
    return f"bench-{cls.lower()}"


def api_key(cls: str) -> str:
    """The API key the benchmark client uses for requests of assigned class ``cls``."""
    return f"qos-bench-{cls.lower()}-key"


@dataclass(frozen=True)
class ModeSpec:
    """A mode: its config and how its roles are started."""

    name: str
    cfg: QosConfig
    chunked_prefill: bool
    controller: bool


def _tenants(classes: Iterable[str], internal: Mapping[str, str]) -> tuple[TenantConfig, ...]:
    return tuple(TenantConfig(name=tenant_name(c), key_sha256=(hash_key(api_key(c)),),
                              default_class=internal[c], max_class=internal[c], rate_tokens_s=UNLIMITED)
                 for c in classes)


def mode_spec(mode: str, *, capacity_tokens_s: float, context_tokens: int, out_weight: float = 1.0,
              classes: tuple[ClassConfig, ...] = DEFAULT_CLASSES,
              controller: Mapping[str, Any] | None = None) -> ModeSpec:
    """The config of ``mode`` for a pool of ``capacity_tokens_s`` weighted tokens/s, output
    tokens charged ``out_weight`` (limiter/bench/calibrate.py says why)."""
    classes = tuple(dataclasses.replace(c, weight=1.0, out_weight=out_weight) for c in classes)
    names = [c.name for c in classes]
    pool = PoolConfig(name=POOL, model=POOL, context_tokens=context_tokens, default_max_tokens=256,
                      capacity_tokens_s=capacity_tokens_s)
    common: dict[str, Any] = {"frontend": {"shutdown_grace_s": 2.0}, "worker": {"drain_timeout_s": 2.0}}
    if mode in ("fifo", "fifo-chunked"):
        one = ClassConfig(name=FIFO_CLASS, share=1.0, ceil_share=1.0, floor=0.0, max_wait_ms=NO_MAX_WAIT_MS,
                          admission_wait_ms=0, queue_cap=1_000_000, out_weight=out_weight, fair=False)
        cfg = QosConfig(classes=(one,), pools=(dataclasses.replace(pool, capacity_tokens_s=UNLIMITED),),
                        tenants=_tenants(names, dict.fromkeys(names, FIFO_CLASS)), **common)
        return ModeSpec(mode, validate(cfg), chunked_prefill=mode == "fifo-chunked", controller=False)
    if mode == "priority":
        strict = tuple(dataclasses.replace(c, floor=0.0, queue_cap=1_000_000, fair=False) for c in classes)
        cfg = QosConfig(classes=strict, pools=(dataclasses.replace(pool, capacity_tokens_s=UNLIMITED),),
                        tenants=_tenants(names, {c: c for c in names}), **common)
        return ModeSpec(mode, validate(cfg), chunked_prefill=True, controller=False)
    if mode == "qos":
        classes = tuple(dataclasses.replace(c, burst_s=QOS_BURST_S) for c in classes)
        cfg = QosConfig(classes=classes, pools=(pool,), tenants=_tenants(names, {c: c for c in names}),
                        controller=dict(controller or {}), **common)
        return ModeSpec(mode, validate(cfg), chunked_prefill=True, controller=True)
    raise ValueError(f"unknown mode {mode!r}; known: {', '.join(ALL_MODES)}")


# --- TOML ---------------------------------------------------------------------------------------

def to_toml(cfg: QosConfig) -> str:
    return config_toml(cfg, "written by `qos bench run`")


def write_config(cfg: QosConfig, path: Path) -> Path:
    return write_toml(cfg, path, "written by `qos bench run`")
