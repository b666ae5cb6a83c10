"""Worker settings: the config's ``[worker]`` table, then CLI flags on top, validated once.

One frozen dataclass so every part of the worker reads the same, already-checked values;
an error names the field as ``worker.<field>`` whether it came from the file or a flag.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from limiter.config import QosConfig, build_section
from limiter.errors import ConfigError
from limiter.keys import NAME_RE
from limiter.token_count import http_url_problem

ENGINES = ("torch", "sim", "openai")


@dataclass(frozen=True)
class WorkerSettings:
    """Everything one worker process needs besides the shared config (docs/worker.md)."""

    pool: str = ""  # "" = the config's first pool
    engine: str = "torch"  # torch | sim | openai
    device: str = "cpu"  # cpu | cuda | cuda:N
    worker_id: str = ""  # "" = <hostname>-<pid>-<device>
    # torch engine
    model: str = "tiny"  # preset name (tiny | 1b), used when no checkpoint is given
    checkpoint: str = ""  # safetensors file written by worker.engines.torch_engine.save_checkpoint
    seed: int = 0  # weight-init seed of a preset model
    torch_threads: int = 0  # 0 = torch's default
    # sim engine
    time_scale: float = 1.0  # multiplies the cost model's step times
    # batching (torch, sim)
    token_budget: int = 512  # most tokens per engine step (decodes + prefill chunks)
    adaptive_budget: bool = True  # size each step from the decoders' TPOT targets (worker/step_budget.py)
    budget_safety: float = 0.9  # aim a step at this share of the tightest TPOT target
    # a step may prefill this much of the top class's prompts beyond it, and of the prompts of a
    # tenant behind in its class while the TPOT targets allow (worker/batch_policy.py)
    top_prefill_tokens: int = 2048
    max_seqs: int = 32  # sequences in one batch
    kv_capacity_tokens: int = 0  # 0 = the engine's own estimate
    chunked_prefill: bool = True  # False = whole-prompt prefill (the original problem's "before")
    claim_ahead: int = 1  # requests held beyond a full batch, so higher classes can preempt
    claim_interval_ms: int = 20  # least time between claims that found nothing, while busy
    # A busy worker looks for news of work (an LPOP of the wake list, ~10 µs of Redis) at most
    # this often. It bounds what a request admitted while the batch runs waits before it is
    # claimed: at 20 ms (the claim interval, once used for both) it added ~10 ms to the mean
    # TTFT at 200 req/s; a GPU step is longer than this anyway, so there it is one LPOP a step.
    wake_check_ms: float = 2.0
    # streaming back
    flush_ms: float = 50.0  # push a request's tokens at least this often...
    flush_tokens: int = 16  # ...or once this many are pending, whichever comes first
    # A request whose client does not stream (stream=false: it reads the whole answer at the
    # end) has its first token pushed at once and the rest at least this often, however many
    # are pending (not flush_ms / flush_tokens: nobody reads them before the end, and each
    # push is a request's share of a push_tokens call). The pushes left are what a worker that
    # takes the request over resumes from: a lost worker's successor makes again at most this
    # much of its answer. Never less often than the class's own stream_flush_ms.
    unstreamed_flush_ms: float = 1000.0
    # upkeep
    lease_ms: int = 0  # 0 = the pool's lease_ms
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: int = 30
    reap_interval_s: float = 5.0
    idle_block_s: float = 1.0  # BLPOP timeout while idle
    drain_timeout_s: float = 30.0  # after SIGTERM, how long running work may take to finish
    metrics_port: int = 0  # 0 = no metrics server
    metrics_host: str = "0.0.0.0"
    # openai engine
    upstream_url: str = ""  # e.g. http://127.0.0.1:8000 (the /v1 base is added)
    upstream_model: str = ""  # "" = the pool's model name
    upstream_priority: bool = True  # send the class rank as vLLM's `priority`
    max_inflight: int = 64  # requests in flight at the upstream
    upstream_timeout_s: float = 600.0
    # no event on any of the server's open streams for this long: it is hung (0 = not watched)
    upstream_stall_s: float = 120.0
    # push each upstream chunk of a streamed request as it comes (else flush_ms/flush_tokens)
    upstream_forward_chunks: bool = True
    upstream_chunk_usage: bool = True  # ask for vLLM's continuous_usage_stats: exact token counts per chunk
    upstream_retry_min_s: float = 0.5  # unreachable upstream: first back-off before a probe...
    upstream_retry_max_s: float = 30.0  # ...doubling up to this
    # an idle worker asks its server's health this often: one that died while the pool was
    # idle opens the breaker before a request finds it (0 = only requests and probes tell)
    upstream_idle_check_s: float = 10.0

    def resolved(self, cfg: QosConfig) -> WorkerSettings:
        """Fill the defaults that depend on the config or the host, then validate."""
        s = self
        if not s.pool:
            s = replace(s, pool=cfg.pools[0].name)
        if not s.worker_id:
            s = replace(s, worker_id=default_worker_id(s.device))
        s.validate(cfg)
        return s

    def validate(self, cfg: QosConfig) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ConfigError(f"worker.{name}", message)

        check(self.pool in {p.name for p in cfg.pools}, "pool",
              f"unknown pool {self.pool!r}; configured: {[p.name for p in cfg.pools]}")
        check(self.engine in ENGINES, "engine", f"must be one of {ENGINES}, got {self.engine!r}")
        check(re.fullmatch(r"cpu|cuda(:\d+)?|mps", self.device) is not None, "device",
              f"must be cpu, cuda or cuda:N, got {self.device!r}")
        check(bool(NAME_RE.fullmatch(self.worker_id)), "worker_id", f"{self.worker_id!r} must match "
              f"{NAME_RE.pattern}")
        check(0 <= self.torch_threads <= 1024, "torch_threads", "must be in [0, 1024]")
        # torch.manual_seed's range: past it a torch worker's start was a traceback
        check(-(2**63) <= self.seed <= 2**64 - 1, "seed", "must be in [-2**63, 2**64 - 1]")
        # inf slept for ever each step; nan passed a bare >= 0 check as no number does
        check(0 <= self.time_scale <= 1000, "time_scale", "must be in [0, 1000]")
        check(1 <= self.max_seqs <= 1024, "max_seqs", "must be in [1, 1024]")
        check(self.max_seqs <= self.token_budget <= 1 << 20, "token_budget",
              f"must be in [max_seqs ({self.max_seqs}), 1048576]")
        # (claim.lua takes a KV room up to 1e12 tokens: past it every claim was a BADARG)
        check(0 <= self.kv_capacity_tokens <= 10**12, "kv_capacity_tokens",
              "must be in [0, 1e12] (0 = engine default)")
        check(0 < self.budget_safety <= 1, "budget_safety", "must be in (0, 1]")
        check(0 <= self.top_prefill_tokens <= 1 << 20, "top_prefill_tokens", "must be in [0, 1048576]")
        check(0 <= self.claim_ahead <= 1024, "claim_ahead", "must be in [0, 1024]")
        # (at 0 an idle worker facing a backlog it cannot take claimed flat out)
        check(1 <= self.claim_interval_ms <= 10_000, "claim_interval_ms", "must be in [1, 10000]")
        check(0 <= self.wake_check_ms <= 10_000, "wake_check_ms", "must be in [0, 10000]")
        check(0 < self.flush_ms <= 10_000, "flush_ms", "must be in (0, 10000]")
        check(1 <= self.flush_tokens <= 100_000, "flush_tokens", "must be in [1, 100000]")
        check(0 < self.unstreamed_flush_ms <= 60_000, "unstreamed_flush_ms", "must be in (0, 60000]")
        check(self.lease_ms == 0 or 100 <= self.lease_ms <= 3_600_000, "lease_ms",
              "must be 0 (the pool's) or in [100, 3600000]")
        # (1e-9 heartbeat Redis flat out; a TTL past a day is one EXPIRE may refuse)
        check(0.01 <= self.heartbeat_s <= 60, "heartbeat_s", "must be in [0.01, 60]")
        check(2 * self.heartbeat_s <= self.heartbeat_ttl_s <= 86_400, "heartbeat_ttl_s",
              "must be in [2 x heartbeat_s, 86400]")
        check(0 < self.reap_interval_s <= 3600, "reap_interval_s", "must be in (0, 3600]")
        check(0 < self.idle_block_s <= 60, "idle_block_s", "must be in (0, 60]")
        check(0 <= self.drain_timeout_s <= 86_400, "drain_timeout_s", "must be in [0, 86400]")
        check(0 <= self.metrics_port <= 65535, "metrics_port", "must be in [0, 65535]")
        check(1 <= self.max_inflight <= 100_000, "max_inflight", "must be in [1, 100000]")
        check(0 < self.upstream_timeout_s <= 86_400, "upstream_timeout_s", "must be in (0, 86400]")
        # (past upstream_timeout_s it is moot: each silent stream times out first)
        check(0 <= self.upstream_stall_s <= 86_400, "upstream_stall_s",
              "must be in [0, 86400] (0: not watched)")
        check(0 < self.upstream_retry_min_s <= 3600, "upstream_retry_min_s", "must be in (0, 3600]")
        check(self.upstream_retry_min_s <= self.upstream_retry_max_s <= 3600, "upstream_retry_max_s",
              "must be in [upstream_retry_min_s, 3600]")
        check(self.upstream_idle_check_s == 0 or 0.01 <= self.upstream_idle_check_s <= 3600,
              "upstream_idle_check_s", "must be 0 (off) or in [0.01, 3600]")
        if self.engine == "openai":
            check(self.upstream_url.startswith(("http://", "https://")), "upstream_url",
                  "the openai engine needs an http(s):// upstream URL")
            problem = http_url_problem(self.upstream_url)
            check(problem is None, "upstream_url", f"{problem}")
        if self.engine != "openai":
            i = [p.name for p in cfg.pools].index(self.pool)
            spec = cfg.pools[i].tokenizer
            if spec != "bytes":
                raise ConfigError(f"pools[{i}].tokenizer",
                                  f"the {self.engine} engine counts tokens as UTF-8 bytes (its model's "
                                  f"tokenizer); pool {self.pool!r} counts them with {spec!r}, so only the "
                                  "openai engine can serve it (or set tokenizer = \"bytes\")")
        if self.engine == "torch" and not self.checkpoint:
            check(self.model in ("tiny", "1b"), "model", f"unknown preset {self.model!r}; known: tiny, 1b")


def default_worker_id(device: str) -> str:
    """``<hostname>-<pid>-<device>``, squeezed into a valid key name."""
    raw = f"{socket.gethostname()}-{os.getpid()}-{device}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw)[-64:]


def load_settings(cfg: QosConfig, overrides: Mapping[str, Any] | None = None) -> WorkerSettings:
    """The ``[worker]`` table with ``overrides`` (CLI flags; ``None`` values ignored) on top."""
    data = dict(cfg.worker)
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    settings: WorkerSettings = build_section("worker", WorkerSettings, data)
    return settings.resolved(cfg)


def shown_upstream(url: str) -> str:
    """``upstream_url`` fit to show (the worker's log, its heartbeat, which `qos status --json`
    prints): its user part (aiohttp sends a URL's user and password as Basic auth) and any
    query as ``***``. They were written to Redis and printed whole (found by a review,
    2026-12-06)."""
    scheme, sep, rest = url.partition("://")
    rest, q, _query = rest.partition("?")
    # the user part is in the authority (up to the first '/'): an '@' in the path or query
    # is not one, and splitting the whole URL there showed "http://***@b" for "...?key=a@b"
    head, slash, tail = rest.partition("/")
    _userinfo, at, host = head.rpartition("@")
    return f"{scheme}{sep}{'***@' if at else ''}{host}{slash}{tail}{'?***' if q else ''}"
