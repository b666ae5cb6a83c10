"""BatchScheduler's step: how preemption and admission play out when several requests wait."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from worker.batch_policy import Limits, floor_slots, kv_demand
from worker.batch_scheduler import ADMISSION_ROUNDS, BatchScheduler
from worker.engines.base import SamplingParams
from worker.engines.sim import SimEngine
from worker.tokenizer import encode


async def _full_of_p2(sched: BatchScheduler, n: int) -> None:
    """``n`` P2 requests decoding (their prompts prefilled), filling the batch."""
    for i in range(n):
        sched.add(f"p2-{i}", encode("x" * 20), SamplingParams(max_tokens=500), class_rank=2, arrival=i)
    for _ in range(100):
        if all(s.running and s.to_prefill == 0 for s in sched._seqs.values()):
            return
        await sched.step()
    raise AssertionError("the P2 requests never all reached their decode")


@pytest.mark.parametrize(("k", "kv_capacity"), [(1, 1 << 20), (3, 1 << 20), (4, 1 << 20), (3, 80)])
def test_p0_requests_arriving_together_at_a_full_batch_all_start_in_the_next_step(
        k: int, kv_capacity: int) -> None:
    """k P0 requests arrive together at a batch full of P2 decoders: the next step pauses k
    of them and starts all k P0s (each P0's first token comes after one step, not after k).
    With KV for two 30-token prompts beside one P2 (80 tokens), the first P0 fits as is
    and the second in the same step once the P2's KV is freed. Room was made for the head
    of the waiting set only, and the k-th P0 waited k steps while the P2s decoded."""
    async def go() -> tuple[BatchScheduler, set[str], set[str], set[str]]:
        sched = BatchScheduler(SimEngine(time_scale=0, kv_capacity_tokens=kv_capacity),
                               Limits(token_budget=256, max_seqs=4, kv_capacity=kv_capacity))
        await _full_of_p2(sched, 4 if kv_capacity > 1000 else 1)
        for i in range(k):
            sched.add(f"p0-{i}", encode("y" * 30), SamplingParams(max_tokens=5), class_rank=0,
                      arrival=100 + i)
        res = await sched.step()
        return sched, set(res.admitted), set(res.preempted), set(res.produced)

    sched, admitted, paused, produced = asyncio.run(go())
    p0 = {f"p0-{i}" for i in range(k)}
    if kv_capacity > 1000:
        assert admitted == p0 and len(paused) == k and all(r.startswith("p2-") for r in paused)
        assert p0 <= produced  # each P0's prompt went in and gave its first token in this step
    else:
        assert admitted == {"p0-0", "p0-1"} and paused == {"p2-0"} and sched.recompute_tokens > 0


def test_the_admission_rounds_of_one_step_are_bounded() -> None:
    """20 P0s at a batch full of 20 P2s: one step starts 1 + ADMISSION_ROUNDS of them (each
    round is O(sequences): 256 against 256 made one step of 0.75 s), the next steps the rest."""
    async def go() -> list[int]:
        sched = BatchScheduler(SimEngine(time_scale=0), Limits(token_budget=512, max_seqs=20))
        await _full_of_p2(sched, 20)
        for i in range(20):
            sched.add(f"p0-{i}", encode("y" * 5), SamplingParams(max_tokens=50), class_rank=0,
                      arrival=100 + i)
        return [len((await sched.step()).admitted) for _ in range(3)]

    assert asyncio.run(go()) == [1 + ADMISSION_ROUNDS, 1 + ADMISSION_ROUNDS, 20 - 2 * (1 + ADMISSION_ROUNDS)]


def test_requests_of_one_class_are_not_paused_for_each_other() -> None:
    """Admission rounds in one step never pause a sequence for one of its own class and
    tenant: with the batch full of P0s, a newly arrived P0 waits for a slot."""
    async def go() -> tuple[set[str], set[str]]:
        sched = BatchScheduler(SimEngine(time_scale=0), Limits(token_budget=256, max_seqs=2))
        for i in range(2):
            sched.add(f"a-{i}", encode("x" * 10), SamplingParams(max_tokens=50), class_rank=0, arrival=i)
        await sched.step()
        sched.add("late", encode("y" * 10), SamplingParams(max_tokens=5), class_rank=0, arrival=9)
        res = await sched.step()
        return set(res.admitted), set(res.preempted)

    assert asyncio.run(go()) == (set(), set())


async def _light_beside_flood(lower_stream: bool) -> tuple[int, int, int]:
    """A flood tenant's three 400-token prompts hold a class's KV (3 x 400 of 1,500 tokens);
    with ``lower_stream``, a short P2 stream runs beside them. After 10 steps a light tenant's
    300-token request of the flood's class arrives: (the step of its first token, the step it
    finished, the sequences paused meanwhile)."""
    kv = 1500
    sched = BatchScheduler(SimEngine(time_scale=0, kv_capacity_tokens=kv),
                           Limits(token_budget=512, max_seqs=8, kv_capacity=kv))
    for i in range(3):
        sched.add(f"f{i}", encode("x" * 400), SamplingParams(max_tokens=400), class_rank=1, arrival=i,
                  tenant="flood")
    if lower_stream:
        sched.add("p2", encode("z" * 5), SamplingParams(max_tokens=1000), class_rank=2, arrival=3)
    for _ in range(10):
        await sched.step()
    sched.add("light", encode("y" * 300), SamplingParams(max_tokens=10), class_rank=1, arrival=100,
              tenant="light")
    paused_before, first = sched.preemptions, 0
    for step in range(1, 200):
        res = await sched.step()
        if "light" in res.produced and not first:
            first = step
        if "light" not in sched:
            return first, step, sched.preemptions - paused_before
    raise AssertionError("the light request never finished")


def test_a_light_tenant_beside_a_flood_holding_the_kv_starts_at_once_and_nothing_churns() -> None:
    """A flood tenant's three long prompts hold a class's KV (3 x 400 of 1,500 tokens, room
    for ~100 steps of growth); a light tenant's 300-token request of the same class arrives.
    It starts within a step or two (it waited ~90 steps, until the flood's growth paused one
    of its own), finishes long before the flood, and the flood gives up one sequence for it,
    not one a step."""
    first, done, paused = asyncio.run(_light_beside_flood(lower_stream=False))
    assert first <= 2 and done <= 20, (first, done)
    assert paused <= 2, paused


def test_a_light_tenant_beside_a_flood_holding_the_kv_starts_at_once_beside_a_lower_class_stream() -> None:
    """As above, with a short P2 stream running beside the flood: pausing it alone does not
    make room for the light request, so it was not paused, and rule 3 (the flood gives up a
    sequence) was never asked while a lower class ran: the light request's first token came
    67 steps later, when the flood's growth paused the P2 and then one of the flood's own."""
    first, done, _paused = asyncio.run(_light_beside_flood(lower_stream=True))
    assert first <= 2 and done <= 20, (first, done)


def test_a_second_light_tenant_gets_the_kv_a_flood_sequence_paused_for_the_first_one_kept() -> None:
    """A flood holds a class's three slots; a light tenant's request takes one of them (the
    flood's sequence paused, its KV kept), then a second light tenant's long prompt needs
    that kept KV and one more flood sequence's. It starts at once (two budget slices to its
    first token); the kept KV was never counted, and it waited 76 steps for the flood's growth."""
    async def go(prompt: int) -> int:
        kv = 1000
        sched = BatchScheduler(SimEngine(time_scale=0, kv_capacity_tokens=kv),
                               Limits(token_budget=512, max_seqs=3, kv_capacity=kv))
        for i in range(3):
            sched.add(f"f{i}", encode("x" * 240), SamplingParams(max_tokens=700), class_rank=1, arrival=i,
                      tenant="A")
        for _ in range(3):
            await sched.step()
        sched.add("b", encode("y" * 50), SamplingParams(max_tokens=700), class_rank=1, arrival=10, tenant="B")
        res = await sched.step()
        assert res.preempted == ("f2",) and sched.seq("f2").resident  # a slot was short: KV kept
        sched.add("c", encode("z" * prompt), SamplingParams(max_tokens=10), class_rank=1, arrival=11,
                  tenant="C")
        for step in range(1, 200):
            if "c" in (await sched.step()).produced:
                return step
        raise AssertionError("the second light request never started")

    assert asyncio.run(go(300)) == 1  # the flood sequence alone makes room, as before
    assert asyncio.run(go(550)) == 2


@pytest.mark.parametrize("beside", ["p2", "p1"])
def test_a_request_gets_the_kv_a_later_request_of_its_class_paused_for_a_p0_kept(beside: str) -> None:
    """Two P0s take two of three slots from a P1 (``a``) and, beside it, a later P1 (``x``)
    and a P2 stream (``beside="p2"``) or a second later P1 (``"p1"``): both paused, their KV
    kept. The P0s end; then a P1 that arrived before ``x`` (a request handed back by another
    worker) needs KV that those kept caches hold. It starts at once: ``x``'s kept KV (which
    could only run after it) is freed. Rule 2 counted only the P2's kept KV, and the rule
    for a batch of the head's class counted none without a rich tenant: nobody moved, two
    slots stood empty, and the P1 waited 595 steps, until ``a`` ended."""
    async def go() -> int:
        kv = 1000
        sched = BatchScheduler(SimEngine(time_scale=0, kv_capacity_tokens=kv),
                               Limits(token_budget=512, max_seqs=3, kv_capacity=kv))
        sched.add("a", encode("a" * 350), SamplingParams(max_tokens=600), class_rank=1, arrival=0)
        sched.add("x", encode("x" * 200), SamplingParams(max_tokens=600), class_rank=1, arrival=5)
        if beside == "p2":
            sched.add("p2", encode("l" * 100), SamplingParams(max_tokens=600), class_rank=2, arrival=6)
        else:
            sched.add("b", encode("b" * 250), SamplingParams(max_tokens=600), class_rank=1, arrival=4)
        for _ in range(3):
            await sched.step()
        for i in range(2):
            sched.add(f"h{i}", encode("h" * 10), SamplingParams(max_tokens=3), class_rank=0, arrival=10 + i)
        res = await sched.step()
        assert sorted(res.preempted) == sorted(["x", "p2" if beside == "p2" else "b"]), res.preempted
        assert all(s.resident for s in sched.waiting), "a slot was short: their KV kept"
        for _ in range(20):
            if "h0" not in sched and "h1" not in sched:
                break
            await sched.step()
        else:
            raise AssertionError("the P0s never finished")
        sched.add("y", encode("y" * 500), SamplingParams(max_tokens=10), class_rank=1, arrival=1)
        for step in range(1, 1000):
            if "y" in (await sched.step()).produced:
                return step
        raise AssertionError("the P1 never started")

    assert asyncio.run(go()) == 1


# --- starvation floors on the worker --------------------------------------------------------------


async def _floor_beside_a_p0_flood(floor_slots: tuple[int, ...], steps: int,
                                   by_floor: bool = True) -> tuple[int | None, list[int], int]:
    """A batch of 4 kept full of P0 streams (a new P0 arrives whenever fewer than 6 are
    held); after 5 steps one P1 request arrives, claimed by its floor (``by_floor``). (The
    step it finished at, or None; the P0s running at each step while it was held; the
    sequences paused meanwhile.)"""
    sched = BatchScheduler(SimEngine(time_scale=0),
                           Limits(token_budget=256, max_seqs=4, floor_slots=floor_slots))
    n = 0
    p0_running: list[int] = []
    for step in range(1, steps + 1):
        while sum(1 for s in sched._seqs.values() if s.class_rank == 0) < 6:
            sched.add(f"p0-{n}", encode("x" * 40), SamplingParams(max_tokens=30), class_rank=0, arrival=n)
            n += 1
        if step == 6:
            paused = sched.preemptions
            sched.add("p1", encode("y" * 40), SamplingParams(max_tokens=20), class_rank=1, arrival=step - 100,
                      by_floor=by_floor)
        await sched.step()
        if step >= 6:
            if "p1" not in sched:
                return step, p0_running, sched.preemptions - paused
            p0_running.append(sum(1 for s in sched.running if s.class_rank == 0))
    return None, p0_running, sched.preemptions - paused


def test_a_floor_class_request_runs_beside_a_p0_flood_that_keeps_the_batch_full() -> None:
    """P1's floor keeps one of the 4 slots (0.3 x 4, rounded down) for requests claim hands
    out by the floor: such a request starts at once beside a P0 flood and ends after its 20
    tokens, while P0 keeps the other 3 slots. In the strict class order it waited, unstarted,
    as long as the flood went on (300 steps here; on a stack, until its client timed out:
    docs/scheduling.md), and so does a P1 claimed otherwise. Seeded: without the floor's
    sequence kept against P0 it was paused and readmitted in turn (180 pauses in 20 steps)."""
    done, p0, paused = asyncio.run(_floor_beside_a_p0_flood((0, 1, 0), 300))
    assert done is not None and done <= 6 + 25, done
    assert p0 and min(p0) == 3 and max(p0) == 3, p0
    assert paused == 1, paused  # one P0 for the P1's slot, and no pausing back and forth
    never, _, _ = asyncio.run(_floor_beside_a_p0_flood((), 300))
    assert never is None
    # claimed otherwise (its class above its floor pool-wide): the class order, as before
    otherwise, _, _ = asyncio.run(_floor_beside_a_p0_flood((0, 1, 0), 300, by_floor=False))
    assert otherwise is None


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_slots_kv_and_floors_and_every_request_finishes(seed: int, monkeypatch) -> None:
    """Random arrivals (classes, tenants, prompts, lengths) at random limits and floors: at
    every step's plan the running set fits the slots and the KV, a floor class holds
    min(its floor's slots, its sequences here claimed by its floor) of those running where
    KV is ample, and
    every request finishes with its max_tokens (nothing here stops early)."""
    import worker.batch_scheduler as bs

    rng = random.Random(seed)
    max_seqs = rng.randint(1, 6)
    ample = rng.random() < 0.5
    kv = 1 << 20 if ample else rng.randint(400, 1500)
    floors = rng.choice([(0.0, 0.3, 0.05), (0.0, 0.5, 0.5), (0.2, 0.3, 0.3), (0.0, 0.0, 0.0),
                         (0.0, 0.0, 1.0)])
    limits = Limits(token_budget=64, max_seqs=max_seqs, kv_capacity=kv,
                    floor_slots=floor_slots(floors, max_seqs))
    sched = BatchScheduler(SimEngine(time_scale=0, kv_capacity_tokens=kv), limits)
    real_plan = bs.build_plan
    checked = {"plans": 0}

    def checked_plan(running: list, lim: Limits) -> object:  # the scheduler's own call
        assert len(running) <= max_seqs
        assert sched.kv_used <= kv and kv_demand(running, [s.candidate() for s in sched.waiting]) <= kv
        if ample:
            for r, q in enumerate(limits.floor_slots):
                here = sum(1 for s in sched._seqs.values() if s.class_rank == r and s.by_floor)
                held = sum(1 for s in running if s.class_rank == r and s.by_floor)
                assert held >= min(q, here), (r, q, here, held)
        checked["plans"] += 1
        return real_plan(running, lim)

    monkeypatch.setattr(bs, "build_plan", checked_plan)
    wanted: dict[str, int] = {}
    got: dict[str, int] = {}

    async def go() -> None:
        for step in range(20_000):
            if step < 200 and rng.random() < 0.4:
                for _ in range(rng.randint(1, 3)):
                    rid = f"r{len(wanted)}"
                    wanted[rid] = rng.randint(1, 40)
                    sched.add(rid, encode("x" * rng.randint(1, 150)), SamplingParams(max_tokens=wanted[rid]),
                              class_rank=rng.randint(0, 2), arrival=step, tenant=rng.choice(["", "a", "b"]),
                              by_floor=rng.random() < 0.5)
            if not len(sched):
                if step >= 200:
                    return
                continue
            res = await sched.step()
            for rid, e in res.emissions.items():
                got[rid] = got.get(rid, 0) + len(e.token_ids)
        raise AssertionError(f"{len(sched)} requests never finished")

    asyncio.run(go())
    assert checked["plans"] > 0
    assert got == wanted


def test_a_worker_s_scheduler_keeps_the_floors_of_its_classes() -> None:
    """The step worker's scheduler takes each class's floor from the classes it ranks requests
    by (ClassConfig.floor, what the pool policy carries to claim): P1 0.3 and P2 0.05 keep 1
    and 0 of 4 slots, 9 and 1 of 32; floors of 0 keep none (the strict class order)."""
    from limiter.config import DEFAULT_CLASSES
    from worker.claim_step_loop import build_scheduler
    from worker.settings import WorkerSettings

    assert [c.floor for c in DEFAULT_CLASSES] == [0.0, 0.3, 0.05]
    for max_seqs, kept in ((4, (0, 1, 0)), (32, (0, 9, 1))):
        limits = Limits(token_budget=256, max_seqs=max_seqs)
        sched = build_scheduler(SimEngine(time_scale=0), limits, WorkerSettings(), DEFAULT_CLASSES)
        assert sched.limits.floor_slots == kept
    none = [replace(c, floor=0.0) for c in DEFAULT_CLASSES]
    assert build_scheduler(SimEngine(time_scale=0), Limits(), WorkerSettings(), none).limits.floor_slots == ()
