"""Pure pieces of the worker: stop-string release, the scheduler's finish and resume rules,
settings validation, seeds, push batching and offset reconciliation."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Any

import pytest

from limiter.config import demo_config
from limiter.errors import ConfigError, InvalidArgument, LeaseLost
from limiter.prompt import Payload
from limiter.scripts import Claimed
from worker.batch_policy import (
    Candidate,
    Limits,
    SeqState,
    build_plan,
    choose_admissions,
    choose_preemption,
    kv_demand,
    prefill_through_behind,
)
from worker.batch_scheduler import BatchScheduler, resume_finish_reason
from worker.delivery import Delivery
from worker.engines.base import SamplingParams, request_seed
from worker.engines.sim import CostModel, SimEngine
from worker.push_clock import PushClock
from worker.runtime import WorkerRuntime
from worker.settings import default_worker_id, load_settings
from worker.step_budget import BudgetConfig, StepBudget
from worker.textstream import StopScanner
from worker.tokenizer import EOS_ID, IncrementalDecoder, encode


def stream(text: str, stops: tuple[str, ...]) -> tuple[str, list[int], bool]:
    """Feed ``text`` byte by byte (as a byte-level model emits it); return what is released."""
    sc, dec = StopScanner(stops), IncrementalDecoder()
    out, ids = "", []
    for b in text.encode():
        rel = sc.feed(b, dec.feed([b]))
        out += rel.text
        ids += rel.token_ids
        if rel.stopped:
            return out, ids, True
    rel = sc.finish(dec.flush())
    return out + rel.text, ids + rel.token_ids, rel.stopped


@pytest.mark.parametrize("seed", range(60))
def test_stop_scanner_matches_the_reference_cut(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab\nxé€ "
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                  for _ in range(rng.randint(0, 3)))
    out, ids, stopped = stream(text, stops)
    hits = [text.find(s) for s in stops if s in text]
    expect = text[: min(hits)] if hits else text
    assert out == expect and stopped == bool(hits)
    assert text.encode().startswith(bytes(ids))  # released ids are the generated ones, in order
    if not hits:
        assert bytes(ids) == text.encode()  # nothing lost


def test_tokens_are_held_back_with_their_text() -> None:
    sc, dec = StopScanner(("END",)), IncrementalDecoder()
    released = []
    for b in b"abcdE":
        released += sc.feed(b, dec.feed([b])).token_ids
    # 'E' and the two characters before it might start "END": kept back, tokens too
    assert bytes(released) == b"abc"[: len(released)] and sc.pending_tokens >= 2


def test_scheduler_resume_primes_the_decoder_and_counts_max_tokens() -> None:
    # "é" is two bytes: the earlier attempt delivered only the first one
    eng = SimEngine(time_scale=0)
    sched = BatchScheduler(eng, Limits())
    partial = list("é".encode())[:1]
    seq = sched.add("r", encode("hi", bos=True), SamplingParams(max_tokens=3), class_rank=0, arrival=0,
                    generated=partial)
    assert seq.decoder.feed([list("é".encode())[1]]) == "é"  # the primed decoder completes it
    assert resume_finish_reason([1, 2, 3], 3, EOS_ID) == "length"
    assert resume_finish_reason([1, EOS_ID], 9, EOS_ID) == "stop"
    assert resume_finish_reason([1], 9, EOS_ID) is None


class _GatedSim(SimEngine):
    """A sim engine whose steps, once begun (their plan checked), wait for ``gate``: what
    happens beside a running step."""

    def __init__(self) -> None:
        super().__init__(time_scale=0)
        self.gate = asyncio.Event()
        self.gate.set()

    async def _elapse(self, seconds: float) -> None:
        await self.gate.wait()


async def test_a_step_s_results_never_go_to_a_sequence_added_under_a_removed_ones_id() -> None:
    """A look-ahead claim runs beside the engine's step, and may hand back a request this
    worker still runs (its lease lapsed): the loop removes the old sequence and adds the new
    attempt under the same id while the step runs. That step's KV, prefill and tokens are the
    old sequence's: the new one must look as if it had been added between two steps (its
    prefill counted the old one's chunk, its KV the old one's token, and its re-prefill was
    taken for recomputation)."""
    prompt = encode("a prompt of a hundred bytes " * 4, bos=True)
    params = SamplingParams(max_tokens=50)
    eng = _GatedSim()
    sched = BatchScheduler(eng, Limits(token_budget=8, max_seqs=4))
    sched.add("d", encode("hi", bos=True), params, class_rank=0, arrival=0)
    sched.add("p", prompt, params, class_rank=0, arrival=1)  # prefilled in slices, beside d
    while not (sched._seqs["d"].decoding and sched._seqs["d"].generated):
        await sched.step()
    assert sched._seqs["p"].to_prefill > 0  # still prefilling: the next step takes a slice of it

    reference = BatchScheduler(SimEngine(time_scale=0), Limits(token_budget=8, max_seqs=4))
    expected = {rid: reference.add(rid, ids, params, class_rank=0, arrival=2, generated=[7, 7])
                for rid, ids in (("p", prompt), ("d", encode("hi", bos=True)))}
    eng.gate.clear()
    step = asyncio.create_task(sched.step())
    while sched.running_plan is None:  # the step is in the engine
        await asyncio.sleep(0)
    assert "p" in {c.request_id for c in sched.running_plan.prefill} and "d" in sched.running_plan.decode
    for rid, ids in (("p", prompt), ("d", encode("hi", bos=True))):
        sched.remove(rid)
        sched.add(rid, ids, params, class_rank=0, arrival=2, generated=[7, 7])
    eng.gate.set()
    res = await step
    assert "p" not in res.fresh_prefill and "p" not in res.emissions and "d" not in res.emissions
    for rid, want in expected.items():
        got = sched._seqs[rid]
        assert (got.generated, got.kv_tokens, got.kv_high, got.to_prefill, got.running, got.resident) == \
            (want.generated, want.kv_tokens, want.kv_high, want.to_prefill, want.running, want.resident), rid
    # ...and the new attempts run as any other would (both end at max_tokens, resumed tokens counted)
    out = await _run(sched)
    assert len(out["p"]) == len(out["d"]) == 48



class _FailingGatedSim(_GatedSim):
    """A gated sim whose step, once let go, raises (``fail``)."""

    fail = False

    async def _elapse(self, seconds: float) -> None:
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("the engine's step failed")


@pytest.mark.parametrize("end", ["raises", "cancelled"])
async def test_ids_removed_during_a_step_that_never_ended_are_credited_in_the_next(end: str) -> None:
    """The ids removed while a step ran are forgotten however that step ends: a step that
    raised or was cancelled must not leave them to the next step, whose results for a
    request added under such an id (between the two steps, the usual way) are its own."""
    eng = _FailingGatedSim()
    sched = BatchScheduler(eng, Limits(token_budget=8, max_seqs=4))
    params = SamplingParams(max_tokens=20)
    sched.add("a", encode("hi", bos=True), params, class_rank=0, arrival=0)
    await sched.step()
    eng.gate.clear()
    step = asyncio.create_task(sched.step())
    while sched.running_plan is None:  # the step is in the engine
        await asyncio.sleep(0)
    sched.remove("a")
    if end == "cancelled":
        step.cancel()
    else:
        eng.fail = True
    eng.gate.set()
    with pytest.raises(asyncio.CancelledError if end == "cancelled" else RuntimeError):
        await step
    eng.fail = False
    sched.add("a", encode("hi", bos=True), params, class_rank=0, arrival=1)
    res = await sched.step()
    assert res.fresh_prefill.get("a") == len(encode("hi", bos=True)) and "a" in res.emissions
    assert sched._seqs["a"].kv_tokens == len(encode("hi", bos=True))

async def _run(sched: BatchScheduler) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(2000):
        if not len(sched):
            return out
        res = await sched.step()
        for rid, e in res.emissions.items():
            out.setdefault(rid, []).extend(e.token_ids)
    raise AssertionError("the scheduler did not finish")


def test_the_planner_decides_the_same_from_the_scheduler_s_sequences_as_from_their_values() -> None:
    """The scheduler hands the planner its own sequences, read in place (batch_policy.Planned),
    not a SeqState of each: before every step, every planner function must decide from them
    what it decides from checked SeqState copies of them (SeqState's own checks, decoding iff
    nothing is left to prefill, run on each copy), through prefill slices, tenants sharing a
    class, preemption, admission and readmission."""
    limits = Limits(token_budget=16, max_seqs=4, kv_capacity=250)  # KV for under four whole requests

    def decide(running: list[Any], waiting: list[Candidate]) -> dict[str, Any]:
        return {"plan": build_plan(running, limits), "pause": choose_preemption(running, waiting, limits),
                "admit": choose_admissions(waiting, running, limits),
                "behind": prefill_through_behind(running), "kv": kv_demand(running, waiting)}

    async def go() -> tuple[int, set[str]]:
        sched = BatchScheduler(SimEngine(time_scale=0), limits)
        params = SamplingParams(max_tokens=30, seed=1)
        for rid, rank, tenant in (("a", 2, "t1"), ("b", 1, "t1"), ("d", 1, "t1"), ("f", 1, "t1")):
            sched.add(rid, encode("x" * 40), params, class_rank=rank, arrival=len(sched), tenant=tenant)
        checked, seen = 0, set()
        for n in range(400):
            if n == 2:  # a second tenant of the class, behind the first
                sched.add("e", encode("z" * 40), params, class_rank=1, arrival=8, tenant="t2")
            if n == 6:  # a P0 newcomer midway
                sched.add("c", encode("y" * 40), params, class_rank=0, arrival=9)
            if not len(sched):
                return checked, seen
            live = sched.running
            values = [SeqState(s.request_id, s.class_rank, s.arrival, s.to_prefill, s.decoding,
                               s.kv_tokens, s.tenant) for s in live]
            waiting = [s.candidate() for s in sched.waiting]
            decided = decide(live, waiting)
            assert decided == decide(values, waiting), (n, [s.request_id for s in live])
            seen.update(k for k, v in decided.items() if v and k != "plan")
            seen.update(("prefill",) if decided["plan"].prefill else ())
            checked += len(live)
            await sched.step()
        raise AssertionError("the six requests did not finish in 400 steps")

    checked, seen = asyncio.run(go())
    assert checked > 50
    assert seen == {"pause", "admit", "behind", "kv", "prefill"}, seen


def test_a_step_reports_the_engine_calls_times_and_the_first_time_prefill() -> None:
    async def go() -> list[Any]:
        sched = BatchScheduler(SimEngine(time_scale=0), Limits(token_budget=32, max_seqs=4))
        sched.add("a", encode("x" * 60), SamplingParams(max_tokens=3), class_rank=1, arrival=0)
        out = []
        while len(sched):
            t0 = time.perf_counter()
            res = await sched.step()
            out.append((t0, res, time.perf_counter()))
        return out

    steps = asyncio.run(go())
    for t0, res, t1 in steps:
        assert t0 <= res.start <= res.end <= t1  # the worker times TPOT and capacity from these
    assert sum(sum(r.fresh_prefill.values()) for _, r, _ in steps) == len(encode("x" * 60))  # each once


def test_the_top_class_prompt_is_prefilled_in_one_step_others_in_budget_slices() -> None:
    async def go(top_prefill: int) -> list[Any]:
        limits = Limits(token_budget=64, max_seqs=4)
        sched = BatchScheduler(SimEngine(time_scale=0), limits, None, top_prefill)
        sched.add("p0", encode("x" * 1000), SamplingParams(max_tokens=2), class_rank=0, arrival=0)
        sched.add("p2", encode("y" * 1000), SamplingParams(max_tokens=2), class_rank=2, arrival=0)
        return [await sched.step() for _ in range(3)]

    steps = asyncio.run(go(2048))
    assert [(c.request_id, c.length) for c in steps[0].plan.prefill] == [("p0", 1000)]
    assert steps[0].token_budget == 1000
    assert all(c.length <= 64 for r in steps[1:] for c in r.plan.prefill)  # P2: budget slices
    sliced = asyncio.run(go(0))[0]  # off: the top class is sliced like everyone
    assert [(c.request_id, c.length) for c in sliced.plan.prefill] == [("p0", 64)]


class CountingBudget(StepBudget):
    """A StepBudget that counts the steps it sized."""

    sized = 0

    def budget(self, decoding_ranks: Any) -> int:
        self.sized += 1
        return super().budget(decoding_ranks)


def test_a_step_that_prefills_nothing_is_not_sized() -> None:
    """Sizing a step (the cost fit's least squares) was the largest cost of a decode step's
    CPU. A step that prefills nothing is not sized: each decoder takes one token and a
    step's budget is never below max_seqs (Limits), so any budget gives the same plan. A
    step that prefills, a prompt arriving beside the decoders included, is sized."""
    async def go() -> tuple[CountingBudget, list[Any]]:
        budget = CountingBudget(BudgetConfig((50.0, None), min_budget=8, max_budget=64))
        budget.observe(0, 6, 60.0)  # 10 ms a token, no fit yet: the floor, 8 tokens a step
        sched = BatchScheduler(SimEngine(time_scale=0), Limits(token_budget=64, max_seqs=8), budget)
        steps = []
        for i in range(6):
            sched.add(f"r{i}", encode("hi"), SamplingParams(max_tokens=50), class_rank=0, arrival=i)
            steps += [await sched.step() for _ in range(2)]
        return budget, steps

    budget, steps = asyncio.run(go())
    prefilling = [r for r in steps if r.plan.prefill]
    decode_only = [r for r in steps if not r.plan.prefill]
    assert len(prefilling) == 6 and len(decode_only) == 6
    assert budget.sized == 6  # the prefill steps only
    assert prefilling[1].token_budget == 8  # sized beside a P0 decoder: the floor, still learning
    assert all(r.token_budget == 64 for r in decode_only)  # not sized: the configured maximum
    assert [len(r.plan.decode) for r in decode_only] == [1, 2, 3, 4, 5, 6]


def test_a_prompt_of_a_tenant_behind_in_its_class_goes_in_at_once_within_the_tpot_targets() -> None:
    """Beside a flood tenant's streams, a light tenant's prompt was prefilled in budget slices,
    each slice's step also carrying the flood's decoders: its TTFT was 1.6-2.4x its TTFT alone.
    It now goes in at once, as far as the decoders' TPOT targets allow (P1 150 ms, P0 50 ms,
    x 0.9), in a step that carries no prompt of the flood's (at a 2,048 cap those filled it to
    135 ms); alone, or with the extension off, it is sliced as before."""
    cost = CostModel(c0=0.010, c_prefill=60e-6, c_decode=1e-3, c_kv=0.0)

    def light_step(prompt_chars: int, *, flood: int = 6, p0: bool = False, top_prefill: int = 2048,
                   cap: int = 64, flood_prompt: int = 0) -> dict[str, int]:
        async def go() -> dict[str, int]:
            budget = StepBudget(BudgetConfig((50.0, 150.0, None), min_budget=16, max_budget=cap))
            rng = random.Random(1)
            for _ in range(60):  # a worker that has watched steps of this cost
                p, d = rng.randint(0, 1500), rng.randint(0, 16)
                budget.observe(p, d, 1e3 * cost.cost(p, d, 0))
            sched = BatchScheduler(SimEngine(time_scale=0, cost=cost), Limits(token_budget=cap, max_seqs=16),
                                   budget, top_prefill)
            for i in range(flood):
                sched.add(f"f{i}", encode("x" * 8), SamplingParams(max_tokens=50, eos_min_len=-1),
                          class_rank=1, arrival=i, tenant="flood")
            if p0:
                sched.add("p0", encode("x" * 8), SamplingParams(max_tokens=50, eos_min_len=-1), class_rank=0,
                          arrival=0)
            while len(sched) and (not sched.running or any(s.to_prefill for s in sched.running)):
                await sched.step()
            if flood_prompt:
                sched.add("fp", encode("z" * flood_prompt), SamplingParams(max_tokens=5), class_rank=1,
                          arrival=98, tenant="flood")
            sched.add("light", encode("y" * prompt_chars), SamplingParams(max_tokens=5), class_rank=1,
                      arrival=99, tenant="light")
            res = await sched.step()
            modelled_ms = 1e3 * cost.cost(res.plan.prefill_tokens, len(res.plan.decode), 0)
            target_ms = 0.9 * (50 if p0 else 150)
            assert not res.plan.decode or modelled_ms <= target_ms * 1.05, (modelled_ms, target_ms)
            return {c.request_id: c.length for c in res.plan.prefill}

        return asyncio.run(go())

    n = len(encode("y" * 1000))
    assert light_step(1000) == {"light": n}  # behind the flood (1 slot against 6): the whole prompt at once
    assert light_step(1000, flood=0) == {"light": 64}  # alone: budget slices
    assert light_step(1000, flood=2) == {"light": 64 - 2}  # one slot against two: not behind
    assert light_step(1000, top_prefill=0) == {"light": 64 - 6}  # the extension off
    assert 1000 < light_step(3000)["light"] < len(encode("y" * 3000))  # held to P1's 135 ms
    assert 200 < light_step(1000, p0=True)["light"] < 500  # a P0 decodes: held to its 45 ms
    # at a cap above what the light prompt needs, the step is sized to it: the flood's own
    # prompt waits for the next step (it used to fill the step up to P1's target)
    assert light_step(1000, cap=2048, flood_prompt=3000) == {"light": n}
    # nobody behind (one slot and its prompt against two): a full TPOT-sized step, both prompts
    assert light_step(1000, cap=2048, flood_prompt=3000, flood=1)["fp"] > 500


@pytest.mark.parametrize(("kv_capacity", "recomputed"), [(4096, False), (160, True)])
def test_a_paused_sequence_keeps_its_kv_when_it_can_and_finishes_the_same_either_way(
        kv_capacity: int, recomputed: bool) -> None:
    """One slot; a P0 arrival pauses the running P2 one. With KV to spare the P2 keeps its
    cache (nothing recomputed); with too little it is freed and re-prefilled on readmission.
    Either way the P2 request ends with the tokens it would have had alone."""
    async def go() -> tuple[BatchScheduler, dict[str, list[int]], list[int]]:
        solo = BatchScheduler(SimEngine(time_scale=0), Limits(token_budget=64, max_seqs=1))
        solo.add("low", encode("x" * 40), SamplingParams(max_tokens=60), class_rank=2, arrival=0)
        alone = (await _run(solo))["low"]
        sched = BatchScheduler(SimEngine(time_scale=0, kv_capacity_tokens=kv_capacity),
                               Limits(token_budget=64, max_seqs=1, kv_capacity=kv_capacity))
        sched.add("low", encode("x" * 40), SamplingParams(max_tokens=60), class_rank=2, arrival=0)
        for _ in range(5):
            await sched.step()
        sched.add("high", encode("y" * 120), SamplingParams(max_tokens=5), class_rank=0, arrival=1)
        return sched, await _run(sched), alone

    sched, out, alone = asyncio.run(go())
    assert sched.preemptions == 1
    assert (sched.recompute_tokens > 0) == recomputed
    assert out["low"][-len(alone):] == alone[-len(out["low"]):] and len(out["high"]) == 5


def test_scheduler_finishes_at_max_tokens_counting_resumed_ones() -> None:
    sched = BatchScheduler(SimEngine(time_scale=0), Limits())
    sched.add("r", encode("hi", bos=True), SamplingParams(max_tokens=5), class_rank=1, arrival=0,
              generated=[ord("x"), ord("y")])
    produced = []
    while len(sched):
        res = asyncio.run(sched.step())
        produced += list(res.produced.values())
    assert len(produced) == 3 and res.emissions["r"].finish_reason == "length"


def test_settings_errors_name_the_worker_field_and_ids_are_sanitised() -> None:
    cfg = demo_config()
    with pytest.raises(ConfigError, match=r"worker\.token_budget"):
        load_settings(cfg, {"max_seqs": 64, "token_budget": 32})
    with pytest.raises(ConfigError, match=r"worker\.bogus: unknown field"):
        load_settings(dataclasses.replace(cfg, worker={"bogus": 1}))
    with pytest.raises(ConfigError, match=r"worker\.engine"):
        load_settings(cfg, {"engine": "tpu"})
    with pytest.raises(ConfigError, match=r"worker\.upstream_url"):
        load_settings(cfg, {"engine": "openai"})
    s = load_settings(dataclasses.replace(cfg, worker={"max_seqs": 4, "token_budget": 64}), {"max_seqs": 8})
    assert s.max_seqs == 8 and s.token_budget == 64 and s.pool == "tiny"
    wid = default_worker_id("cuda:0")
    assert wid.endswith("-cuda_0") and ":" not in wid


@pytest.mark.parametrize(("field", "value"), [
    ("time_scale", float("inf")),  # the sim engine slept for ever each step
    ("time_scale", float("nan")),
    ("heartbeat_s", 1e-9),  # heartbeats as fast as Redis answers
    ("heartbeat_ttl_s", 1e12),  # an EXPIRE Redis refuses
    ("upstream_timeout_s", float("inf")),
    ("upstream_stall_s", -1.0),
    ("upstream_stall_s", float("nan")),
    ("torch_threads", 10**9),
    ("unstreamed_flush_ms", 0),  # an unstreamed request pushed every step
    ("unstreamed_flush_ms", float("inf")),  # never pushed: a lost worker's successor redoes it all
    # the base of an idle worker's only back-off against a backlog it cannot take: at 0 it
    # claimed flat out (1,617 claim scripts in a second in a review's run)
    ("claim_interval_ms", 0),
    ("kv_capacity_tokens", 10**12 + 1),  # claim refuses a KV room past 1e12: dead at its first claim
    # past torch.manual_seed's range: a traceback ("Overflow when unpacking long long") at start
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
])
def test_implausible_worker_settings_are_refused_naming_the_field(field, value) -> None:
    with pytest.raises(ConfigError, match=rf"worker\.{field}"):
        load_settings(demo_config(), {field: value})


@pytest.mark.parametrize("url", ["http://", "http://127.0.0.1:abc", "http://127.0.0.1:99999",
                                 "http://a b:8000", "https://:8000/v1"])
def test_an_upstream_url_with_no_host_or_a_bad_port_is_refused_naming_the_field(url) -> None:
    """Each passed the check of its scheme alone: the worker started, then every request it
    claimed failed at the upstream (yarl's ValueError) or the breaker retried for ever."""
    with pytest.raises(ConfigError, match=r"worker\.upstream_url"):
        load_settings(demo_config(), {"engine": "openai", "upstream_url": url})
    load_settings(demo_config(), {"engine": "openai", "upstream_url": "http://[::1]:8000/v1?api-key=a"})


def test_request_seed_is_stable_per_request() -> None:
    assert request_seed(None, "abc") == request_seed(None, "abc") != request_seed(None, "abd")
    assert request_seed(7, "abc") == 7 and 0 <= request_seed(None, "x") < 2**63


def _delivery() -> Delivery:
    c = Claimed("r1", "P1", "t1", 1, b"", 0, 5, 100, "fe1", 0, [], 0, 0)
    return Delivery(c, Payload("completion", "hi", 100), 1000, 0.0, 3, 1)


def test_push_batching_rules() -> None:
    d = _delivery()
    d.add([1], "a", 0.0)
    assert d.due(0.0, 50, 16)  # the first batch goes at once
    d.pushes = 1
    assert not d.due(0.01, 50, 16)
    assert d.due(0.045, 50, 16, step_s=0.01)  # would be older than 50 ms by the next step
    d.add(list(range(15)), "b" * 15, 0.02)
    assert d.due(0.02, 50, 16)  # 16 pending


def _pushed_once(cls: str, stream: bool) -> Delivery:
    """A request of class ``cls`` whose first token went out; 999 more pending since t=0."""
    c = Claimed("r1", cls, "t1", 1, b"", 0, 5, 10_000, "fe1", 0, [], 0, 0)
    d = Delivery(c, Payload("completion", "hi", 10_000, stream=stream), 1000, 0.0, 3, 1)
    d.add([1], "a", 0.0)
    d.pushes = 1
    d.pending_ids, d.pending_text, d.pending_tokens, d.pending_since = [], "", 0, None
    d.add(list(range(999)), "b" * 999, 0.0)
    return d


def test_an_unstreamed_requests_tokens_are_pushed_every_unstreamed_flush_ms_however_many() -> None:
    """A client that does not stream reads nothing before the end: after its first batch
    (at once, as for everyone) its tokens wait up to unstreamed_flush_ms (never less than its
    class's own period), not flush_ms, and flush_tokens does not hurry them."""
    cfg = demo_config()
    classes = tuple(dataclasses.replace(k, stream_flush_ms=3000.0) if k.name == "P2" else k
                    for k in cfg.classes)
    cfg = dataclasses.replace(cfg, classes=classes)
    rt = WorkerRuntime(load_settings(cfg, {"engine": "sim", "flush_ms": 50, "flush_tokens": 16,
                                           "unstreamed_flush_ms": 1000}), cfg, engine="sim", simulated=True)
    streamed, unstreamed = _pushed_once("P1", True), _pushed_once("P1", False)
    assert rt.push_due(streamed, 0.001)  # 999 pending >= flush_tokens
    assert not rt.push_due(unstreamed, 0.001) and not rt.push_due(unstreamed, 0.9)
    assert not rt.push_due(unstreamed, 0.95, step_s=0.04)
    assert rt.push_due(unstreamed, 0.95, step_s=0.05)  # older than 1 s by the next step
    assert rt.push_due(unstreamed, 1.0)
    slow_class = _pushed_once("P2", False)  # its class pushes every 3 s: not more often unstreamed
    assert not rt.push_due(slow_class, 2.9) and rt.push_due(slow_class, 3.0)
    first = _delivery()
    first.payload = Payload("completion", "hi", 100, stream=False)
    first.add([1], "a", 0.0)
    assert rt.push_due(first, 0.0)  # an attempt's first batch goes at once, streamed or not


def _stream_steps(rt: WorkerRuntime, starts: dict[str, int], steps: int, step_s: float,
                  clock: PushClock | None) -> tuple[dict[str, list[int]], float]:
    """Requests that each get a token a step from their start step on, pushed when push_due
    says: the steps each was pushed at, and the oldest token's age at a push (s)."""
    ds = {rid: Delivery(Claimed(rid, "P1", "t1", 1, b"", 0, 5, 10_000, "fe1", 0, [], 0, 0),
                        Payload("completion", "hi", 10_000), 1000, 0.0, 3, 1) for rid in starts}
    pushed: dict[str, list[int]] = {rid: [] for rid in starts}
    oldest = 0.0
    for k in range(steps):
        t = 100.0 + k * step_s
        now = t + 0.0004 * (k % 3)  # the decision comes a little after the step's end, by how much varies
        if clock is not None:
            clock.step_ended(t)
        for rid, d in ds.items():
            if k >= starts[rid]:
                d.add([1], "x", t)
        for rid, d in ds.items():
            if d.pending_tokens and rt.push_due(d, now, step_s, clock):
                oldest = max(oldest, now - d.pending_since)
                pushed[rid].append(k)
                d._sent(d.pending_tokens, len(d.pending_ids), len(d.pending_text))
    return pushed, oldest


@pytest.mark.parametrize("step_ms", [7.0, 12.5, 20.0, 30.0, 45.0, 60.0])
def test_requests_keep_the_clock_steps_from_their_second_push_on(step_ms: float) -> None:
    """Requests started at other steps: with the step loop's clock, from each one's second
    push on they are pushed at the same steps (one call), no more often than each alone
    (one push more at most), and no token waits longer than flush_ms."""
    cfg = demo_config()
    rt = WorkerRuntime(load_settings(cfg, {"engine": "sim", "flush_ms": 50, "flush_tokens": 10_000}), cfg,
                       engine="sim", simulated=True)
    starts = {"a": 0, "b": 3, "c": 5, "d": 8}
    alone, _ = _stream_steps(rt, starts, 200, step_ms / 1e3, None)
    together, oldest = _stream_steps(rt, starts, 200, step_ms / 1e3, PushClock())
    assert oldest <= 0.050 + 0.0008 + 1e-9  # flush_ms, and how late a decision may come (as alone)
    after = max(p[1] for p in together.values())  # once each made its second push
    later = [{k for k in p if k > after} for p in together.values()]
    assert later[0] and all(x == later[0] for x in later), together
    for rid in starts:
        assert len(together[rid]) <= len(alone[rid]) + 1, (rid, alone[rid], together[rid])
    if step_ms < 25:  # several steps a period: alone, they were pushed at different steps
        assert len({frozenset(k for k in p if k > after) for p in alone.values()}) > 1


def test_a_clock_answers_the_same_for_one_step_and_times_each_period_apart() -> None:
    clock = PushClock()
    clock.step_ended(1.000)
    assert not clock.fires(50, 1.001, 0.02)  # the first step starts the period, at its end
    clock.step_ended(1.020)
    assert not clock.fires(50, 1.021, 0.02) and not clock.fires(50, 1.021, 0.02)
    clock.step_ended(1.030)
    assert clock.fires(50, 1.0305, 0.02) and clock.fires(50, 1.0305, 0.02)  # 30.5 + 20 >= 50, asked twice
    assert not clock.fires(1000, 1.0305, 0.02)  # another period keeps its own time
    clock.step_ended(1.050)
    assert not clock.fires(50, 1.070, 0.02)  # the step after a push step starts the next period


class _FakeScripts:
    """push_tokens that already landed once (a lost reply), then accepts the rest."""

    def __init__(self, landed: int) -> None:
        self.landed = landed
        self.client = self
        self.calls: list[tuple[int, int]] = []

    async def push_tokens(self, keys, *, offset: int, token_ids, count: int, **_kw) -> None:
        self.calls.append((offset, count))
        if offset != self.landed:
            raise InvalidArgument("offset", f"offset: {offset} but {self.landed} tokens were delivered")
        self.landed += count

    async def hget(self, _key: str, _field: str) -> bytes:
        return str(self.landed).encode()


async def test_a_push_whose_reply_was_lost_is_reconciled_by_offset() -> None:
    from limiter.keys import PoolKeys

    d = _delivery()
    d.add([1, 2, 3], "abc", 0.0)
    fake = _FakeScripts(landed=0)
    d._uncertain[3] = (3, 3)  # an earlier push of these 3 tokens (3 ids, 3 chars): reply lost
    fake.landed = 3  # ...but it did land
    d.add([4], "d", 0.0)
    await d.push(fake, PoolKeys("tiny"), "w")  # type: ignore[arg-type]
    assert d.offset == 4 and not d.pending_ids and fake.calls == [(0, 4), (3, 1)]
    d.add([5], "e", 0.0)
    fake.landed = 9  # someone else's tokens: not ours to reconcile
    with pytest.raises(LeaseLost):
        await d.push(fake, PoolKeys("tiny"), "w")  # type: ignore[arg-type]


async def test_a_refusal_that_is_not_an_offset_mismatch_is_raised_whatever_the_request_id() -> None:
    """The reconcile path is chosen by the error's field, not its text: a request id holding
    the word "offset" once turned a max_tokens refusal into a reconcile (and a LeaseLost)."""
    from limiter.keys import PoolKeys

    class Refusing(_FakeScripts):
        async def push_tokens(self, keys, **_kw) -> None:
            raise InvalidArgument("count", "count: offset-7: 101 tokens exceed max_tokens 100")

    d = _delivery()
    d.add([1], "a", 0.0)
    with pytest.raises(InvalidArgument, match="max_tokens"):
        await d.push(Refusing(landed=0), PoolKeys("tiny"), "w")  # type: ignore[arg-type]


async def test_an_outage_during_the_offset_reconcile_is_an_outage() -> None:
    """The reconcile's read of Redis's token count raised redis-py's ConnectionError as it
    came: not an outage the loops back off from (RedisUnavailable), so it ended the worker."""
    import redis.exceptions

    from limiter.errors import RedisUnavailable
    from limiter.keys import PoolKeys

    class Dropping(_FakeScripts):
        async def hget(self, _key: str, _field: str) -> bytes:
            raise redis.exceptions.ConnectionError("Connection reset by peer")

    d = _delivery()
    d.add([1], "a", 0.0)
    with pytest.raises(RedisUnavailable):
        await d.push(Dropping(landed=5), PoolKeys("tiny"), "w")  # type: ignore[arg-type]
    assert d.offset == 0 and d.pending_ids == [1]  # nothing taken as sent


async def test_model_tokens_and_resume_ids_are_pushed_and_reconciled_apart() -> None:
    """The openai engine's pending text: 2 model tokens whose resume ids are 5 bytes. Counts,
    offsets and flushing follow the tokens; a lost reply is reconciled by them too."""
    from limiter.keys import PoolKeys

    d = _delivery()
    d.add(list(b"hello"), "hello", 0.0, tokens=2)
    assert d.total_tokens == 2 and d.due(0.0, 50, 3)  # the first push of an attempt goes at once
    fake = _FakeScripts(landed=0)
    d._uncertain[2] = (5, 5)
    fake.landed = 2  # that push landed, its reply was lost
    d.add(list(b" world"), " world", 0.0, tokens=1)
    d.add([], "", 0.0, tokens=1)  # a token with no text
    await d.push(fake, PoolKeys("tiny"), "w")  # type: ignore[arg-type]
    assert fake.calls == [(0, 4), (2, 2)] and d.offset == 4
    assert not d.pending_ids and not d.pending_text and d.pending_tokens == 0


class _FullWorkerRuntime:
    """Enough of a WorkerRuntime for StepLoop._pull: a full batch, markers always there, and
    claims that find nothing (the queued work is of lower classes than the look-ahead asks)."""

    def __init__(self) -> None:
        from worker.settings import WorkerSettings

        self.cfg = demo_config()
        self.settings = WorkerSettings(max_seqs=1, token_budget=8, claim_ahead=1, claim_interval_ms=20)
        self.held: dict[str, Any] = {}
        self.claim_left_backlog = True  # the lower-class work it does not take stays queued
        self.claims: list[str] = []
        self.avoided: list[tuple[list[str], str]] = []

    async def take_wake_marker(self) -> bool:
        return True

    async def claim(self, n: int, room: int, above: str, kv_total: int, avoid_tenants: Any = (),
                    avoid_from: str = "") -> list[Any]:
        self.claims.append(above)
        self.avoided.append((list(avoid_tenants), avoid_from))
        return []


async def test_a_full_workers_look_ahead_never_backs_off_past_the_claim_interval() -> None:
    """A full worker holding lower-class work looks ahead for a higher class every
    claim_interval_ms, however often it finds none: a growing back-off kept it from claiming
    a newly queued P0 for up to a second."""
    from worker.claim_step_loop import StepLoop

    rt = _FullWorkerRuntime()
    loop = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=8, max_seqs=1))  # type: ignore[arg-type]
    for rid, rank in (("run", 2), ("wait", 2)):
        loop.sched.add(rid, [1, 2, 3], SamplingParams(max_tokens=4), class_rank=rank, arrival=0)
        rt.held[rid] = _delivery()
    await loop.sched.step()  # one runs, one waits: the batch is full and its look-ahead taken
    for _ in range(8):
        loop._next_lookahead = 0.0
        await loop._pull()
        assert loop._next_lookahead - time.monotonic() <= 0.021 and loop._next_claim == 0.0
    assert rt.claims == ["P2"] * 8  # above_class: only classes ranked above the waiting P2


async def test_a_look_ahead_claim_is_timed_by_the_step_running_not_the_last_one(monkeypatch) -> None:
    """A full batch's look-ahead claim waits until just before the end of the step it runs
    beside. Timed by the last step's length, a long prefill step after short decode steps was
    claimed for early in it, and a request arriving in the rest of it (a light tenant's,
    beside a flood) waited one whole step more. The cost fit's prediction of the running step
    comes first; without it, the last step's length."""
    from worker import claim_step_loop
    from worker.claim_step_loop import LOOKAHEAD_LEAD_S, StepLoop

    cost = CostModel(c0=0.010, c_prefill=60e-6, c_decode=1e-3, c_kv=0.0)
    budget = StepBudget(BudgetConfig((50.0, 150.0, None), min_budget=1, max_budget=2048))
    rng = random.Random(1)
    for _ in range(60):
        p, d = rng.randint(0, 1500), rng.randint(0, 16)
        budget.observe(p, d, 1e3 * cost.cost(p, d, 0))
    rt = _FullWorkerRuntime()
    loop = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=8, max_seqs=1))  # type: ignore[arg-type]
    loop.sched.budget = budget
    loop.sched.add("a", encode("x" * 1000), SamplingParams(max_tokens=4), class_rank=1, arrival=0)
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(s: float) -> None:
        if s:  # the sim engine's own step (time scale 0) sleeps 0
            waits.append(s)
        await real_sleep(0)

    async def pull() -> None:
        return None

    monkeypatch.setattr(claim_step_loop.asyncio, "sleep", sleep)
    monkeypatch.setattr(loop, "_pull", pull)
    loop._last_step_ms = 30.0  # the steps before were short
    step = asyncio.ensure_future(loop.sched.step())
    await real_sleep(0)  # the step is planned and running now
    assert loop.sched.running_plan is not None
    expected = loop.sched.expected_step_ms()
    assert expected == pytest.approx(1e3 * cost.cost(loop.sched.running_plan.prefill_tokens, 0, 0), rel=0.05)
    await loop._pull_late()
    await step
    assert loop.sched.running_plan is None and loop.sched.expected_step_ms() is None
    assert waits == [pytest.approx(expected / 1e3 - LOOKAHEAD_LEAD_S)]  # not 30 ms - the lead
    waits.clear()
    await loop._pull_late()  # between steps (or with no fit): the last step's length
    assert waits == [pytest.approx(0.030 - LOOKAHEAD_LEAD_S)]


async def test_no_step_starts_while_a_look_ahead_claim_is_pending(monkeypatch) -> None:
    """What a full batch's look-ahead claim brings runs in the very next step. A claim still
    in flight when its step ends is waited for, up to LOOKAHEAD_WAIT_S (a stalled Redis never
    stops the batch); one still asleep (the step ended before the fit said it would) is
    dropped, never reaching Redis, for a claim made at once. Left pending, the next step ran
    without it and without a look-ahead of its own, and a light tenant's request arriving
    during the step waited one or two steps more."""
    from worker import claim_step_loop
    from worker.claim_step_loop import StepLoop

    rt = _FullWorkerRuntime()
    loop = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=8, max_seqs=1))  # type: ignore[arg-type]
    for rid in ("run", "wait"):
        loop.sched.add(rid, [1, 2, 3], SamplingParams(max_tokens=8), class_rank=1, arrival=0)
        rt.held[rid] = _delivery()
    await loop.sched.step()  # one runs, one waits: full, so the claim goes beside the step
    pulls = 0
    in_flight = asyncio.Event()
    reply = asyncio.Event()
    real_sleep = asyncio.sleep
    sleeps: list[asyncio.Future[None]] = []  # each a sleep that lasts until the test ends it

    async def sleep(s: float) -> None:
        if not s:
            return await real_sleep(0)
        sleeps.append(asyncio.get_running_loop().create_future())
        await sleeps[-1]

    async def pull() -> None:
        nonlocal pulls
        pulls += 1
        in_flight.set()
        await reply.wait()  # the claim's round trip

    monkeypatch.setattr(claim_step_loop.asyncio, "sleep", sleep)
    monkeypatch.setattr(loop, "_pull", pull)
    monkeypatch.setattr(claim_step_loop, "LOOKAHEAD_WAIT_S", 30.0)  # a slow host, not an outage
    loop._last_step_ms = 30.0

    # 1. The step ends while its look-ahead still sleeps: dropped, and a claim made at once.
    await loop._claim_now_or_beside_the_step()
    first = loop._claiming
    assert first is not None and not first.done() and pulls == 0
    await real_sleep(0)  # the task runs up to its sleep
    ended = asyncio.ensure_future(loop._claim_now_or_beside_the_step())  # the step ended early
    await asyncio.wait_for(in_flight.wait(), 5)
    assert first.cancelled() and pulls == 1 and not ended.done()  # claimed now, and waited for
    reply.set()
    await asyncio.wait_for(ended, 5)
    second = loop._claiming
    assert second is not None and second is not first  # the next step's own look-ahead

    # 2. The step ends while the look-ahead's claim is in flight: the next step waits for it.
    reply.clear()
    in_flight.clear()
    await real_sleep(0)
    sleeps[-1].set_result(None)  # its sleep ends: the claim goes out
    await asyncio.wait_for(in_flight.wait(), 5)
    assert pulls == 2
    settle = asyncio.ensure_future(loop._claim_now_or_beside_the_step())
    for _ in range(10):
        await real_sleep(0)
    assert not settle.done(), "the next step started with the look-ahead claim still in flight"
    reply.set()
    await asyncio.wait_for(settle, 5)
    assert second.done() and not second.cancelled()

    # 3. A claim stuck on Redis: after LOOKAHEAD_WAIT_S the step goes on without it.
    third = loop._claiming
    assert third is not None
    reply.clear()
    in_flight.clear()
    await real_sleep(0)
    sleeps[-1].set_result(None)
    await asyncio.wait_for(in_flight.wait(), 5)
    monkeypatch.setattr(claim_step_loop, "LOOKAHEAD_WAIT_S", 0.01)
    await asyncio.wait_for(loop._claim_now_or_beside_the_step(), 5)
    assert not third.done() and loop._claiming is third  # still pending; the batch steps on
    await loop._abandon_claim()


async def test_a_full_worker_looks_ahead_for_a_tenant_holding_none_of_its_slots() -> None:
    """Every slot and the look-ahead held by one flooding P1 tenant: the worker claims one
    request of anyone else (it then takes one of the flood's slots); once a poorer tenant's
    request waits here, it stops looking (bounded)."""
    from worker.claim_step_loop import StepLoop
    from worker.settings import WorkerSettings

    rt = _FullWorkerRuntime()
    rt.settings = WorkerSettings(max_seqs=2, token_budget=8, claim_ahead=1, claim_interval_ms=20)
    loop = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=8, max_seqs=2))  # type: ignore[arg-type]
    for rid in ("h1", "h2", "h3"):
        loop.sched.add(rid, [1, 2, 3], SamplingParams(max_tokens=4), class_rank=1, arrival=0, tenant="heavy")
        rt.held[rid] = _delivery()
    await loop.sched.step()  # two run, one waits: full, and the look-ahead is the flood's too
    loop._next_lookahead = 0.0
    await loop._pull()
    assert rt.claims == ["P2"] and rt.avoided == [(["heavy"], "P1")]  # anyone but heavy, in P1 and above
    loop.sched.add("s1", [1, 2, 3], SamplingParams(max_tokens=4), class_rank=1, arrival=1, tenant="steady")
    rt.held["s1"] = _delivery()
    loop._next_lookahead = 0.0
    await loop._pull()  # a poorer tenant waits here now: only the higher-class look-ahead
    assert rt.claims == ["P2", "P1"] and rt.avoided[-1] == ([], "")
    await loop.sched.step()
    assert "s1" in {q.request_id for q in loop.sched.running}  # it took one of the flood's slots


async def test_a_tenant_that_holds_a_few_slots_is_not_avoided_while_another_holds_many() -> None:
    """Rich is relative: a light tenant holding 2 of 6 slots next to a flood holding 4 can
    still take one (4 >= 2 + 2), so only the flood is avoided; at 3 and 3 both are."""
    from worker.claim_step_loop import StepLoop
    from worker.settings import WorkerSettings

    rt = _FullWorkerRuntime()
    rt.settings = WorkerSettings(max_seqs=6, token_budget=8, claim_ahead=1, claim_interval_ms=20)
    loop = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=64, max_seqs=6))  # type: ignore[arg-type]
    for i, tenant in enumerate(["heavy"] * 4 + ["steady"] * 2 + ["heavy"]):
        loop.sched.add(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), class_rank=1, arrival=i,
                       tenant=tenant)
    await loop.sched.step()
    assert loop._tenant_lookahead() == ("P2", ["heavy"], "P1")
    even = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=64, max_seqs=6))  # type: ignore[arg-type]
    for i, tenant in enumerate(["heavy"] * 3 + ["steady"] * 3 + ["heavy"]):
        even.sched.add(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), class_rank=1, arrival=i,
                       tenant=tenant)
    await even.sched.step()  # 3 and 3: neither can take the other's slot
    assert even._tenant_lookahead() == ("P2", ["heavy", "steady"], "P1")


async def test_the_tenant_look_ahead_never_avoids_a_class_above_every_waiting_request() -> None:
    """One tenant per class (each "rich" in its class): behind a P2 flood the look-ahead must
    still take any P0, whoever sends it -- avoiding P0's only tenant kept P0 queued for
    seconds (qos bench control, p2_flood)."""
    from worker.claim_step_loop import StepLoop
    from worker.settings import WorkerSettings

    rt = _FullWorkerRuntime()
    rt.settings = WorkerSettings(max_seqs=6, token_budget=8, claim_ahead=1, claim_interval_ms=20)
    loop = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=64, max_seqs=6))  # type: ignore[arg-type]
    for i, (rank, tenant) in enumerate([(0, "chat")] * 2 + [(2, "batch")] * 5):
        loop.sched.add(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), class_rank=rank, arrival=i,
                       tenant=tenant)
    await loop.sched.step()  # 2 P0 + 4 P2 run, one P2 waits
    assert loop._tenant_lookahead() == ("", ["batch"], "P2")  # P0 and P1 open to anyone

async def test_claimed_requests_keep_their_enqueue_order_on_a_long_lived_worker() -> None:
    """Arrival is (enqueue ms, claim count), exact at today's epoch ms. As one float
    (``enq_ms + count * 1e-6``) two requests enqueued in the same ms tied below the float's
    resolution (the earlier claimed was paused first, not the later), and three million
    claims on, a request re-queued from an earlier ms ranked behind one enqueued after it."""
    from worker.claim_step_loop import StepLoop

    rt = _FullWorkerRuntime()
    loop = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=64, max_seqs=2))  # type: ignore[arg-type]
    now_ms = 1_770_000_000_000

    async def start(rid: str, enq_ms: int, cls: str = "P2") -> None:
        c = Claimed(rid, cls, "t1", 1, b"", enq_ms, 5, 100, "fe1", 0, [], enq_ms, 0)
        d = Delivery(c, Payload("completion", "hi", 100), enq_ms, 0.0, 3, rt.cfg.class_rank(cls))
        rt.held[rid] = d
        await loop._start(d)

    await start("first", now_ms)
    await start("second", now_ms)  # same ms, claimed next: the more recent arrival
    await loop.sched.step()
    await start("p0", now_ms + 5, "P0")
    res = await loop.sched.step()
    assert res.preempted == ("second",) and res.admitted == ("p0",)

    loop._arrivals = 3_000_000
    await start("requeued", now_ms - 1)  # enqueued 1 ms before "second", claimed 3e6 claims on
    waiting = sorted(loop.sched.waiting, key=lambda s: s.candidate().priority)
    assert [s.request_id for s in waiting] == ["requeued", "second"]



async def test_a_full_workers_first_look_ahead_skips_a_tenant_that_could_only_wait_here() -> None:
    """Nothing waiting on a full worker: its look-ahead claims one request, but not of a
    tenant holding two or more slots of its class more than another tenant of it here (that
    request would only wait for a slot, while VTC put the flood first during a light
    tenant's burst and the light tenant's request waited a step for the worker's next look).
    A class with one tenant here is claimed as before. The look-ahead finding nothing paces
    only further look-aheads: a slot freeing meanwhile is claimed at once."""
    from worker.claim_step_loop import StepLoop
    from worker.settings import WorkerSettings

    rt = _FullWorkerRuntime()
    rt.settings = WorkerSettings(max_seqs=6, token_budget=8, claim_ahead=1, claim_interval_ms=20)
    loop = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=64, max_seqs=6))  # type: ignore[arg-type]
    for i, tenant in enumerate(["heavy"] * 4 + ["steady"] * 2):
        loop.sched.add(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), class_rank=1, arrival=i,
                       tenant=tenant)
        rt.held[f"r{i}"] = _delivery()
    await loop.sched.step()  # full, nothing waiting
    await loop._pull()
    assert rt.claims == [""] and rt.avoided == [(["heavy"], "P1")]  # any class, heavy not in P1/P2
    assert loop._next_claim == 0.0 and loop._next_lookahead > time.monotonic()
    await loop._pull()  # paced: no second look-ahead within claim_interval_ms
    assert len(rt.claims) == 1
    loop.sched.remove("r0")  # a stream ended: a free slot is claimed now, look-ahead pacing or not
    del rt.held["r0"]
    await loop._pull()
    assert len(rt.claims) == 2 and rt.avoided[-1] == ([], "")

    alone = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=64, max_seqs=6))  # type: ignore[arg-type]
    for i, (rank, tenant) in enumerate([(0, "chat")] + [(1, "heavy")] * 5):
        alone.sched.add(f"a{i}", [1, 2, 3], SamplingParams(max_tokens=4), class_rank=rank, arrival=i,
                        tenant=tenant)
    await alone.sched.step()
    assert alone._tenants_ahead() == ([], "")  # one tenant per class here: nobody is ahead


class _IdleWorkerRuntime:
    """Enough of a WorkerRuntime for an idle StepLoop._pull: every claim finds nothing, and
    a wake marker is always there (stale ones, or a backlog this worker cannot take)."""

    def __init__(self, backlog: bool) -> None:
        from worker.settings import WorkerSettings

        self.cfg = demo_config()
        self.settings = WorkerSettings(max_seqs=4, token_budget=8, claim_interval_ms=1)
        self.held: dict[str, Any] = {}
        self.claim_left_backlog = backlog
        self.claims = 0
        self.waits: list[float] = []  # when each wait on the wake list began (monotonic)

    async def claim(self, *args: Any) -> list[Any]:
        self.claims += 1
        return []

    async def wait_for_work(self) -> bool:
        self.waits.append(time.monotonic())
        return True


@pytest.mark.parametrize("backlog", [False, True])
async def test_an_idle_worker_backs_off_only_when_claim_left_work_it_cannot_take(backlog: bool) -> None:
    """Stale wake markers (one claim took the work of several markers) must not make an idle
    worker sleep before its next claim: that back-off added up to 100 ms to the TTFT of the
    next request. A backlog it cannot take (a misfit, a ceiling) still backs off, so it is no
    hot loop."""
    from worker.claim_step_loop import StepLoop

    rt = _IdleWorkerRuntime(backlog)
    loop = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=8, max_seqs=4))  # type: ignore[arg-type]
    backoff_ends = []
    for _ in range(4):
        await loop._pull()
        backoff_ends.append(loop._next_claim)
    assert rt.claims == 4 and len(rt.waits) == 4
    if backlog:
        assert loop._empty_claims == 4
        # Backed off from the second empty claim on, and slept out *before* the wait on the wake
        # list: a marker taken and held through the sleep is one another idle worker (one that
        # can take the work) never sees.
        assert all(end > 0 for end in backoff_ends[1:]), backoff_ends
        assert all(w >= end for w, end in zip(rt.waits[1:], backoff_ends[1:], strict=True)), \
            (rt.waits, backoff_ends)
    else:
        assert loop._empty_claims == 0 and backoff_ends == [0.0] * 4


def _looks_finding_nothing(rt: Any) -> list[float]:
    """From now on ``rt``'s looks at the wake list find no marker; when each was made (monotonic)."""
    looks: list[float] = []

    async def no_marker() -> bool:
        looks.append(time.monotonic())
        return False

    rt.take_wake_marker = no_marker
    return looks


async def test_a_busy_worker_looks_for_new_work_every_wake_check_ms() -> None:
    """A worker with requests held and room for more looks at the wake list (one LPOP) again
    within wake_check_ms when it found nothing there -- not after the longer claim interval."""
    from worker.claim_step_loop import StepLoop
    from worker.settings import WorkerSettings

    rt = _FullWorkerRuntime()
    rt.settings = WorkerSettings(max_seqs=4, token_budget=8, claim_interval_ms=500, wake_check_ms=3)
    rt.held["run"] = _delivery()
    looks = _looks_finding_nothing(rt)
    loop = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=8, max_seqs=4))  # type: ignore[arg-type]
    before = time.monotonic()
    await loop._pull()
    assert len(looks) == 1 and rt.claims == []
    # wake_check_ms from the pass's own clock, read between `before` and the look: the bounds
    # hold however long the pass took (it once read 3.1 ms on a busy CI machine, and a bound
    # from the look's time alone failed)
    assert before + 0.003 - 1e-6 <= loop._next_look <= looks[0] + 0.003 + 1e-6
    await loop._pull()  # again before it is due (the next step of a fast engine): no LPOP
    assert len(looks) == 1
    loop._next_look = time.monotonic()  # its wake_check_ms are over
    await loop._pull()
    assert len(looks) == 2 and rt.claims == []


async def test_a_busy_look_that_found_nothing_does_not_hold_back_the_claim_once_idle() -> None:
    """A busy worker's look at the wake list that found nothing times the next look, not a
    claim back-off: on one timer, a worker that went idle right after such a look and was
    woken by a marker slept the rest of wake_check_ms before claiming (the new request's
    TTFT: up to 2 ms more by default)."""
    from worker.claim_step_loop import StepLoop
    from worker.settings import WorkerSettings

    rt = _IdleWorkerRuntime(backlog=False)  # every claim finds nothing; a marker wakes every wait
    rt.settings = WorkerSettings(max_seqs=4, token_budget=8, wake_check_ms=10_000)  # plain if slept
    looks = _looks_finding_nothing(rt)
    loop = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=8, max_seqs=4))  # type: ignore[arg-type]
    rt.held["run"] = _delivery()
    await loop._pull()  # busy with room: a look that finds nothing
    assert len(looks) == 1 and loop._next_claim == 0.0
    del rt.held["run"]  # its request ended
    loop._idle_claim_due = False  # as after the claim that brought it
    await asyncio.wait_for(loop._pull(), 5)  # just idle: waits on the wake list, a marker comes
    assert len(rt.waits) == 1 and rt.claims == 0
    await asyncio.wait_for(loop._pull(), 5)  # woken: claims at once, not 10 s after the look
    assert rt.claims == 1


async def test_a_redis_outage_backs_off_per_loop_and_is_logged_once_each_way(monkeypatch, caplog) -> None:
    """guard(): the delay doubles with each failure of one loop up to 4x its first, another
    loop keeps its own; one warning when the outage starts and one line when it ends (a
    worker through a 30 s outage wrote a warning every 0.5 s); Redis answering with a
    missing policy ends the outage too."""
    import logging
    import types

    from limiter import backoff as backoff_module
    from limiter.errors import PolicyMissing, RedisUnavailable
    from worker.runtime import WorkerRuntime
    from worker.settings import WorkerSettings

    slept: list[float] = []

    async def no_sleep(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr(backoff_module, "asyncio", types.SimpleNamespace(sleep=no_sleep))
    cfg = demo_config()
    rt = WorkerRuntime(WorkerSettings(pool=cfg.pools[0].name), cfg, engine="sim", simulated=True)

    async def down() -> None:
        raise RedisUnavailable("connection refused")

    async def up() -> str:
        return "ok"

    with caplog.at_level(logging.INFO, logger="qos.worker"):
        for _ in range(6):
            assert await rt.guard("worker", down()) is None
        assert await rt.guard("heartbeat", down(), backoff=0) is None
        assert not rt.redis_ok
        assert await rt.guard("worker", up()) == "ok" and not rt.redis_ok  # a heartbeat says so
        assert await rt.guard("heartbeat", up(), backoff=0) == "ok" and rt.redis_ok
        assert await rt.guard("worker", down()) is None
        assert await rt.guard("worker", down()) is None  # the second outage goes on: 1 s

        async def no_policy() -> None:
            raise PolicyMissing("tiny")

        async def nothing() -> None:
            return None

        monkeypatch.setattr(rt, "ensure_pool", nothing)
        assert await rt.guard("worker", no_policy()) is None and rt.redis_ok
        assert await rt.guard("worker", down()) is None  # a new outage starts again at 0.5 s
    assert slept == [0.5, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.5, 1.0, 0.5]
    lines = [r.getMessage() for r in caplog.records]
    assert sum("worker: connection refused" in m for m in lines) == 3, lines  # three outages of "worker"
    assert sum("heartbeat: connection refused" in m for m in lines) == 1, lines
    assert sum(m.startswith("worker: working again") for m in lines) == 2, lines


# --- found by review: KV edge cases that took a whole worker down --------------------------


def test_kept_kv_of_a_paused_sequence_does_not_make_a_fitting_request_never_fit() -> None:
    """One slot, 1000 KV tokens. A P0 arrival pauses a decoding P1 sequence keeping its
    ~300-token cache; a second P0 request of 800 tokens (fits the worker: 801 <= 1000) waits
    behind the first. When the first P0 finished nothing ran, so nothing freed the paused
    sequence's kept KV, and step() raised 'can never fit' (the Redis worker then failed
    every request it held)."""
    async def go() -> dict[str, int]:
        cap = 1000
        sched = BatchScheduler(SimEngine(time_scale=0, kv_capacity_tokens=cap),
                               Limits(token_budget=1024, max_seqs=1, kv_capacity=cap))
        sched.add("low", encode("x" * 300), SamplingParams(max_tokens=50), class_rank=1, arrival=0)
        for _ in range(3):
            await sched.step()  # low is prefilled and decoding
        sched.add("a", encode("y" * 50), SamplingParams(max_tokens=3), class_rank=0, arrival=1)
        sched.add("h", encode("z" * 800), SamplingParams(max_tokens=3), class_rank=0, arrival=2)
        done: dict[str, int] = {}
        for _ in range(500):
            if not len(sched):
                return done
            res = await sched.step()
            for rid, e in res.emissions.items():
                done[rid] = done.get(rid, 0) + len(e.token_ids)
        raise AssertionError("did not finish in 500 steps")

    done = asyncio.run(go())
    assert done == {"low": 50 - 3, "a": 3, "h": 3}  # 3 of low's 50 came before the counting


def test_a_sequence_that_grows_to_the_kv_capacity_finishes_with_length() -> None:
    """claim hands a worker requests whose prompt + max_tokens exceeds its KV room (only a
    prompt that cannot fit is refused). Such a sequence used to decode until its KV was full,
    be paused, and never fit again: step() raised 'can never fit'. It ends with 'length' at
    the worker's context, as at the model's."""
    async def go() -> tuple[list[str | None], int, int]:
        cap = 200
        sched = BatchScheduler(SimEngine(time_scale=0, kv_capacity_tokens=cap),
                               Limits(token_budget=256, max_seqs=4, kv_capacity=cap))
        prompt = encode("x" * 150)
        assert len(prompt) <= sched.max_context()  # the check the step loop makes at start
        sched.add("long", prompt, SamplingParams(max_tokens=100, eos_min_len=-1), class_rank=1, arrival=0)
        reasons: list[str | None] = []
        tokens = 0
        for _ in range(500):
            if not len(sched):
                return reasons, tokens, len(prompt)
            res = await sched.step()
            reasons += [e.finish_reason for e in res.emissions.values() if e.finish_reason]
            tokens += sum(len(e.token_ids) for e in res.emissions.values())
        raise AssertionError("did not finish in 500 steps")

    reasons, tokens, prompt_len = asyncio.run(go())
    assert reasons == ["length"] and tokens == 200 - prompt_len  # up to the worker's context


async def test_an_idle_worker_reports_an_empty_batch_and_no_kv_in_use(worker_env) -> None:
    """The running-batch gauges follow the worker into idleness: they were set after each
    engine step only, so once the last request finished (no more steps) a worker that ran
    nothing said qos_worker_batch_size 1 and its last KV use for as long as it stayed idle."""
    from tests.support.helpers import wait_until
    from tests.support.worker_helpers import worker

    cfg, c = worker_env
    async with worker(cfg, engine="sim", time_scale=0.01) as rt:
        reg = rt.metrics.registry
        # running: the gauges (read when scraped) see its batch and the KV it holds
        long = await c.admit("a long one", max_tokens=100000)
        await c.wait_tokens(long, 2)
        assert reg.get_sample_value("qos_worker_batch_size") == 1
        assert reg.get_sample_value("qos_worker_kv_used_tokens") >= len("a long one")
        assert reg.get_sample_value("qos_worker_waiting") == 0
        await c.client.sadd(rt.keys.cancels, long)
        await c.wait([long], timeout=20)
        rid = await c.admit("hello there", max_tokens=8)
        await c.wait([rid], timeout=20)
        assert (reg.get_sample_value("qos_worker_generated_tokens_total") or 0) >= 8  # it did step
        await wait_until(lambda: not rt.held, "the request to be forgotten")
        await wait_until(lambda: reg.get_sample_value("qos_worker_batch_size") == 0
                         and reg.get_sample_value("qos_worker_kv_used_tokens") == 0
                         and reg.get_sample_value("qos_worker_waiting") == 0,
                         "the idle worker's gauges to read 0 "
                         f"(batch {reg.get_sample_value('qos_worker_batch_size')}, "
                         f"kv {reg.get_sample_value('qos_worker_kv_used_tokens')})", timeout=10)


async def test_a_worker_started_while_redis_is_down_answers_its_health_probe(tmp_path) -> None:
    """The metrics server started only once Redis had answered: a worker started during an
    outage had no /healthz (a liveness probe killed it, over and over) and no /metrics to
    show the outage on -- though /healthz is meant to say 200 with redis_ok false then."""
    import aiohttp

    from tests.support.redis_server import free_port
    from tests.support.worker_helpers import config, worker

    cfg = config(tmp_path / "qos.toml", f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    port = free_port()
    health: dict[str, Any] = {}

    async def probe() -> None:
        try:
            async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/healthz") as r:
                if r.status == 200:
                    health.update(await r.json())
        except aiohttp.ClientError:
            pass

    async with worker(cfg, engine="sim", metrics_port=port, metrics_host="127.0.0.1"):
        end = time.monotonic() + 15
        while not health and time.monotonic() < end:
            await probe()
            await asyncio.sleep(0.1)
        assert health, "no answer on /healthz while Redis was down"
        assert health["redis_ok"] is False and health["status"] == "ok"


async def test_the_pushes_counter_counts_pushes_that_landed_once_each() -> None:
    """qos_worker_pushes_total went up before each call: a push that met an outage and was
    sent again counted twice, and a release (drain) with nothing pending counted a push that
    never happened."""
    from limiter.errors import RedisUnavailable
    from worker.runtime import WorkerRuntime

    class Flaky(_FakeScripts):
        fail = 1

        async def push_tokens(self, keys, **kw) -> None:
            if self.fail:
                self.fail -= 1
                raise RedisUnavailable("connection refused")
            await super().push_tokens(keys, **kw)

    cfg = demo_config()
    rt = WorkerRuntime(load_settings(cfg, {"pool": cfg.pools[0].name}), cfg, engine="sim", simulated=True)
    rt.scripts = Flaky(landed=0)  # type: ignore[assignment]
    d = _delivery()
    d.add([1, 2], "ab", 0.0)
    with pytest.raises(RedisUnavailable):
        await rt.push(d)
    await rt.push(d)
    assert d.offset == 2  # sent again: it lands
    await rt.push(d)  # nothing pending: no call
    assert rt.scripts.calls == [(0, 2)]  # type: ignore[attr-defined]
    assert rt.metrics.registry.get_sample_value("qos_worker_pushes_total") == 1


async def test_an_upkeep_loop_ends_on_a_cancellation_that_a_redis_call_swallowed() -> None:
    """The renew / heartbeat / reap loops (WorkerRuntime._every) are stopped by cancelling
    them. On Python 3.11 redis-py's asyncio.wait_for returns normally when the cancellation
    lands as a reply comes back: the loop then slept its whole period (a renew period is
    lease_ms / 3) and went on renewing, until stop_tasks asked again 2 s later -- every
    worker shutdown waited that long, and a loop that kept swallowing was left running."""
    from worker.runtime import WorkerRuntime
    from worker.settings import WorkerSettings

    cfg = demo_config()
    rt = WorkerRuntime(WorkerSettings(pool=cfg.pools[0].name), cfg, engine="sim", simulated=True)
    calls, swallow = 0, True

    async def swallowing() -> None:  # a redis-py call that drops the cancellation
        nonlocal calls
        calls += 1
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if not swallow:
                raise

    task = asyncio.create_task(rt._every(0.0, "renew", swallowing))
    deadline = time.monotonic() + 10
    while not calls:
        assert time.monotonic() < deadline, "the upkeep loop to make its first call"
        await asyncio.sleep(0.01)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    if not done:  # end it for good before failing
        swallow = False
        task.cancel()
        await asyncio.wait({task}, timeout=5)
    assert done and task.cancelled(), f"the upkeep loop went on after its cancellation ({calls} calls)"


async def test_news_of_an_old_attempt_that_was_not_running_does_not_drop_its_re_claimed_attempt() -> None:
    """After an outage longer than a lease, a request whose completion had not landed (held,
    not running) is requeued and claimed back by the same worker. A renew reply about the old
    fence ('lost') that lands while that claim is out puts the id in StepLoop._lost; _start
    discarded such news only when the old attempt was still in the scheduler, so the next
    _apply_signals dropped the new attempt: removed from the scheduler and from ``held``,
    its lease left to lapse again (another attempt spent, its client waiting a lease)."""
    from worker.claim_step_loop import StepLoop

    class _Rt(_FullWorkerRuntime):
        def drop(self, rid: str, why: str = "lost", attempt: Any = None) -> None:
            if attempt is None or self.held.get(rid) is attempt:
                self.held.pop(rid, None)

    rt = _Rt()
    loop = StepLoop(rt, SimEngine(time_scale=0), Limits(token_budget=8, max_seqs=1))  # type: ignore[arg-type]
    old = _delivery()
    old.final = ("ok", "length", "")  # finished during the outage; its completion never landed
    rt.held["r1"] = old
    rt.on_lost(["r1"])  # renew: the old fence is lost, during the claim
    c = dataclasses.replace(old.claimed, fence=2, attempt=2)
    new = Delivery(c, Payload("completion", "hi", 100), 2000, 0.0, 3, 1)
    rt.held["r1"] = new  # the claim hands it back
    await loop._start_all([new])
    await loop._apply_signals()
    assert "r1" in loop.sched and rt.held.get("r1") is new, "the re-claimed attempt was dropped"


async def test_calls_made_one_by_one_return_their_errors_and_close_what_a_cancel_left() -> None:
    """The step's calls awaited in its own task (one of them at most waits on Redis): each
    error comes back in its call's place, as gather(return_exceptions=True) gives it; a
    cancel (a hopeless drain) closes the calls not reached, never started and never awaited."""
    from worker.claim_step_loop import _one_by_one

    async def answer(x: int) -> int:
        return x

    async def refused() -> int:
        raise LeaseLost("r1", "lost (the test)")

    first, error, last = await _one_by_one([answer(1), refused(), answer(3)])
    assert (first, last) == (1, 3) and isinstance(error, LeaseLost)
    started, gate = asyncio.Event(), asyncio.Event()

    async def waiting() -> None:
        started.set()
        await gate.wait()

    never = answer(4)
    task = asyncio.create_task(_one_by_one([waiting(), never]))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert never.cr_frame is None  # closed: no "coroutine was never awaited" at exit


# --- found by a review of the worker's scheduling (2026-12-05): the look-ahead by KV ------------

RANKS = {"P0": 0, "P1": 1, "P2": 2}


def _queued(rid: str, cls: str, prompt_tokens: int, max_tokens: int) -> Delivery:
    c = Claimed(rid, cls, "t-" + rid, 1, b"", 1, prompt_tokens, max_tokens, "fe", 0, [], 0, 0)
    return Delivery(c, Payload("completion", "x" * (prompt_tokens - 1), max_tokens), 0, 0.0, prompt_tokens,
                    RANKS[cls])


class _QueueRuntime:
    """Enough of a WorkerRuntime for StepLoop._pull, with a queue that claims as claim.lua does:
    best class first, only classes above ``above_class`` when it is given, a class's next
    request that does not fit the room closing it for the call; markers always there."""

    def __init__(self, max_seqs: int = 8) -> None:
        from worker.settings import WorkerSettings

        self.cfg = demo_config()
        self.settings = WorkerSettings(max_seqs=max_seqs, token_budget=64, claim_ahead=1,
                                       claim_interval_ms=20, adaptive_budget=False)
        self.held: dict[str, Any] = {}
        self.queue: list[Delivery] = []
        self.claims: list[tuple[int, int, str]] = []
        self.totals: list[int] = []  # each claim's kv_total: what the worker can ever hold

    @property
    def claim_left_backlog(self) -> bool:
        return bool(self.queue)

    async def take_wake_marker(self) -> bool:
        return True

    async def claim(self, n: int, room: int, above: str, kv_total: int, avoid_tenants: Any = (),
                    avoid_from: str = "") -> list[Any]:
        self.claims.append((n, room, above))
        self.totals.append(kv_total)
        out, closed = [], set()
        for d in sorted(self.queue, key=lambda d: RANKS[d.claimed.cls]):
            cls = d.claimed.cls
            if len(out) >= n or cls in closed or (above and RANKS[cls] >= RANKS[above]):
                continue
            if kv_total and d.claimed.input_tokens + 1 > kv_total:
                continue  # never fits this worker: left to a bigger one
            need = d.claimed.input_tokens + d.claimed.max_tokens
            if need > room:
                closed.add(cls)
                continue
            room -= need
            self.queue.remove(d)
            self.held[d.request_id] = d
            out.append(d)
        return out


def _queue_loop(rt: _QueueRuntime, kv: int = 1000) -> Any:
    from worker.claim_step_loop import StepLoop

    return StepLoop(rt, SimEngine(time_scale=0, kv_capacity_tokens=kv),  # type: ignore[arg-type]
                    Limits(token_budget=64, max_seqs=rt.settings.max_seqs, kv_capacity=kv))


async def _looks(loop: Any, n: int) -> None:
    """``n`` looks of the worker, each due, with a step of its batch after each."""
    for _ in range(n):
        loop._next_look = loop._next_claim = loop._next_lookahead = 0.0
        await loop._pull()
        if len(loop.sched):
            await loop.sched.step()


async def test_a_worker_whose_kv_reservations_are_full_holds_one_request_beyond_them_not_every_slot() -> None:
    """Slots free, the KV reserved in full (input + max_tokens each): the look-ahead's request
    started at once (the engine admits on KV used, not reserved), nothing waited, and the next
    look took another, until every slot was held; their KV then grew and the worker preempted
    them in turn. It holds claim_ahead (1) beyond its reservations."""
    rt = _QueueRuntime()
    loop = _queue_loop(rt)
    rt.queue = [_queued(f"q{i}", "P1", 100, 400) for i in range(12)]
    await _looks(loop, 1)
    assert len(rt.held) == 2  # 1000 / (100 + 400)
    await _looks(loop, 10)
    assert len(rt.held) == 3 and len(loop._beyond_reservation()) == 1


async def test_a_p0_reaches_a_worker_whose_look_ahead_request_runs_past_its_kv_reservations() -> None:
    """Full by reservations with slots free, the look-ahead's P2 started at once (the engine
    admits on KV used) and nothing waited: the look-ahead counted only waiting requests as
    holding its slot, so no look claimed anything and a P0 queued behind the P2 decodes until
    one finished (a review: 3.2 s at 237 tokens each). The running P2 past the reservations
    holds the slot now, and a class above it is claimed."""
    rt = _QueueRuntime()
    loop = _queue_loop(rt)
    rt.queue = [_queued(f"p2{i}", "P2", 100, 400) for i in range(3)]
    await _looks(loop, 3)
    assert len(rt.held) == 3 and len(loop._beyond_reservation()) == 1 and not loop.sched.waiting
    rt.queue.append(_queued("p0", "P0", 50, 50))
    await _looks(loop, 2)
    assert "p0" in rt.held and "p0" in {q.request_id for q in loop.sched.running}
    assert all(len(q.generated) < 10 for q in loop.sched.running)  # long before any KV pressure


async def test_a_light_tenant_reaches_a_worker_whose_flood_runs_past_its_kv_reservations() -> None:
    """The same for tenants: a flood's look-ahead request running past the reservations holds
    the slot, so the look-ahead avoids the flood (a light tenant of its class can take one of
    its slots); before, nothing waited and the light tenant waited for a flood job to end."""
    from dataclasses import replace

    rt = _QueueRuntime()
    loop = _queue_loop(rt)
    flood = [_queued(f"f{i}", "P2", 100, 400) for i in range(3)]
    for d in flood:
        d.claimed = replace(d.claimed, tenant="flood")
    rt.queue = flood
    await _looks(loop, 3)
    assert len(rt.held) == 3 and not loop.sched.waiting
    assert loop._tenant_lookahead() == ("", ["flood"], "P2")


async def test_claim_is_told_the_models_context_when_it_is_shorter_than_the_kv() -> None:
    """Claim was told the worker's KV as what it can ever hold: with a model whose context is
    shorter (a 16K model on a 64K KV), the worker took prompts past its context and refused
    them (400), where a bigger worker of the pool would have served them (a review)."""
    from worker.claim_step_loop import StepLoop

    rt = _QueueRuntime()
    loop = StepLoop(rt, SimEngine(time_scale=0, kv_capacity_tokens=1000, max_seq_len=200),  # type: ignore[arg-type]
                    Limits(token_budget=64, max_seqs=rt.settings.max_seqs, kv_capacity=1000))
    rt.queue = [_queued("long", "P1", 500, 10), _queued("short", "P1", 50, 10)]
    await _looks(loop, 1)
    assert rt.totals and set(rt.totals) == {200}
    assert "short" in rt.held and "long" not in rt.held  # left to a worker whose model holds it


async def test_a_p0_reaches_a_worker_a_few_tokens_short_of_full_as_it_does_one_exactly_full() -> None:
    """Two P2 jobs reserve 990 of 1000 KV tokens: the P0 (100) did not fit the 10 left, closed
    its class for the claim, and the look-ahead (which takes it and preempts a P2 for it) was
    never tried since the batch was not full: the P0 waited for a P2 to finish. At 1000 of
    1000 it was claimed at once; now both are."""
    for p2_max in (400, 395):
        rt = _QueueRuntime()
        loop = _queue_loop(rt)
        rt.queue = [_queued("p2a", "P2", 100, p2_max), _queued("p2b", "P2", 100, p2_max)]
        await _looks(loop, 1)
        rt.queue = [_queued("p0", "P0", 50, 50)]
        await _looks(loop, 3)
        assert "p0" in rt.held, p2_max
        assert "p0" in {q.request_id for q in loop.sched.running}, p2_max  # a P2 preempted for it


def test_a_tenant_behind_in_a_lower_class_does_not_take_the_p0_prompts_step_away() -> None:
    """A P0 prompt goes in at once (top_prefill_tokens); a tenant behind in a lower class had
    the step sized to the decoders' TPOT targets, and the P0's 2,000-token prompt went in 516
    tokens a step, 4 steps (found by a review of the worker's scheduling)."""
    def fit() -> StepBudget:
        b = StepBudget(BudgetConfig(tpot_ms=(50.0, 150.0, None), min_budget=8, max_budget=512))
        for p, d in [(0, 4), (100, 4), (400, 2), (50, 8), (300, 6), (0, 1)]:
            b.observe(p, d, 10 + 0.06 * p + 1.0 * d)
        return b

    async def p0_prefill_steps(behind: bool) -> int:
        sched = BatchScheduler(SimEngine(time_scale=0), Limits(token_budget=512, max_seqs=8), fit(), 2048)
        sp = SamplingParams(max_tokens=500)
        for i in range(3):  # tenant A: three P2 streams
            sched.add(f"A{i}", [1] * 20, sp, class_rank=2, arrival=i, tenant="A")
        sched.add("S0", [1] * 20, sp, class_rank=0, arrival=5, tenant="Y")
        for _ in range(2):
            await sched.step()
        sched.add("P0", [1] * 2000, sp, class_rank=0, arrival=10, tenant="X")
        if behind:  # tenant B: one P2 prompt against A's three streams
            sched.add("B0", [1] * 30, sp, class_rank=2, arrival=11, tenant="B")
        steps = 0
        while steps == 0 or sched._seqs["P0"].to_prefill > 0:
            sched.budget = fit()  # (the sim steps at time scale 0 took no time: keep the fit)
            await sched.step()
            steps += 1
        return steps

    assert asyncio.run(p0_prefill_steps(False)) == 1
    assert asyncio.run(p0_prefill_steps(True)) == 1
