"""The arithmetic of ``qos bench scale-out``: per-shard cost per request, ratios, the
projection to more shards and the fleet sizing table. Pure functions, unit-tested.

A pool's keys share one hash tag, so all of a pool's Redis work runs on the one shard that
owns its slot, and a shard's main thread runs one command at a time: the CPU seconds a
shard's main thread spends per request of its pool bound that pool's requests/s at
``1 / cpu_s_per_request`` (one core at 100 %), whatever else the cluster does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ShardDelta:
    """What one shard did during one phase (deltas of INFO cpu / commandstats)."""

    cpu_s: float  # main thread user + system CPU seconds
    calls: int  # every command, a script's inner commands included (INFO commandstats)
    evalsha: int  # script calls (client round trips)


def shard_figures(d: ShardDelta, wall_s: float, requests: int, background: ShardDelta | None = None,
                  background_s: float = 1.0) -> dict[str, Any]:
    """One shard's cost per request of its pool in a phase of ``wall_s`` seconds that
    completed ``requests`` (0: the shard's pool was not loaded). ``background``: the same
    shard measured idle over ``background_s`` (heartbeats, blocked reads), subtracted at
    its rate; the raw figure is kept too."""
    bg = background or ShardDelta(0.0, 0, 0)
    scale = wall_s / background_s if background_s > 0 else 0.0
    net_cpu = max(0.0, d.cpu_s - bg.cpu_s * scale)
    net_calls = max(0.0, d.calls - bg.calls * scale)
    net_eval = max(0.0, d.evalsha - bg.evalsha * scale)
    out: dict[str, Any] = {"requests": requests, "cpu_s": round(d.cpu_s, 4), "calls": d.calls,
                           "evalsha": d.evalsha, "busy": round(d.cpu_s / wall_s, 4) if wall_s > 0 else None,
                           "cpu_ms_per_request": None, "cpu_ms_per_request_raw": None,
                           "calls_per_request": None, "evalsha_per_request": None, "ceiling_rps": None}
    if requests > 0:
        out.update(cpu_ms_per_request=round(net_cpu / requests * 1e3, 4),
                   cpu_ms_per_request_raw=round(d.cpu_s / requests * 1e3, 4),
                   calls_per_request=round(net_calls / requests, 2),
                   evalsha_per_request=round(net_eval / requests, 2),
                   ceiling_rps=ceiling_rps(net_cpu / requests))
    return out


def ceiling_rps(cpu_s_per_request: float) -> float | None:
    """Requests/s one shard carries with its main thread 100 % busy."""
    return round(1.0 / cpu_s_per_request, 1) if cpu_s_per_request > 0 else None


def ratios(totals: Sequence[float]) -> list[float | None]:
    """Each phase's total requests/s over the first (one pool) phase's."""
    base = totals[0] if totals else 0.0
    return [round(t / base, 3) if base > 0 else None for t in totals]


def cost_drift(per_request: Sequence[float | None]) -> list[float | None]:
    """One shard's CPU per request in each phase over its first loaded phase's: 1.0 means
    adding pools on other shards did not make this shard's requests dearer."""
    first = next((c for c in per_request if c), None)
    return [round(c / first, 3) if c and first else None for c in per_request]


def projection(ceilings: Sequence[float], headroom: float = 1.0) -> list[dict[str, Any]]:
    """Requests/s of 1..n pools, one per shard, if each shard alone were the limit: the sum
    of the first k shards' ceilings (times ``headroom``), and that over one shard's."""
    out = []
    for k in range(1, len(ceilings) + 1):
        total = sum(ceilings[:k]) * headroom
        out.append({"pools": k, "requests_s": round(total, 1),
                    "ratio": round(total / (ceilings[0] * headroom), 3) if ceilings[0] > 0 else None})
    return out


def shard_us_with_pushes(measured_us: float, measured_pushes: float, pushes: float, push_us: float) -> float:
    """A shard's microseconds per request at another output length: the measured request
    with ``measured_pushes`` token pushes, plus (or minus) ``push_us`` per push of the other."""
    return measured_us + (pushes - measured_pushes) * push_us


def size_fleet(gpus: int, requests_s_per_gpu: float, shard_us_per_request: float,
               frontend_us_per_request: float, headroom: float = 0.5) -> dict[str, Any]:
    """Shards and frontend cores for ``gpus`` GPUs each completing ``requests_s_per_gpu``,
    running every shard and frontend core at ``headroom`` of its ceiling. A pool lives on
    one shard, so no pool may hold more than ``max_gpus_per_pool`` GPUs: a model served by
    more must be split into that many pools at least."""
    if min(gpus, requests_s_per_gpu, shard_us_per_request, frontend_us_per_request) <= 0 \
            or not 0 < headroom <= 1:
        raise ValueError("every figure must be positive and headroom in (0, 1]")
    requests_s = gpus * requests_s_per_gpu
    shard_rps = headroom * 1e6 / shard_us_per_request
    frontend_rps = headroom * 1e6 / frontend_us_per_request
    return {"gpus": gpus, "requests_s": round(requests_s, 1), "shard_rps": round(shard_rps, 1),
            "shards": math.ceil(requests_s / shard_rps), "frontend_rps_per_core": round(frontend_rps, 1),
            "frontend_cores": math.ceil(requests_s / frontend_rps),
            "max_gpus_per_pool": math.floor(shard_rps / requests_s_per_gpu)}


def pools_elsewhere(keys_by_shard: Mapping[str, Mapping[str, int]],
                    home: Mapping[str, str]) -> dict[str, int]:
    """Keys of each pool found on a shard other than its home shard (all zero when every
    pool's keys stay in its own slot). ``keys_by_shard``: shard -> pool -> keys there."""
    return {pool: sum(n for shard, per in keys_by_shard.items() if shard != home[pool]
                      for p, n in per.items() if p == pool) for pool in home}
