"""Engines: the sim cost model, torch determinism, resume equality, checkpoints, plan checks."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from limiter.errors import ConfigError, InvalidArgument
from tests.support.helpers import wait_until
from tests.support.torch_device import DEVICE
from worker.batch_policy import Limits, PrefillChunk, StepPlan
from worker.batch_scheduler import BatchScheduler
from worker.engines.base import Engine, SamplingParams
from worker.engines.sim import CostModel, SimEngine
from worker.engines.torch_engine import (
    TorchEngine,
    default_dtype,
    derive_seed,
    load_checkpoint,
    save_checkpoint,
)
from worker.local_run import LocalRequest, run_local
from worker.model import ModelConfig, build_model
from worker.tokenizer import BOS_ID

torch.set_num_threads(2)

PROMPT = tuple(BOS_ID if i == 0 else 32 + (i * 7) % 95 for i in range(40))


def tiny_engine(seed: int = 0, device: str = DEVICE) -> TorchEngine:
    """fp32 on any device: the claims below (same seed, same tokens; a resume continues
    identically) hold at fp32's rounding; bf16's are measured by tests/bench_torch_gpu.py."""
    return TorchEngine.from_preset("tiny", seed=seed, device=device, dtype=torch.float32,
                                   kv_capacity_tokens=8192)


def generate(engine: Engine, prompt: tuple[int, ...], params: SamplingParams, budget: int = 16) -> list[int]:
    """Greedy/sampled continuation via the real loop; a small budget chunks the prompt."""
    run = asyncio.run(
        run_local(engine, [LocalRequest("r", prompt, params)], Limits(token_budget=budget, max_seqs=4))
    )
    return run.traces["r"].tokens


# --- sim ---------------------------------------------------------------------------------


def test_sim_cost_model_matches_the_documented_figures() -> None:
    cost = CostModel()
    assert 1.9 < cost.cost(32768, 0, 32768) < 2.1  # the original problem's ~2 s 32K prefill
    assert 0.020 < cost.cost(0, 8, 8 * 4096) < 0.030  # ~25 ms decode step, 8 seqs at 4K


@pytest.mark.asyncio
async def test_sim_step_sleeps_for_the_cost_model_times_time_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    scale = 0.1
    eng = SimEngine(time_scale=scale)
    eng.add("long", [BOS_ID] + [65] * 32767, SamplingParams())
    eng.add("short", [BOS_ID, 66], SamplingParams())
    plan = StepPlan(prefill=(PrefillChunk("long", 0, 32768),))
    expected = eng.plan_cost(plan)
    # the sleeps the step asks for, exactly (a wall-clock bound on them failed on a busy machine
    # or passed a double sleep on a fast one); the sleep itself still runs
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await real_sleep(seconds)

    monkeypatch.setattr("worker.engines.sim.asyncio.sleep", sleep)
    out = await eng.step(plan)
    assert expected == pytest.approx(CostModel().cost(32768, 0, 32768))
    assert slept == [pytest.approx(expected * scale)]
    assert list(out) == ["long"]  # its prompt completed: first token
    await eng.step(StepPlan(prefill=(PrefillChunk("short", 0, 2),)))
    plan = StepPlan(decode=("short", "long"))
    assert eng.plan_cost(plan) == pytest.approx(CostModel().cost(0, 2, 32769 + 3))


def test_sim_output_is_deterministic_valid_text_and_resumes_identically() -> None:
    eng = SimEngine(time_scale=0)
    assert eng.simulated and eng.name == "sim"
    straight = generate(eng, PROMPT, SamplingParams(max_tokens=20))
    text = eng.new_decoder().feed(straight)
    assert len(text) == 20 and text.isprintable()
    resumed = generate(SimEngine(time_scale=0), PROMPT + tuple(straight[:8]), SamplingParams(max_tokens=12))
    assert straight[8:] == resumed


@pytest.mark.asyncio
async def test_engines_reject_plans_that_do_not_match_their_state() -> None:
    for eng in (SimEngine(time_scale=0), tiny_engine()):
        eng.add("a", [BOS_ID, 1, 2, 3], SamplingParams())
        with pytest.raises(InvalidArgument):
            await eng.step(StepPlan(prefill=(PrefillChunk("a", 1, 2),)))  # wrong offset
        with pytest.raises(InvalidArgument):
            await eng.step(StepPlan(prefill=(PrefillChunk("a", 0, 9),)))  # past the prompt
        with pytest.raises(InvalidArgument):
            await eng.step(StepPlan(decode=("a",)))  # still prefilling
        with pytest.raises(InvalidArgument):
            await eng.step(StepPlan(decode=("ghost",)))
        with pytest.raises(InvalidArgument):
            eng.add("a", [1], SamplingParams())  # duplicate
        with pytest.raises(InvalidArgument):
            eng.add("b", [999], SamplingParams())
        with pytest.raises(InvalidArgument, match="twice"):
            await eng.step(StepPlan(prefill=(PrefillChunk("a", 0, 2), PrefillChunk("a", 0, 2))))
        out = await eng.step(StepPlan(prefill=(PrefillChunk("a", 0, 4),)))  # state unharmed
        assert set(out) == {"a"}
        with pytest.raises(InvalidArgument, match="twice"):
            await eng.step(StepPlan(decode=("a", "a")))
        eng.add("b", [BOS_ID, 1], SamplingParams())
        out = await eng.step(StepPlan(decode=("a",), prefill=(PrefillChunk("b", 0, 2),)))
        assert set(out) == {"a", "b"}
        # each step's tokens went to the sequence the plan named: both decode now
        assert set(await eng.step(StepPlan(decode=("a", "b")))) == {"a", "b"}


# --- torch -------------------------------------------------------------------------------


def test_torch_engine_is_deterministic_for_a_seed() -> None:
    params = SamplingParams(temperature=0.8, seed=123, max_tokens=16)
    a = generate(tiny_engine(), PROMPT, params)
    b = generate(tiny_engine(), PROMPT, params)
    c = generate(tiny_engine(), PROMPT, SamplingParams(temperature=0.8, seed=124, max_tokens=16))
    assert a == b and len(a) == 16
    assert a != c  # another sampling seed, another stream
    assert generate(tiny_engine(), PROMPT, SamplingParams(max_tokens=16)) == generate(
        tiny_engine(), PROMPT, SamplingParams(max_tokens=16, seed=99)
    )  # greedy ignores the seed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_resume_from_prompt_plus_generated_continues_identically(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=20)
    straight = generate(tiny_engine(), PROMPT, params)
    resumed = generate(
        tiny_engine(),
        PROMPT + tuple(straight[:8]),
        SamplingParams(temperature=temperature, seed=7, max_tokens=12),
    )
    assert len(straight) == 20
    assert resumed == straight[8:]


def test_a_subnormal_temperature_samples_as_greedy_not_the_first_token() -> None:
    """logits / T overflowed to inf for a subnormal T (the frontend takes any temperature in
    [0, 2]), and argmax picked the first infinite entry, not the largest logit (found by a
    review)."""
    from worker.engines.torch_engine import sample_token

    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    for temperature in (1e-310, 5e-324, 1e-12):
        assert sample_token(logits, temperature, seed=7, position=3) == 1 == sample_token(logits, 0.0, 7, 3)


def test_a_huge_temperature_samples_near_uniformly_not_the_lowest_ids() -> None:
    """argmax(logits + T * gumbel): for T above ~5e306 the product overflowed to +-inf, and
    argmax took the first infinite entry, so nearly every token was one of the lowest ids
    (97 % of them below 10 of 259 at T = 1.79e308) instead of a draw from softmax(logits / T),
    which at such a T is uniform (found by a review)."""
    from collections import Counter

    from worker.engines.torch_engine import sample_token

    logits = torch.zeros(259)
    for temperature in (1e308, 1.7976931348623157e308):
        counts = Counter(sample_token(logits, temperature, seed=7, position=p) for p in range(2000))
        low = sum(n for tok, n in counts.items() if tok < 10) / 2000
        assert low < 0.1 and len(counts) > 200, (temperature, low, len(counts))
    # a large finite T still flattens a real gap between logits
    gap = torch.tensor([0.0, 50.0])
    picks = [sample_token(gap, 1e300, seed=3, position=p) for p in range(400)]
    assert 100 < picks.count(0) < 300


def test_an_engine_whose_cache_could_not_be_made_can_take_the_id_again() -> None:
    """TorchEngine.add entered the sequence in its table before making its cache: a cache
    that could not be made (a CUDA OOM) left the id in the table for good, and every later
    claim of the request on this worker failed ('already allocated'; found by a review)."""
    eng = tiny_engine()
    real, failures = eng.model.new_cache, [torch.OutOfMemoryError("CUDA out of memory (simulated)")]

    def new_cache(capacity: int = 64, limit: int | None = None, room=None):
        if failures:
            raise failures.pop()
        return real(capacity, limit, room)

    eng.model.new_cache = new_cache
    with pytest.raises(torch.OutOfMemoryError):
        eng.add("x", list(PROMPT), SamplingParams(max_tokens=4))
    eng.add("x", list(PROMPT), SamplingParams(max_tokens=4))  # the same id, claimed again
    eng.remove("x")
    assert generate(eng, PROMPT, SamplingParams(max_tokens=4)) == generate(tiny_engine(), PROMPT,
                                                                          SamplingParams(max_tokens=4))


def test_plans_stay_within_the_engines_kv_when_the_limits_allow_more() -> None:
    """The planner counted KV against limits.kv_capacity (default 1M) while the engine held
    200 tokens: three 81-token prompts made a plan the engine refused ('plan needs 246 KV
    tokens, capacity is 200') on every step (found by a review)."""
    eng = TorchEngine.from_preset("tiny", seed=0, device=DEVICE, kv_capacity_tokens=200)
    prompts = [tuple(BOS_ID if i == 0 else 32 + (i * k) % 95 for i in range(81)) for k in (3, 5, 7)]
    run = asyncio.run(run_local(eng, [LocalRequest(f"r{k}", p, SamplingParams(max_tokens=8))
                                      for k, p in enumerate(prompts)], Limits(token_budget=64, max_seqs=4)))
    assert all(len(run.traces[f"r{k}"].tokens) == 8 for k in range(3))


def test_derive_seed_separates_positions_and_seeds() -> None:
    values = {derive_seed(s, p) for s in range(20) for p in range(50)}
    assert len(values) == 1000 and all(0 <= v < 2**63 for v in values)


def _hold_prefill(eng: TorchEngine, monkeypatch: pytest.MonkeyPatch
                  ) -> tuple[threading.Event, threading.Event, list[bool]]:
    """The engine's first prefill pass waits until the test lets it go: (started, release,
    released) -- ``released`` says whether the test released it (True) or it gave up
    waiting (False: whatever held it, the test could not run meanwhile)."""
    started, release, released = threading.Event(), threading.Event(), []
    prefill = eng.model.prefill

    def held(*args, **kwargs):
        if not started.is_set():
            started.set()
            released.append(release.wait(10))
        return prefill(*args, **kwargs)

    monkeypatch.setattr(eng.model, "prefill", held)
    return started, release, released


@pytest.mark.asyncio
async def test_torch_step_runs_off_the_event_loop(monkeypatch) -> None:
    """The loop keeps running while the model computes: here its forward pass is held until
    the loop has ticked five times (on the loop, it would hold the loop with it)."""
    eng = tiny_engine(device="cpu")
    eng.add("a", [BOS_ID] + [65] * 15, SamplingParams())
    started, release, released = _hold_prefill(eng, monkeypatch)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    step = asyncio.create_task(eng.step(StepPlan(prefill=(PrefillChunk("a", 0, 16),))))
    try:
        await wait_until(started.is_set, "the step's forward pass to start")
        held_at = ticks
        await wait_until(lambda: ticks >= held_at + 5, "the loop to tick while the forward pass is held")
        release.set()
        assert set(await step) == {"a"}
    finally:
        release.set()
        task.cancel()
    assert released == [True], "the forward pass held the event loop: the test could not release it"


@pytest.mark.asyncio
async def test_remove_during_a_step_drops_that_result(monkeypatch) -> None:
    eng = tiny_engine(device="cpu")
    eng.add("a", [BOS_ID] + [65] * 15, SamplingParams())
    eng.add("b", [BOS_ID, 66], SamplingParams())
    started, release, released = _hold_prefill(eng, monkeypatch)
    task = asyncio.create_task(
        eng.step(StepPlan(prefill=(PrefillChunk("a", 0, 16), PrefillChunk("b", 0, 2))))
    )
    try:
        await wait_until(started.is_set, "the step's forward pass to start")  # the step is running
        eng.remove("a")
    finally:
        release.set()
    assert set(await task) == {"b"}
    assert released == [True]


@pytest.mark.asyncio
async def test_a_cancelled_step_waits_for_its_thread_then_rolls_back() -> None:
    """A thread cannot be stopped: a step cancelled (a drain's deadline) returned at once while
    its forward passes ran on, writing the caches after the roll-back, beside the next step or
    a remove(). It waits for them now (the engine busy meanwhile), then rolls back, and the
    sequence's next step gives the token an engine never interrupted gives."""
    eng, fresh = tiny_engine(device="cpu"), tiny_engine(device="cpu")
    prompt = [BOS_ID] + [65] * 15
    for e in (eng, fresh):
        e.add("a", prompt, SamplingParams())
    started, release = threading.Event(), threading.Event()
    compute = eng._compute

    def held_compute(*args):  # the step's thread: runs until the test lets it go
        started.set()
        release.wait(60)
        return compute(*args)

    eng._compute = held_compute
    plan = StepPlan(prefill=(PrefillChunk("a", 0, 16),))
    task = asyncio.create_task(eng.step(plan))
    await wait_until(started.is_set, "the step's thread to start")
    task.cancel()
    for _ in range(50):  # the cancellation is delivered; the step must still wait for its thread
        await asyncio.sleep(0)
    assert not task.done() and eng._busy, "the cancelled step left its thread running"
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert eng._caches["a"].length == eng._table.seqs["a"].kv_len == 0 and not eng._busy
    eng._compute = compute
    assert await eng.step(plan) == await fresh.step(plan)


async def test_a_step_cancelled_before_its_thread_starts_runs_no_forward_pass() -> None:
    """The step's thread may start late (the loop's executor busy): a step cancelled before
    then ran its forward passes anyway, a whole step's time after its cancel (a drain's
    deadline). The thread now looks at the cancel before each pass, so it runs none; one
    cancelled during a pass starts no further one. Either way the caches are rolled back."""
    from concurrent.futures import ThreadPoolExecutor

    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=1)
    loop.set_default_executor(pool)
    eng, fresh = tiny_engine(device="cpu"), tiny_engine(device="cpu")
    prompt = [BOS_ID] + [65] * 15
    for e in (eng, fresh):
        e.add("a", prompt, SamplingParams())
        e.add("b", prompt, SamplingParams())
    passes: list[str] = []
    started, release = threading.Event(), threading.Event()
    prefill = eng.model.prefill

    def counted_prefill(ids, cache):  # the first pass is held until the test lets it go
        passes.append("prefill")
        started.set()
        release.wait(60)
        return prefill(ids, cache)

    eng.model.prefill = counted_prefill
    plan = StepPlan(prefill=(PrefillChunk("a", 0, 16), PrefillChunk("b", 0, 16)))
    try:
        blocker = threading.Event()
        busy = loop.run_in_executor(None, blocker.wait, 60)  # the executor's one thread, taken
        task = asyncio.create_task(eng.step(plan))
        for _ in range(20):
            await asyncio.sleep(0)
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done() and eng._busy, "the cancelled step did not wait for its thread"
        blocker.set()
        await busy
        with pytest.raises(asyncio.CancelledError):
            await task
        assert passes == [], "a step cancelled before its thread started ran its passes"
        release.set()  # from here the passes run at once

        release.clear()
        task = asyncio.create_task(eng.step(plan))
        await wait_until(started.is_set, "the step's first pass to start")
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert passes == ["prefill"], "a step cancelled during its first pass started another"
        assert all(eng._caches[s].length == eng._table.seqs[s].kv_len == 0 for s in "ab")
        eng.model.prefill = prefill
        assert await eng.step(plan) == await fresh.step(plan)
    finally:
        release.set()
        pool.shutdown(wait=True)


def test_checkpoint_round_trip_and_mismatch(tmp_path: Path) -> None:
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=160, max_seq_len=256)
    model = build_model(cfg, seed=3, device=DEVICE)
    path = tmp_path / "m.safetensors"
    save_checkpoint(model, path)
    loaded = load_checkpoint(path, device=DEVICE, dtype=torch.float32)
    assert loaded.cfg == cfg
    ids = torch.arange(10, device=DEVICE)
    with torch.inference_mode():
        torch.testing.assert_close(
            loaded.prefill(ids, loaded.new_cache()), model.prefill(ids, model.new_cache())
        )
    eng = TorchEngine.from_checkpoint(path, device=DEVICE, kv_capacity_tokens=1024)
    assert eng.dtype == default_dtype(torch.device(DEVICE)) and eng.kv_capacity_tokens == 1024
    with pytest.raises(ConfigError, match="do not match"):
        load_checkpoint(path, config=ModelConfig(n_layer=3, n_head=4, d_model=64, d_ff=160))
    with pytest.raises(ConfigError, match="not found"):
        load_checkpoint(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError):
        load_checkpoint(tmp_path / "junk.safetensors")


@pytest.mark.parametrize("name", ["x" * 300, "a\x00b"])
def test_a_checkpoint_path_that_cannot_name_a_file_is_a_config_error(tmp_path: Path, name: str) -> None:
    """A name past NAME_MAX (Path.is_file()'s OSError ENAMETOOLONG) was a traceback at a torch
    worker's start, not an error naming the checkpoint."""
    with pytest.raises(ConfigError, match="checkpoint file not found"):
        load_checkpoint(str(tmp_path / name))


@pytest.mark.parametrize("vocab", [256, 512])
def test_a_checkpoint_of_another_vocabulary_is_refused_at_startup(tmp_path: Path, vocab: int) -> None:
    """The torch engine speaks the byte vocabulary (259 ids: bytes, BOS, EOS, PAD), but any
    vocab_size loaded: a 512-id checkpoint started, then sampled ids the decoder refuses
    ('token id 451 is outside 0..258') and the step failed every request the worker held; a
    256-id one refused every prompt (its BOS). The shape check promises a checkpoint of
    another architecture fails loudly at startup (found by a review)."""
    cfg = ModelConfig(vocab_size=vocab, n_layer=1, n_head=2, n_kv_head=1, d_model=32, d_ff=64,
                      max_seq_len=256)
    path = tmp_path / "m.safetensors"
    save_checkpoint(build_model(cfg, seed=1, device=DEVICE), path)
    with pytest.raises(ConfigError, match="vocab"):
        TorchEngine.from_checkpoint(path, device=DEVICE, kv_capacity_tokens=1024)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"seed": -1},
        {"seed": 2**63},
        {"max_tokens": 0},
        {"stop": ["x"]},
        {"stop": ("",)},
    ],
)
def test_sampling_params_are_validated(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def _kv_allocated(eng: TorchEngine) -> int:
    """KV token slots the torch engine has allocated (its caches' capacities)."""
    return sum(c.capacity for c in eng._caches.values())


def _kv_accounted(sched: BatchScheduler) -> int:
    """KV tokens the scheduler (and the claim's reservation) count for the sequences the
    engine holds: each one's prompt + max_tokens."""
    return sum(len(s.prompt_ids) + s.params.max_tokens for s in sched._seqs.values()
               if s.running or s.resident)


@pytest.mark.asyncio
async def test_torch_kv_allocation_stays_within_what_the_scheduler_accounts() -> None:
    """KVCache grew by doubling, capped only at max_seq_len, from prompt + 64: four sequences of
    30 + 100 tokens, reserved exactly kv_capacity_tokens (520, as a claim reserves), held 752
    token slots once they passed 94 tokens (1.45x; 1.65x in the review's run with eight). A
    cache now never grows past what its sequence can use (prompt + max_tokens - 1, the last
    token is never fed back): no slack beyond the accounted KV at any step (found by a review)."""
    cap = 4 * (30 + 100)
    eng = TorchEngine.from_preset("tiny", seed=0, device=DEVICE, kv_capacity_tokens=cap)
    sched = BatchScheduler(eng, Limits(token_budget=256, max_seqs=4, kv_capacity=cap))
    for i in range(4):
        sched.add(f"r{i}", [BOS_ID] + [40 + i] * 29, SamplingParams(max_tokens=100), class_rank=2, arrival=i)
    peak, steps = 0, 0
    while len(sched):
        await sched.step()
        steps += 1
        allocated, accounted = _kv_allocated(eng), _kv_accounted(sched)
        assert allocated <= accounted <= cap, \
            f"step {steps}: {allocated} slots allocated, {accounted} accounted"
        peak = max(peak, allocated)
    assert peak > 4 * (30 + 64), "no cache grew: the test proves nothing"


@pytest.mark.asyncio
async def test_torch_kv_allocation_stays_within_the_capacity_when_reservations_pass_it() -> None:
    """Sequences whose prompt + max_tokens pass kv_capacity_tokens together (a look-ahead
    request started on KV used; run_local): each cache doubled within its own limit, so four
    of 30 + 200 tokens held 752 slots of a 400-token KV at 95 tokens each (380 used). A cache
    now grows within the KV left, and past it by GROW_PAST_ROOM beyond its need: here the
    slots allocated stay within the capacity plus that (and the step's token) per sequence."""
    from worker.model import GROW_PAST_ROOM

    cap = 400
    eng = TorchEngine.from_preset("tiny", seed=0, device=DEVICE, kv_capacity_tokens=cap)
    ids = [f"r{i}" for i in range(4)]
    for i, rid in enumerate(ids):
        eng.add(rid, [BOS_ID] + [40 + i] * 29, SamplingParams(max_tokens=200))
    await eng.step(StepPlan(prefill=tuple(PrefillChunk(rid, 0, 30) for rid in ids)))
    steps = 0
    while sum(eng._table.seqs[rid].kv_len for rid in ids) + len(ids) <= cap:
        await eng.step(StepPlan(decode=tuple(ids)))
        steps += 1
        allocated = _kv_allocated(eng)
        held = sum(eng._table.seqs[rid].kv_len for rid in ids)
        bound = cap + len(ids) * (GROW_PAST_ROOM + 1)
        assert allocated <= bound, f"step {steps}: {allocated} slots allocated for {held} tokens held"
    assert steps > 64, "no cache had to grow: the test proves nothing"


@pytest.mark.asyncio
async def test_torch_kv_of_a_sequence_readmitted_after_its_kv_was_freed_stays_within_its_account() -> None:
    """A sequence paused with its KV freed is added again with prompt + generated tokens as its
    context: its cache must be sized from the rest of its max_tokens, not a whole max_tokens
    more (the scheduler counts the original prompt + max_tokens)."""
    cap = 400
    eng = TorchEngine.from_preset("tiny", seed=0, device=DEVICE, kv_capacity_tokens=cap)
    sched = BatchScheduler(eng, Limits(token_budget=512, max_seqs=4, kv_capacity=cap))
    sched.add("low", [BOS_ID] + [41] * 29, SamplingParams(max_tokens=200), class_rank=2, arrival=0)
    seen_readmitted = False
    steps = 0
    while len(sched):
        if steps == 100:  # "low" at 129 KV tokens: the top-class prompt needs its KV freed
            sched.add("top", [BOS_ID] + [42] * 299, SamplingParams(max_tokens=20), class_rank=0, arrival=1)
        res = await sched.step()
        steps += 1
        low = sched.seq("low")
        if "low" in res.admitted and low is not None and low.generated:
            seen_readmitted = True
        for rid, cache in eng._caches.items():
            s = sched.seq(rid)
            assert s is not None and cache.capacity <= len(s.prompt_ids) + s.params.max_tokens, \
                f"step {steps}: {rid} holds {cache.capacity} slots, " \
                f"accounted {len(s.prompt_ids)} + {s.params.max_tokens}"
        assert _kv_allocated(eng) <= _kv_accounted(sched)
    assert sched.preemptions == 1 and sched.recompute_tokens > 0 and seen_readmitted, \
        "no pause freed the KV and readmitted it: the test proves nothing"
