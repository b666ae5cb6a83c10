"""Latency samples: one per finished request, values consistent with what Redis and the
client saw (request record times, reply-stream entry times), readable by the SLO monitor."""

from __future__ import annotations

import pytest

from limiter.prompt import count_tokens
from limiter.samples import decode_sample
from tests.support.worker_helpers import worker

# The sample times the engine producing a token; Redis records when its push landed (one
# round trip later, more on a loaded 2-core test box). The local estimate of Redis time is
# good to ~1 ms, so the sample may be up to SLACK_MS earlier than Redis, never later.
SLACK_MS = 30.0


def close(sample_ms: float, redis_ms: float) -> bool:
    return -2.0 <= redis_ms - sample_ms <= SLACK_MS


@pytest.fixture
def env(worker_env):
    return worker_env


async def test_samples_match_the_request_record_and_the_reply_stream(env) -> None:
    cfg, c = env
    async with worker(cfg, engine="sim", time_scale=1.0) as rt:  # ~11 ms decode steps
        ids = [await c.admit("interactive question", cls="P0", max_tokens=50),
               await c.admit("batch job " * 20, cls="P2", max_tokens=30)]
        await c.wait(ids, timeout=20)
    samples = {s["request_id"]: s for s in await c.samples()}
    assert sorted(samples) == sorted(ids)
    for rid in ids:
        s, rec, a = samples[rid], await c.record(rid), c.answers[rid]
        enq, claimed, first, finished = (int(rec[k]) for k in ("enq_ms", "claimed_ms", "first_ms",
                                                                "finished_ms"))
        assert s["v"] == 1 and s["pool"] == "tiny" and s["class"] == rec["class"] and s["tenant"] == "t1"
        assert s["outcome"] == "ok" and s["worker"] == rt.worker_id and s["attempt"] == 1
        assert s["engine"] == "sim" and s["simulated"] is True
        assert s["queue_wait_ms"] == claimed - enq
        assert s["input_tokens"] == int(rec["usage_in"]) == count_tokens(
            "interactive question" if rid == ids[0] else "batch job " * 20)
        assert s["output_tokens"] == int(rec["usage_out"]) == a.tokens
        # TTFT: the first token is pushed at once, so Redis's first_ms is the reference
        assert close(s["ttft_ms"], first - enq), (s, first - enq)
        assert close(s["e2e_ms"], finished - enq) and close(s["ts_ms"], finished), (s, finished - enq)
        # TPOT: first push (first token) to the final entry (last token), over n - 1 gaps
        stream_tpot = (a.times_ms[-1] - a.times_ms[0]) / (a.tokens - 1)
        assert abs(s["tpot_mean_ms"] - stream_tpot) <= 1.0 + 0.1 * stream_tpot, (s, stream_tpot)
        assert 5 <= s["tpot_mean_ms"] <= s["tpot_max_ms"] < 100
        decoded = decode_sample(s, ["P0", "P1", "P2"])  # the controller's reader accepts it
        assert decoded.ttft_ms == s["ttft_ms"]
