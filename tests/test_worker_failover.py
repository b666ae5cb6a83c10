"""Two real worker processes; one is killed with SIGKILL mid-stream.

Every request must complete exactly once, and what the client reassembles from the reply
stream must equal the uninterrupted output (fixed seeds, torch tiny model, greedy and
temperature > 0): the survivor resumes each stream by re-prefilling prompt + delivered
tokens, priming a fresh decoder, and sampling with position-keyed randomness.
The pool lease is 1 s, so takeover is quick; the takeover time is printed.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import redis.asyncio as aioredis
import torch

from tests.support.redis_server import RedisServer
from tests.support.worker_helpers import Client, config, spawn_worker, stop_process, write_config
from worker.batch_policy import Limits
from worker.engines.base import SamplingParams
from worker.engines.torch_engine import TorchEngine
from worker.local_run import LocalRequest, run_local

PROMPTS = [("Tell me a story about a dragon. ", 0.0, 11), ("Once upon a time, ", 0.8, 12),
           ("The quick brown fox ", 0.0, 13), ("Schöne Grüße aus Köln — ", 0.9, 14)]
MAX_TOKENS = 300


def reference() -> dict[str, tuple[list[int], str]]:
    """The uninterrupted outputs, from the same engine in this process."""
    torch.set_num_threads(1)
    engine = TorchEngine.from_preset("tiny", seed=0, kv_capacity_tokens=8192)
    reqs = [LocalRequest(f"k{i}", tuple(engine.encode(p)), SamplingParams(t, seed=s, max_tokens=MAX_TOKENS))
            for i, (p, t, s) in enumerate(PROMPTS)]
    run = asyncio.run(run_local(engine, reqs, Limits(token_budget=512, max_seqs=8)))
    return {rid: (tr.tokens, tr.text) for rid, tr in run.traces.items()}


async def test_kill_9_mid_stream_resumes_every_request_exactly_once(
        redis_server: RedisServer, sync_redis, tmp_path: Path) -> None:
    expected = await asyncio.to_thread(reference)
    url = redis_server.url
    worker_cfg = {"idle_block_s": 0.3, "heartbeat_s": 0.3, "reap_interval_s": 0.5}
    path = write_config(tmp_path / "qos.toml", url, lease_ms=1000, worker=worker_cfg)
    cfg = config(tmp_path / "qos.toml", url, lease_ms=1000, worker=worker_cfg)
    r = aioredis.from_url(url)
    client = Client(r, cfg)
    await client.setup()
    common = ["--engine", "torch", "--model", "tiny", "--seed", "0", "--torch-threads", "1", "--pool", "tiny"]
    procs = {w: spawn_worker(path, *common, "--worker-id", w, log=tmp_path / f"{w}.log")
             for w in ("wA", "wB")}
    try:
        deadline = time.monotonic() + 60
        while len(await r.zrange(client.keys.workers, 0, -1)) < 2:
            assert time.monotonic() < deadline, "workers did not start"
            assert all(p.poll() is None for p in procs.values())
            await asyncio.sleep(0.05)
        ids = []
        for i, (prompt, temp, seed) in enumerate(PROMPTS):
            ids.append(await client.admit(prompt, max_tokens=MAX_TOKENS, temperature=temp, seed=seed,
                                          rid=f"k{i}"))
        # wait until the streams are flowing, then kill whoever holds the most of them
        for rid in ids:
            await client.wait_tokens(rid, 20)
        records = [await client.record(rid) for rid in ids]
        owners = [rec["worker"] if rec["state"] == "leased" else "" for rec in records]
        victim = max(procs, key=owners.count)
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait()
        sec, usec = await r.time()
        killed_ms = int(sec) * 1000 + int(usec) // 1000
        survivor = next(w for w in procs if w != victim)
        before = {rid: client.answers[rid].tokens for rid in ids}
        await client.wait(ids, timeout=60)

        moved = [rid for rid, o in zip(ids, owners, strict=True) if o == victim]
        assert moved, owners
        for rid in ids:
            a = client.answers[rid]
            tokens, text = expected[rid]
            assert a.error is None, a.error
            assert a.text == text, (rid, a.text, text)
            assert await client.generated(rid) == tokens
            assert a.tokens == len(tokens) and int(a.done["out"]) == len(tokens)
            rec = await client.record(rid)
            assert rec["state"] == "done" and rec["worker"] == (survivor if rid in moved else rec["worker"])
        # exactly once: one final entry per request (Client asserts contiguous offsets), one sample each
        samples = await client.samples()
        assert sorted(s["request_id"] for s in samples) == sorted(ids)
        assert all(s["outcome"] == "ok" for s in samples)
        resumed = [s for s in samples if s["request_id"] in moved]
        for s in resumed:  # the first token came from the dead worker: TTFT is Redis's first_ms - enq_ms
            rec = await client.record(s["request_id"])
            assert s["attempt"] == 2 and s["ttft_ms"] == int(rec["first_ms"]) - int(rec["enq_ms"])
        # takeover: kill -> first token of attempt 2, on the Redis clock; a stream the victim had
        # sent whole before it died has no token left to resume: its attempt 2 only finishes it
        firsts = []
        for rid in moved:
            a = client.answers[rid]
            resumed_at = [t for t, att in zip(a.times_ms, a.attempts, strict=True) if att == 2]
            firsts.append(min(resumed_at) if resumed_at else int((await client.record(rid))["finished_ms"]))
        takeover_ms = min(firsts) - killed_ms
        at = [before[r] for r in moved]
        print(f"\n[failover] killed {victim} holding {len(moved)} streams at {at} tokens;"
              f" first resumed token {takeover_ms} ms later (lease 1000 ms); outputs identical")
        assert stop_process(procs[survivor]) == 0  # SIGTERM: drains and exits 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        await r.aclose()
