"""Client-side load generation and measurement through the public HTTP API.

Used by ``qos up --demo-load`` and by the benchmarks: one streaming request is sent the way
a real client sends it (OpenAI streaming completions over SSE) and timed on the client
side, so what is measured is what a user would see. Arrivals are open-loop: callers
schedule requests by time and never wait for answers before sending the next.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp

from limiter.localstack.sse import sse_chunks


@dataclass
class Result:
    """What one request looked like from the client."""

    cls: str
    sent_s: float  # monotonic send time, seconds
    status: int = 0  # HTTP status; 0 = transport error
    error: str = ""  # OpenAI error code or exception name
    retry_after_s: float | None = None
    ttft_ms: float | None = None
    token_times: list[float] = field(default_factory=list)  # monotonic, one per content chunk
    output_tokens: int = 0  # from the final usage chunk
    input_tokens: int = 0
    e2e_ms: float | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def gaps_ms(self) -> list[float]:
        t = self.token_times
        return [(b - a) * 1000 for a, b in itertools.pairwise(t)]

    @property
    def max_gap_ms(self) -> float | None:
        g = self.gaps_ms
        return max(g) if g else None

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first: (last - first) / (tokens - 1)."""
        if self.output_tokens < 2 or len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) * 1000 / (self.output_tokens - 1)


async def stream_completion(
    session: aiohttp.ClientSession,
    base_url: str,
    key: str,
    model: str,
    prompt: str,
    max_tokens: int,
    cls: str,
    *,
    qos_class: str | None = None,
    timeout_s: float = 600.0,
    scheduled_s: float | None = None,
) -> Result:
    """POST /v1/completions with stream=true; time the first token and every chunk.

    ``scheduled_s``: when an open-loop schedule meant the request to go (monotonic); its
    times count from then, so a client late to send it (its event loop busy) does not hide
    that wait from the figures. A 200 stream that ends without ``[DONE]`` (nor an error
    event) is an error, ``stream_truncated``: it was cut short."""
    headers = {"Authorization": f"Bearer {key}"}
    if qos_class:
        headers["X-QoS-Class"] = qos_class
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    res = Result(cls=cls, sent_s=time.monotonic() if scheduled_s is None else scheduled_s)
    ended = False
    try:
        async with session.post(
            f"{base_url}/v1/completions",
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            res.status = resp.status
            if resp.status != 200:
                ra = resp.headers.get("Retry-After")
                res.retry_after_s = float(ra) if ra else None
                try:
                    res.error = (await resp.json())["error"]["code"] or f"http_{resp.status}"
                except (aiohttp.ContentTypeError, KeyError, TypeError, json.JSONDecodeError):
                    res.error = f"http_{resp.status}"
                return res
            async for chunk in sse_chunks(resp.content):
                if chunk is None:
                    ended = True
                    break
                if chunk.get("error"):
                    res.error = chunk["error"].get("code") or "stream_error"
                    break
                for choice in chunk.get("choices") or ():
                    text = choice.get("text") or ""
                    if text:
                        now = time.monotonic()
                        if res.ttft_ms is None:
                            res.ttft_ms = (now - res.sent_s) * 1000
                        res.token_times.append(now)
                        res.text += text
                usage = chunk.get("usage")
                if usage:
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    res.input_tokens = int(usage.get("prompt_tokens") or 0)
            if not ended and not res.error:
                res.error = "stream_truncated"
    except (TimeoutError, aiohttp.ClientError) as exc:
        res.error = res.error or type(exc).__name__
    res.e2e_ms = (time.monotonic() - res.sent_s) * 1000
    return res


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    v = sorted(values)
    if not v:
        return None
    k = max(0, min(len(v) - 1, math.ceil(q / 100 * len(v)) - 1))
    return v[k]


@dataclass(frozen=True)
class ClassLoad:
    """One class of an open-loop demo load: Poisson arrivals of prompts of a size range."""

    cls: str
    key: str
    rate_per_s: float
    prompt_tokens: tuple[int, int]
    max_tokens: int


def poisson_schedule(
    loads: Iterable[ClassLoad], duration_s: float, seed: int
) -> list[tuple[float, ClassLoad, int]]:
    """(offset_s, load, prompt_tokens) arrivals, merged and sorted; seeded, so repeatable."""
    rng = random.Random(seed)
    out = []
    for load in loads:
        t = 0.0
        while load.rate_per_s > 0:
            t += rng.expovariate(load.rate_per_s)
            if t >= duration_s:
                break
            out.append((t, load, rng.randint(*load.prompt_tokens)))
    out.sort(key=lambda x: x[0])
    return out


def make_prompt(tokens: int, seed: int) -> str:
    """A prompt of exactly ``tokens`` pool tokens (byte-level: bytes + BOS)."""
    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog while inference queues drain".split()
    out: list[str] = []
    n = 0
    target = max(tokens - 1, 1)
    while n < target:
        w = rng.choice(words) + " "
        out.append(w)
        n += len(w)
    return "".join(out)[:target]
