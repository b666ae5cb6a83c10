"""Latency samples: one per finished request, values consistent with what Redis and the
client saw (request record times, reply-stream entry times), readable by the SLO monitor."""

from __future__ import annotations

import pytest

from limiter.prompt import count_tokens
from limiter.samples import decode_sample
from tests.support.worker_helpers import worker

# The sample times the engine producing a token; Redis records when its push landed: one
# round trip later, plus however long this machine kept the worker from running (31 ms was
# seen beside two busy loops). So the sample is never later than Redis (beyond the local
# estimate of Redis time, good to ~1 ms), and never earlier than the sim's cost model allows:
# every step takes at least its fixed cost (10 ms at time scale 1).
CLOCK_MS = 2.0
STEP_MIN_MS = 10.0


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
        # TTFT: the first token is pushed at once, so Redis's first_ms is the reference; it
        # comes at least one step after the claim
        assert claimed - enq + STEP_MIN_MS - CLOCK_MS <= s["ttft_ms"] <= first - enq + CLOCK_MS, (s, rec)
        n = a.tokens
        last = s["ttft_ms"] + s["tpot_mean_ms"] * (n - 1)  # the last token, from enqueue
        assert s["ttft_ms"] + STEP_MIN_MS * (n - 1) - CLOCK_MS <= last <= s["e2e_ms"] + CLOCK_MS, (s, rec)
        assert s["e2e_ms"] <= finished - enq + CLOCK_MS and s["ts_ms"] <= finished + CLOCK_MS, (s, rec)
        assert STEP_MIN_MS - CLOCK_MS <= s["tpot_mean_ms"] <= s["tpot_max_ms"]
        # TPOT against the client's view: first push (first token) to the final entry (last
        # token), over n - 1 gaps; each end landed in Redis late by these (a loaded machine's
        # delays spread over the n - 1 gaps)
        lag_first, lag_last = first - enq - s["ttft_ms"], finished - enq - last
        stream_tpot = (a.times_ms[-1] - a.times_ms[0]) / (n - 1)
        slack = 1.0 + 0.1 * stream_tpot + (lag_first + lag_last) / (n - 1)
        assert abs(s["tpot_mean_ms"] - stream_tpot) <= slack, (s, stream_tpot, lag_first, lag_last)
        decoded = decode_sample(s, ["P0", "P1", "P2"])  # the controller's reader accepts it
        assert decoded.ttft_ms == s["ttft_ms"]
