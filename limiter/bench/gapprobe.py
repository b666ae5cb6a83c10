"""The 32K-prefill stall, measured on its own: a decoding P0 stream, alone and next to a long prefill.

On an idle one-worker stack of the mode (so the long prompt and the P0 streams share the
worker), ``streams`` P0 requests (one by default: the original problem's short chat next to a 32K
document) stream ``p0_tokens`` tokens each, alone; then the same again, and ``lead_s``
later one long P2 prompt arrives. The figure is the longest P0 inter-token gap (over all
streams) in the second case over the first: without chunked prefill the whole prompt runs
in one step and the P0 stream stalls for all of it (the original problem's 2 s); with it, the prompt
runs in budget-sized slices between P0's decode steps.

Both views are reported: the client's (chunk arrival times, which include the worker's
push batching of ``flush_ms``, 50 ms by default, so ~50 ms is the floor), and the worker's
(``tpot_max_ms`` of the latency sample: engine step ends, no batching).

The ratios are measured only when the long request succeeded and its prefill (its send to
its first token) overlapped every P0 stream's measured window (first to last chunk): a long
prompt refused (429), rejected (400) or prefilled before or after the streams stalls
nothing, and a ratio then would pass without a test. Otherwise both ratios are None and
``no_ratio`` says why.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from limiter.bench.modes import api_key, tenant_name
from limiter.bench.stack import Probe
from limiter.localstack.loadgen import Result, make_prompt, stream_completion


@dataclass(frozen=True)
class GapProbe:
    alone_client_ms: float | None
    during_client_ms: float | None
    alone_worker_ms: float | None
    during_worker_ms: float | None
    long_prompt_tokens: int
    long_ttft_ms: float | None  # the long prompt's time to first token (its prefill, roughly)
    p0_tokens: int
    streams: int
    no_ratio: str = ""  # why the ratios are not measured ('' when they are: module docstring)

    @property
    def ratio_client(self) -> float | None:
        return None if self.no_ratio else _ratio(self.during_client_ms, self.alone_client_ms)

    @property
    def ratio_worker(self) -> float | None:
        return None if self.no_ratio else _ratio(self.during_worker_ms, self.alone_worker_ms)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ratio_client": self.ratio_client, "ratio_worker": self.ratio_worker}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def why_no_ratio(during: list[Result], big: Result) -> str:
    """'' when the long request succeeded and its prefill (send to first token) overlapped
    each P0 stream's measured window (first to last chunk); else why not."""
    if not big.ok:
        return f"the long request failed ({big.status or 'no answer'} {big.error})".rstrip()
    if not big.token_times:
        return "the long request returned no token"
    if not during or not all(r.ok and len(r.token_times) >= 2 for r in during):
        return "a P0 stream next to the long request failed or sent under two chunks"
    start, first = big.sent_s, big.token_times[0]
    for r in during:
        if not (start < r.token_times[-1] and first > r.token_times[0]):
            return (f"the long prefill ({start:.3f}-{first:.3f} s) did not overlap the P0 stream "
                    f"({r.token_times[0]:.3f}-{r.token_times[-1]:.3f} s)")
    return ""


def _max_gap(results: list[Result]) -> float | None:
    gaps = [r.max_gap_ms for r in results if r.ok and r.max_gap_ms is not None]
    return max(gaps) if gaps and all(r.ok for r in results) else None


async def run_gap_probe(base_url: str, model: str, probe: Probe, *, long_prompt_tokens: int, streams: int = 1,
                        p0_tokens: int = 400, lead_s: float = 0.5) -> GapProbe:
    """Run the probe on an idle stack (module docstring)."""
    short = make_prompt(32, 1)
    long = make_prompt(long_prompt_tokens, 2)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        def p0s() -> Any:
            key = api_key("P0")
            return asyncio.gather(*(stream_completion(session, base_url, key, model, short, p0_tokens, "P0")
                                    for _ in range(streams)))

        alone: list[Result] = await p0s()
        task = asyncio.ensure_future(p0s())
        await asyncio.sleep(lead_s)
        big = await stream_completion(session, base_url, api_key("P2"), model, long, 2, "P2")
        during: list[Result] = await task
    await asyncio.sleep(0.3)  # the samples are appended as each request completes
    p0 = [s for s in await probe.samples() if s.get("tenant") == tenant_name("P0")]
    worker = [_max_opt([s.get("tpot_max_ms") for s in part]) for part in (p0[:streams], p0[streams:])]
    return GapProbe(_max_gap(alone), _max_gap(during), worker[0], worker[1], long_prompt_tokens,
                    big.ttft_ms if big.ok else None, p0_tokens, streams, why_no_ratio(during, big))


def _max_opt(values: list[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, int | float)]
    return max(nums) if nums else None
