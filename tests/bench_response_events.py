"""What the Responses API's event stream costs the frontend beside a chat's chunks, measured:
``python tests/bench_response_events.py``.

Builds one streamed answer of ``--tokens`` text deltas (``--chars`` characters each), as the
frontend writes it, both ways: a chat's ``chat.completion.chunk`` stream (the role opener, a
chunk a delta, the finish, ``[DONE]``: limiter/frontend/openai_api.py) and a Responses
stream (``response.created`` ... ``response.completed`` with the whole response:
limiter/frontend/responses_api.py ``ResponseEvents``). Prints the CPU microseconds and bytes
a delta of each, best of ``--rounds``. Pure CPU, no sockets: the figure is the shape's own
cost, not the path's (``qos bench overhead`` times the path). Not collected by pytest (no
``test_`` prefix); docs/benchmarks.md quotes its output.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from limiter.config import demo_config
from limiter.frontend import openai_api as oa
from limiter.frontend.responses_api import ResponseEvents
from limiter.frontend.responses_request import ResponseShape


def _request() -> oa.GenerationRequest:
    cfg = demo_config()
    draft = oa.parse_request("chat", {"model": "tiny", "stream": True,
                                      "messages": [{"role": "user", "content": "hello"}]}, cfg)
    return oa.finish_request(draft, 5)


def chat_stream(req: oa.GenerationRequest, deltas: list[str]) -> int:
    out = [oa.sse(oa.chunk(req, "r1", 0, role=True))]
    out += [oa.sse(oa.chunk(req, "r1", 0, text=d)) for d in deltas]
    out += [oa.sse(oa.chunk(req, "r1", 0, reason="stop")), oa.sse("[DONE]")]
    return sum(map(len, out))


def responses_stream(req: oa.GenerationRequest, deltas: list[str]) -> int:
    ev = ResponseEvents(ResponseShape(), req, "resp_1", 0)
    out = ev.opening()
    for d in deltas:
        out += ev.text(d)
    out += ev.end("stop", 5, len(deltas))
    return sum(map(len, out))


def measure(build, req: oa.GenerationRequest, deltas: list[str], rounds: int) -> tuple[float, int]:
    """(best CPU microseconds a delta, bytes a delta) over ``rounds`` rounds of ~0.2 s."""
    best, size = float("inf"), 0
    for _ in range(rounds):
        n, t0 = 0, time.process_time()
        while time.process_time() - t0 < 0.2:
            size = build(req, deltas)
            n += 1
        best = min(best, (time.process_time() - t0) / n / len(deltas) * 1e6)
    return best, size // len(deltas)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="text deltas an answer (default 256)")
    ap.add_argument("--chars", type=int, default=4, help="characters a delta (default 4)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default 5; the best is the figure)")
    a = ap.parse_args()
    for name in ("tokens", "chars", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
    req, deltas = _request(), [("abcd" * a.chars)[: a.chars]] * a.tokens
    for name, build in (("chat chunks", chat_stream), ("responses events", responses_stream)):
        us, size = measure(build, req, deltas, a.rounds)
        print(f"{name:>16}: {us:.2f} us of CPU and {size} bytes a delta "
              f"({a.tokens} deltas of {a.chars} chars)")


if __name__ == "__main__":
    main()
