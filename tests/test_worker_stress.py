"""A stress of the step worker: one sim worker with 4 slots and 600 KV tokens (preemptions for
slots and for KV) serving 50 requests of three classes and three tenants, with stop strings
and cancels: every answer not cancelled is whole, exactly once (Client.read checks the
offsets), cut at its stop, every cancelled one reaches a final state, and nothing stays held.
STRESS_SEEDS=N runs more seeds (40 passed in ~9 s)."""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from limiter.prompt import Payload, count_tokens
from tests.support.helpers import wait_until
from tests.support.worker_helpers import FE, Answer, Client, sim_text, worker
from worker.engines.sim import SimEngine

FINAL = ("cancelled", "done", "failed", "expired")


async def admit(c: Client, rid: str, prompt: str, cls: str, mt: int, stop: tuple[str, ...],
                tenant: str) -> None:
    payload = Payload("completion", prompt, mt, temperature=0.0, stop=stop, seed=1, grouped_tokens=True)
    await c.scripts.admit(c.keys, request_id=rid, tenant=tenant, cls=cls, input_tokens=count_tokens(prompt),
                          max_tokens=mt, tenant_rate=1e9, tenant_burst=1e9, tenant_max_inflight=0,
                          max_wait_ms=0, frontend_id=FE, payload=payload.pack())
    c.answers[rid] = Answer()


@pytest.mark.parametrize("seed", range(int(os.environ.get("STRESS_SEEDS", "6"))))
async def test_preemption_stress_every_answer_whole_and_exactly_once(worker_env, seed: int) -> None:
    cfg, c = worker_env
    rng = random.Random(seed)
    want: dict[str, tuple[str, int, str]] = {}
    cancelled: dict[str, str] = {}
    tenants: dict[str, str] = {}
    async with worker(cfg, engine_obj=SimEngine(time_scale=rng.choice([0.0, 0.02]), kv_capacity_tokens=600),
                      max_seqs=4, token_budget=64, flush_tokens=rng.choice([1, 3, 16]), flush_ms=5,
                      claim_ahead=rng.choice([0, 1, 2])) as rt:
        for i in range(50):
            prompt = "p" * rng.randint(1, 120) + str(i)
            mt = rng.randint(1, 80)
            cls = rng.choice(["P0", "P1", "P2"])
            stop = rng.choice([(), ("output",), ("d o", "zz"), ("lated out",)])
            rid = f"s{seed}-{i}"
            tenants[rid] = rng.choice(["a", "b", "b", "b", "c"])
            await admit(c, rid, prompt, cls, mt, stop, tenants[rid])
            full = sim_text(prompt, 0, mt)
            cut = min([full.find(s) for s in stop if s in full], default=-1)
            want[rid] = (full if cut < 0 else full[:cut], mt, "stop" if cut >= 0 else "length")
            if rng.random() < 0.1:
                await asyncio.sleep(rng.random() * 0.02)
            if rng.random() < 0.1:
                victim = f"s{seed}-{rng.randint(0, i)}"
                res = await c.scripts.cancel(c.keys, victim, tenants[victim])
                if not res.startswith("final"):
                    cancelled[victim] = res
        await c.wait([r for r in want if r not in cancelled], timeout=60)
        for r, res in cancelled.items():  # each cancelled one reaches a final state
            deadline = time.monotonic() + 10
            while (await c.record(r)).get("state") not in FINAL:
                assert time.monotonic() < deadline, f"{r} (cancel said {res}) not final: {await c.record(r)}"
                await asyncio.sleep(0.02)
        await wait_until(lambda: not rt.held, "nothing held", timeout=10)
    for rid, (text, mt, fin) in want.items():
        a = c.answers[rid]
        if rid in cancelled:
            continue
        assert a.error is None, (rid, a.error)
        assert a.done["fin"] == fin, (rid, a.done)
        assert a.text == text, (rid, a.text, text)
        assert a.tokens == mt or fin == "stop", (rid, a.tokens, mt)
