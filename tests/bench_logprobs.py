"""What a token's logprobs cost: ``python tests/bench_logprobs.py [--tokens 2000] [--rounds 5]``.

For a chat and a completion answer with 0, 1, 5 and 20 alternatives a token, as vLLM streams
them (a token a chunk; tokens and alternatives drawn from common English words, logprobs as
full-precision floats), it reports per token:

* **bytes**: what the logprobs add to the text pushed through Redis (limiter/reply_text.py's
  compact record; stored in the reply stream until the frontend reads it);
* **worker us**: the worker's check and compaction of a chunk's logprobs
  (worker/logprobs.py ``choice_logprobs``) and their packing into the pushed text;
* **frontend us**: the frontend's unpacking of a push and building of the chunk it streams
  (``unpack_in_order``, ``logprobs_object``, the SSE line), less the same for the text alone.

Each figure is the best of ``--rounds`` (the machine's noise is upward). Not collected by
pytest (no ``test_`` prefix); docs/worker.md quotes its output.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from limiter.config import demo_config
from limiter.frontend import openai_api as oa
from limiter.reply_text import pack, unpack_in_order
from worker.logprobs import choice_logprobs

WORDS = [" the", " of", " and", " to", " in", " a", " is", " that", " for", " it", " was", " on", " are",
         " as", " with", " his", " they", " at", " be", " this", " from", " have", " or", " by"]
TOPS = (0, 1, 5, 20)


def server_choices(chat: bool, top: int, n: int, rng: random.Random) -> list[dict[str, Any]]:
    """``n`` one-token chunks' choices as vLLM streams them with logprobs."""
    out = []
    for _ in range(n):
        t = rng.choice(WORDS)
        alts = rng.sample(WORDS, top)
        if chat:
            lp: dict[str, Any] = {"content": [{
                "token": t, "logprob": -rng.random() * 3, "bytes": list(t.encode()),
                "top_logprobs": [{"token": a, "logprob": -rng.random() * 10, "bytes": list(a.encode())}
                                 for a in alts]}]}
            out.append({"index": 0, "delta": {"content": t}, "logprobs": lp, "finish_reason": None})
        else:
            lp = {"tokens": [t], "token_logprobs": [-rng.random() * 3], "text_offset": [0],
                  "top_logprobs": [{a: -rng.random() * 10 for a in alts} if top else None]}
            out.append({"index": 0, "text": t, "logprobs": lp, "finish_reason": None})
    return out


def _request(chat: bool) -> oa.GenerationRequest:
    body = ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True} if chat
            else {"model": "tiny", "prompt": "x", "logprobs": 1})
    cfg = demo_config()
    cfg = dataclasses.replace(cfg, pools=tuple(dataclasses.replace(p, logprobs=True) for p in cfg.pools))
    return oa.finish_request(oa.parse_request("chat" if chat else "completion", body, cfg), 2)


def measure(chat: bool, top: int, n: int, rounds: int) -> tuple[float, float, float]:
    """(bytes, worker us, frontend us) a token."""
    rng = random.Random(top)
    choices = server_choices(chat, top, n, rng)
    req = _request(chat)
    texts = [c["delta"]["content"] if chat else c["text"] for c in choices]
    worker_s = frontend_s = float("inf")
    packed: list[str] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        packed = [pack(texts[i], logprobs=choice_logprobs(c, chat, "")) for i, c in enumerate(choices)]
        worker_s = min(worker_s, time.perf_counter() - t0)
        # the frontend: each push a chunk (as a streamed answer forwards them), with and without
        frontend_s = min(frontend_s, _frontend(req, packed) - _frontend(req, texts))
    extra = sum(len(p.encode()) for p in packed) - sum(len(t.encode()) for t in texts)
    return extra / n, worker_s / n * 1e6, max(frontend_s, 0.0) / n * 1e6


def _frontend(req: oa.GenerationRequest, pushes: list[str]) -> float:
    t0 = time.perf_counter()
    offset = 0
    for text in pushes:
        for piece in unpack_in_order(text):
            probs = oa.logprobs_object(req, piece.logprobs, offset) if piece.logprobs else None
            offset += len(piece.content)
            oa.sse(oa.chunk(req, "r", 0, text=piece.content, logprobs=probs))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    rows = []
    print(f"{'endpoint':<11}{'top':>4}{'bytes':>8}{'worker us':>11}{'frontend us':>13}   (a token)")
    for chat in (True, False):
        for top in TOPS:
            size, worker_us, frontend_us = measure(chat, top, a.tokens, a.rounds)
            rows.append({"endpoint": "chat" if chat else "completion", "top": top, "bytes": size,
                         "worker_us": worker_us, "frontend_us": frontend_us})
            print(f"{rows[-1]['endpoint']:<11}{top:>4}{size:>8.0f}{worker_us:>11.1f}{frontend_us:>13.1f}")
    return rows


if __name__ == "__main__":
    main()
