"""``qos worker``: one worker process per GPU card (or a CPU / simulated / upstream one).

Flags override the config's ``[worker]`` table; both are validated together
(:mod:`worker.settings`), so an error names ``worker.<field>``. See docs/worker.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from limiter.cli import common_args, load_config, log_level_arg
from limiter.errors import ConfigError
from limiter.event_loop import install_event_loop
from worker.settings import ENGINES, load_settings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run a worker: pull requests by priority, run the model, stream tokens")
    a = p.add_argument
    bool_flag = argparse.BooleanOptionalAction
    a("--pool", help="pool to serve (default: the config's first pool)")
    a("--engine", choices=ENGINES, help="torch (real model), sim (cost model, labelled simulated) or "
      "openai (front an upstream server); default torch")
    a("--device", help="cpu, cuda or cuda:N (default cpu)")
    a("--worker-id", help="default <hostname>-<pid>-<device>")
    g = p.add_argument_group("torch engine")
    g.add_argument("--model", help="preset when no checkpoint is given: tiny (default) or 1b")
    g.add_argument("--checkpoint", help="safetensors file written by torch_engine.save_checkpoint")
    g.add_argument("--seed", type=int, help="weight-init seed of a preset model (default 0)")
    g.add_argument("--torch-threads", type=int, help="torch CPU threads (default: torch's choice)")
    g = p.add_argument_group("sim engine")
    g.add_argument("--time-scale", type=float, help="multiply modelled step times (default 1.0)")
    g = p.add_argument_group("batching (torch, sim)")
    g.add_argument("--token-budget", type=int,
                   help="most tokens per engine step (default 512); each step is sized below it from the "
                   "decoding classes' TPOT targets and the measured step cost")
    g.add_argument("--adaptive-budget", action=bool_flag, default=None,
                   help="size each step from the TPOT targets (default on; --no-adaptive-budget: always "
                   "--token-budget)")
    g.add_argument("--max-seqs", type=int, help="sequences per batch (default 32)")
    g.add_argument("--kv-capacity", dest="kv_capacity_tokens", type=int,
                   help="KV cache tokens (default: the engine's estimate)")
    g.add_argument("--chunked-prefill", action=bool_flag, default=None,
                   help="slice long prompts by the token budget (default on; --no-chunked-prefill is the "
                   "original problem's stalling 'before')")
    g.add_argument("--claim-ahead", type=int, help="requests held beyond a full batch (default 1)")
    g = p.add_argument_group("upstream (openai engine)")
    g.add_argument("--upstream-url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000 "
                   "(API key from env QOS_UPSTREAM_API_KEY)")
    g.add_argument("--upstream-model", help="model name to send (env QOS_UPSTREAM_MODEL; default: the pool's "
                   "model)")
    g.add_argument("--upstream-priority", action=bool_flag, default=None,
                   help="send the class rank as vLLM's `priority` (env QOS_UPSTREAM_PRIORITY=0/1; "
                   "default on)")
    g.add_argument("--max-inflight", type=int, help="requests open at the upstream (default 64)")
    g.add_argument("--upstream-forward-chunks", action=bool_flag, default=None,
                   help="push each upstream chunk to a streaming client as it comes (default on; off: "
                   "batch by --flush-ms / --flush-tokens, fewer Redis writes)")
    g.add_argument("--upstream-chunk-usage", action=bool_flag, default=None,
                   help="ask the upstream for its running usage on every chunk (vLLM's "
                   "stream_options.continuous_usage_stats; default on): exact token counts as they stream; "
                   "off for servers that reject it: one token per chunk, reconciled with the final usage")
    g = p.add_argument_group("operation")
    g.add_argument("--flush-ms", type=float, help="push a request's tokens at least this often (default 50)")
    g.add_argument("--flush-tokens", type=int, help="...or once this many are pending (default 16)")
    g.add_argument("--lease-ms", type=int, help="lease length (default: the pool's lease_ms)")
    g.add_argument("--drain-timeout", dest="drain_timeout_s", type=float,
                   help="after SIGTERM, seconds running work may take before it is handed back (default 30)")
    g.add_argument("--metrics-port", type=int, help="Prometheus /metrics and /healthz port (0 = off)")
    g.add_argument("--metrics-host", help="metrics listen address (default 0.0.0.0)")
    log_level_arg(g)
    common_args(p)
    p.set_defaults(func=run)


_FIELDS = (
    "pool", "engine", "device", "worker_id", "model", "checkpoint", "seed", "torch_threads", "time_scale",
    "token_budget", "adaptive_budget", "max_seqs", "kv_capacity_tokens", "chunked_prefill", "claim_ahead",
    "upstream_url", "upstream_model", "upstream_priority", "upstream_forward_chunks", "upstream_chunk_usage",
    "max_inflight",
    "flush_ms", "flush_tokens", "lease_ms", "drain_timeout_s", "metrics_port", "metrics_host",
)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def upstream_env(env: Mapping[str, str], flags: Mapping[str, Any]) -> dict[str, Any]:
    """``QOS_UPSTREAM_MODEL`` / ``QOS_UPSTREAM_PRIORITY`` where no flag gave them: ``qos up``
    passes its environment to every worker it starts, so an upstream's model name and the
    priority switch reach them without a config file."""
    out: dict[str, Any] = {}
    if flags.get("upstream_model") is None and env.get("QOS_UPSTREAM_MODEL"):
        out["upstream_model"] = env["QOS_UPSTREAM_MODEL"]
    raw = env.get("QOS_UPSTREAM_PRIORITY")
    if flags.get("upstream_priority") is None and raw is not None and raw.strip():
        v = raw.strip().lower()
        if v not in _TRUE + _FALSE:
            raise ConfigError("QOS_UPSTREAM_PRIORITY", f"must be one of {_TRUE + _FALSE}, got {raw!r}")
        out["upstream_priority"] = v in _TRUE
    return out


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args, tokenizer_files=False)  # counts no tokens
    flags = {f: getattr(args, f) for f in _FIELDS}
    settings = load_settings(cfg, {**flags, **upstream_env(os.environ, flags)})
    tag = " [SIMULATED]" if settings.engine == "sim" else ""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[{settings.worker_id}]{tag}: %(message)s")
    from worker.main import serve

    install_event_loop()
    return asyncio.run(serve(settings, cfg))
