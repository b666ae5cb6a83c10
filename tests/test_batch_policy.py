"""The pure batch builder: budget, decode-first, priority, chunking, admission, preemption."""

from __future__ import annotations

import dataclasses
import random

import pytest

from limiter.errors import InvalidArgument
from worker.batch_policy import (
    Candidate,
    Limits,
    Preemption,
    PrefillChunk,
    SeqState,
    build_plan,
    choose_admissions,
    choose_preemption,
    floor_slots,
    kv_demand,
    prefill_through_behind,
)


def dec(rid: str, rank: int, arrival: float, kv: int = 100) -> SeqState:
    return SeqState(rid, rank, arrival, to_prefill=0, decoding=True, kv_tokens=kv)


def pre(rid: str, rank: int, arrival: float, left: int, kv: int = 0) -> SeqState:
    return SeqState(rid, rank, arrival, to_prefill=left, decoding=False, kv_tokens=kv)


def test_decode_first_in_class_order_then_prefill_gets_the_rest() -> None:
    running = [pre("long", 2, 0, 5000), dec("d2", 2, 1), dec("d0", 0, 5), dec("d1", 1, 2)]
    plan = build_plan(running, Limits(token_budget=512))
    assert plan.decode == ("d0", "d1", "d2")
    assert plan.prefill == (PrefillChunk("long", 0, 509),)
    assert plan.num_tokens == 512


def test_prefill_chunks_follow_class_then_arrival() -> None:
    running = [
        pre("c2", 2, 0, 300),
        pre("c1-late", 1, 9, 300),
        pre("c1-early", 1, 3, 300),
        pre("c0", 0, 7, 100),
    ]
    plan = build_plan(running, Limits(token_budget=512))
    assert [(c.request_id, c.length) for c in plan.prefill] == [
        ("c0", 100),
        ("c1-early", 300),
        ("c1-late", 112),
    ]
    assert plan.decode == ()


def test_chunks_continue_at_the_kv_offset_until_the_prompt_is_done() -> None:
    limits = Limits(token_budget=512)
    state = pre("a", 1, 0, 1000)
    plan = build_plan([state, pre("b", 1, 1, 50)], limits)
    assert plan.prefill == (PrefillChunk("a", 0, 512),)
    state = pre("a", 1, 0, 488, kv=512)
    plan = build_plan([state, pre("b", 1, 1, 50)], limits)
    assert plan.prefill == (PrefillChunk("a", 512, 488), PrefillChunk("b", 0, 24))


def test_without_chunking_a_prompt_is_prefilled_whole_in_one_step() -> None:
    limits = Limits(token_budget=512, chunked_prefill=False)
    plan = build_plan([dec("short", 0, 0), pre("long", 2, 1, 32000)], limits)
    assert plan.decode == ("short",)
    assert plan.prefill == (PrefillChunk("long", 0, 32000),)  # the long-prefill stall, on purpose
    # a second prompt that no longer fits waits whole; it is never split
    plan = build_plan([pre("a", 1, 0, 400), pre("b", 1, 1, 200), pre("c", 2, 2, 10)], limits)
    assert plan.prefill == (PrefillChunk("a", 0, 400),)
    plan = build_plan([pre("a", 1, 0, 400), pre("b", 1, 1, 100)], limits)
    assert plan.prefill == (PrefillChunk("a", 0, 400), PrefillChunk("b", 0, 100))


def test_more_decoders_than_budget_skips_the_lowest_priority() -> None:
    running = [dec(f"r{i}", i % 3, i) for i in range(10)]
    plan = build_plan(running, Limits(token_budget=4, max_seqs=4))
    assert plan.decode == ("r0", "r3", "r6", "r9")


def test_kv_capacity_bounds_the_step() -> None:
    running = [dec("d", 0, 0, kv=900), pre("p", 1, 1, 500, kv=0)]
    plan = build_plan(running, Limits(token_budget=512, kv_capacity=1000))
    assert plan.decode == ("d",)
    assert plan.prefill == (PrefillChunk("p", 0, 99),)


def test_max_seqs_bounds_the_step() -> None:
    running = [dec("d", 0, 0), pre("p", 1, 1, 10), pre("q", 1, 2, 10)]
    assert build_plan(running, Limits(max_seqs=2)).prefill == (PrefillChunk("p", 0, 10),)


def test_random_workloads_never_exceed_the_budget_and_finish() -> None:
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 6)
        budget = rng.choice([6, 7, 64, 512])
        limits = Limits(token_budget=budget, max_seqs=n, chunked_prefill=rng.random() < 0.7)
        prompts = {f"s{i}": rng.randint(1, 2000) for i in range(n)}
        kv = dict.fromkeys(prompts, 0)
        for _step in range(10_000):
            running = [
                SeqState(r, i % 3, i, prompts[r] - kv[r], kv[r] >= prompts[r], kv[r])
                for i, r in enumerate(prompts)
            ]
            plan = build_plan(running, limits)
            if limits.chunked_prefill:
                assert plan.num_tokens <= budget
            else:
                assert plan.num_tokens <= budget or len(plan.prefill) == 1
            for c in plan.prefill:
                assert c.start == kv[c.request_id]
                kv[c.request_id] += c.length
            assert len(plan.decode) + len(plan.prefill) > 0
            if all(kv[r] >= prompts[r] for r in prompts):
                break
        assert all(kv[r] == prompts[r] for r in prompts)


def test_admission_takes_priority_order_within_slots_and_kv() -> None:
    waiting = [Candidate("w2", 2, 0, 10), Candidate("w0", 0, 5, 10), Candidate("w1", 1, 1, 10)]
    assert choose_admissions(waiting, [], Limits()) == ("w0", "w1", "w2")
    assert choose_admissions(waiting, [dec("r", 0, 0)], Limits(max_seqs=3)) == ("w0", "w1")
    # KV: running needs 100 + 1 (next decode) + 50 to prefill; room for one 10-token prompt (+1)
    running = [dec("r", 0, 0, kv=100), pre("p", 1, 0, 50)]
    assert choose_admissions(waiting, running, Limits(kv_capacity=162)) == ("w0",)
    assert choose_admissions(waiting, running, Limits(kv_capacity=161)) == ()


def test_admission_does_not_let_small_low_class_prompts_skip_a_big_one() -> None:
    waiting = [Candidate("big", 0, 0, 900), Candidate("small", 2, 1, 5)]
    assert choose_admissions(waiting, [dec("r", 1, 0, kv=200)], Limits(kv_capacity=1000)) == ()


def test_preemption_picks_lowest_class_then_least_kv_then_most_recent() -> None:
    running = [dec("a0", 0, 0), dec("b2-old", 2, 1), dec("c2-new", 2, 7), dec("d1", 1, 9)]
    waiting = [Candidate("w0", 0, 10, 20)]
    assert choose_preemption(running, waiting, Limits(max_seqs=4)) == Preemption("c2-new", free_kv=False)
    assert choose_preemption(running[:2] + running[3:], waiting, Limits(max_seqs=3)).request_id == "b2-old"
    # the least to recompute goes first: a 32K prompt half prefilled is not the victim
    running = [dec("a0", 0, 0), pre("big", 2, 1, left=16000, kv=16000), dec("small", 2, 0, kv=50)]
    assert choose_preemption(running, waiting, Limits(max_seqs=3)).request_id == "small"


def test_a_pause_keeps_the_kv_when_only_a_slot_was_short() -> None:
    """Slots short, KV ample: the victim keeps its cache (nothing recomputed); its kept KV
    counts against capacity until it is readmitted, and is what goes first when KV runs short."""
    running = [dec("a", 0, 0, kv=100), dec("low", 2, 1, kv=300)]
    head = Candidate("w", 0, 2, 50)
    limits = Limits(max_seqs=2, kv_capacity=1000)
    assert choose_preemption(running, [head], limits) == Preemption("low", False)
    kept = Candidate("low", 2, 1, 0, resident_kv=300)
    assert kv_demand(running[:1], [kept]) == 101 + 300
    assert choose_admissions([head, kept], running[:1], Limits(max_seqs=2, kv_capacity=1000)) == ("w",)
    # KV short: a waiting sequence's kept KV is freed before anything running is paused
    big = Candidate("big", 1, 3, 700)
    assert choose_preemption(running[:1], [big, kept], Limits(kv_capacity=1000)) == Preemption("low", True)
    # the running set overflows: the lowest kept KV goes first
    overflow = choose_preemption([dec("a", 0, 0, kv=900)], [kept], Limits(kv_capacity=1000))
    assert overflow == Preemption("low", True)


def test_tenants_of_a_class_share_its_slots_evenly() -> None:
    """A full batch of one class: a tenant holding two more of its slots than the waiting
    request's tenant gives one up (kept KV); admission goes to the tenant with fewer slots."""
    def run(rid: str, tenant: str, arrival: float) -> SeqState:
        return SeqState(rid, 1, arrival, 0, True, 100, tenant)

    flood = [run(f"f{i}", "flood", i) for i in range(3)]
    light = Candidate("l", 1, 10, 50, tenant="light")
    assert choose_preemption(flood, [light], Limits(max_seqs=3)) == Preemption("f2", free_kv=False)
    # flood 2, light 1 already: less than two apart, nothing moves
    assert choose_preemption([*flood[:2], run("l0", "light", 5)], [light], Limits(max_seqs=3)) is None
    # once even (within one), nothing moves: no ping-pong
    even = [run("f0", "flood", 0), run("l0", "light", 1)]
    assert choose_preemption(even, [Candidate("f9", 1, 2, 10, tenant="flood")], Limits(max_seqs=2)) is None
    # admission within a class: the tenant with fewer slots first, arrival order otherwise
    waiting = [Candidate("f3", 1, 3, 10, tenant="flood"), Candidate("l1", 1, 9, 10, tenant="light")]
    assert choose_admissions(waiting, flood[:2], Limits(max_seqs=3)) == ("l1",)
    # a higher class still comes first, whatever the tenants
    assert choose_admissions([*waiting, Candidate("p0", 0, 20, 10, tenant="flood")], flood[:2],
                             Limits(max_seqs=3)) == ("p0",)


def test_inside_a_class_the_tenant_with_fewest_slots_prefills_first() -> None:
    """A light tenant's prompt admitted next to a flood's prefills ahead of the flood's
    earlier prompts (in arrival order it waited ~10 steps); a higher class still comes first
    and the flood's own prompts keep their arrival order."""
    def run(rid: str, rank: int, tenant: str, arrival: float, left: int = 0) -> SeqState:
        return SeqState(rid, rank, arrival, left, left == 0, 100, tenant)

    running = [run("f0", 1, "flood", 0, 2000), run("f1", 1, "flood", 1, 2000), run("f2", 1, "flood", 2),
               run("l0", 1, "light", 5, 800), run("p0", 0, "flood", 9, 100)]
    plan = build_plan(running, Limits(token_budget=512))
    assert plan.decode == ("f2",)
    assert [(c.request_id, c.length) for c in plan.prefill] == [("p0", 100), ("l0", 411)]
    plan = build_plan([r for r in running if r.request_id not in ("p0", "l0")], Limits(token_budget=512))
    assert [(c.request_id, c.length) for c in plan.prefill] == [("f0", 511)]
    # classes without tenant fairness carry no tenant: arrival order, as before
    plan = build_plan([run("a", 1, "", 0, 400), run("b", 1, "", 1, 400)], Limits(token_budget=512))
    assert [c.request_id for c in plan.prefill] == ["a", "b"]


def test_a_step_for_a_tenant_behind_in_its_class_takes_its_prompts_and_what_goes_before_them() -> None:
    """What a step needs to prefill at once the prompts of a tenant behind in its class (at
    least two fewer of its class's slots than another tenant of it; worker/batch_scheduler.py
    sizes such a step to this): those prompts and the prompts of the classes between the top
    one and theirs, never the richer tenant's own prompts."""
    def run(rid: str, rank: int, tenant: str, left: int = 0) -> SeqState:
        return SeqState(rid, rank, 0, left, left == 0, 100, tenant)

    flood = [run(f"f{i}", 1, "flood") for i in range(3)]
    assert prefill_through_behind([*flood, run("l", 1, "light", 900)]) == 900  # 1 slot against 3
    assert prefill_through_behind([*flood[:2], run("l", 1, "light", 900)]) == 0  # 1 against 2: even
    assert prefill_through_behind([run("l", 1, "light", 900)]) == 0  # alone: behind nobody
    # only what is left to prefill counts; the rich tenant's own prompts never do
    assert prefill_through_behind([*flood, run("f3", 1, "flood", 500), run("l", 1, "light", 900),
                                   run("l2", 1, "light")]) == 900
    # tenants of other classes are not compared; classes without fairness (tenant '') never are
    assert prefill_through_behind([*flood, run("p0", 0, "light", 300)]) == 0
    assert prefill_through_behind([run(f"x{i}", 1, "") for i in range(4)] + [run("y", 1, "", 50)]) == 0
    # behind in P2: P1's prompts go first (build_plan), so they count; P0's are the scheduler's
    low = [run(f"g{i}", 2, "flood") for i in range(3)]
    assert prefill_through_behind([*low, run("l", 2, "light", 900), run("p1", 1, "", 400),
                                   run("p0", 0, "", 70), run("g3", 2, "flood", 800)]) == 1300
    # behind in the top class only: its prompts go in at once anyway (top_prefill_tokens)
    top = [run(f"t{i}", 0, "flood") for i in range(3)]
    assert prefill_through_behind([*top, run("l", 0, "light", 900)]) == 0


def test_no_preemption_without_need_or_benefit() -> None:
    running = [dec("a", 1, 0), dec("b", 1, 1)]
    assert choose_preemption(running, [Candidate("w", 1, 2, 10)], Limits(max_seqs=2)) is None  # same class
    assert choose_preemption(running, [Candidate("w", 0, 2, 10)], Limits(max_seqs=3)) is None  # room exists
    assert choose_preemption(running, [], Limits(max_seqs=2)) is None
    # pausing every lower-class sequence still would not fit a 5000-token prompt
    assert choose_preemption(running, [Candidate("w", 0, 2, 5000)], Limits(kv_capacity=1000)) is None


def test_preemption_for_kv_room() -> None:
    running = [dec("a", 0, 0, kv=400), pre("b", 2, 1, 100, kv=300)]
    waiting = [Candidate("w", 1, 2, 250)]
    # pausing b but keeping its 300 KV frees its 100 unprefilled tokens: enough for w's 251
    assert choose_preemption(running, waiting, Limits(kv_capacity=1000)) == Preemption("b", free_kv=False)
    # with less room b's cache must go
    assert choose_preemption(running, waiting, Limits(kv_capacity=900)) == Preemption("b", free_kv=True)
    assert choose_preemption(running, [], Limits(kv_capacity=1000)) is None


def test_preemption_when_decode_growth_overflows_kv() -> None:
    running = [dec("a", 0, 0, kv=500), dec("b", 1, 1, kv=500)]
    assert choose_preemption(running, [], Limits(kv_capacity=1001)) == Preemption("b", free_kv=True)
    assert choose_preemption(running, [], Limits(kv_capacity=1002)) is None


def test_admitted_sequences_are_never_preempted_for_kv_at_once() -> None:
    """Admission and preemption use one KV figure, so admitting cannot cause a pause-readmit loop."""
    rng = random.Random(1)
    for _ in range(500):
        limits = Limits(kv_capacity=rng.randint(50, 400))
        running = [
            dec(f"d{i}", rng.randint(0, 2), i, kv=rng.randint(1, 40)) for i in range(rng.randint(0, 4))
        ]
        if kv_demand(running) > limits.kv_capacity:
            continue
        waiting = [Candidate(f"w{i}", rng.randint(0, 2), 10 + i, rng.randint(1, 80)) for i in range(4)]
        admitted = choose_admissions(waiting, running, limits)
        by_id = {c.request_id: c for c in waiting}
        after = running + [
            pre(r, by_id[r].class_rank, by_id[r].arrival, by_id[r].prompt_tokens) for r in admitted
        ]
        assert kv_demand(after) <= limits.kv_capacity
        rest = [c for c in waiting if c.request_id not in admitted]
        p = choose_preemption(after, rest, limits)
        assert p is None or p.request_id not in admitted  # None, or an older sequence


def test_bad_states_and_limits_are_rejected() -> None:
    with pytest.raises(InvalidArgument):
        SeqState("x", 0, 0, to_prefill=5, decoding=True, kv_tokens=0)
    for bad in ({"class_rank": -1}, {"class_rank": True}, {"to_prefill": 1.0, "decoding": False},
                {"kv_tokens": -2}, {"kv_tokens": "3"}):
        fields = {"class_rank": 0, "to_prefill": 0, "decoding": True, "kv_tokens": 0, **bad}
        with pytest.raises(InvalidArgument, match=next(iter(bad))):
            SeqState("x", arrival=0, **fields)
    with pytest.raises(InvalidArgument):
        Limits(token_budget=0)
    with pytest.raises(InvalidArgument):
        Limits(token_budget=8, max_seqs=9)
    with pytest.raises(InvalidArgument):
        Candidate("x", 0, 0, 0)
    with pytest.raises(InvalidArgument):
        build_plan([dec("x", 0, 0), dec("x", 1, 1)], Limits())


def test_a_tenant_behind_in_its_class_gets_the_kv_a_richer_tenant_holds() -> None:
    """KV, not slots, is short: a flood tenant's long prompts hold a class's KV and a light
    tenant's request waited for one of them to finish. The flood gives up as many sequences
    as the light request needs (their KV freed), if the rule allows pausing enough: a tenant
    keeps one slot more than the light tenant will hold; none when that would not make room."""
    def run(rid: str, tenant: str, arrival: float, kv: int) -> SeqState:
        return SeqState(rid, 1, arrival, 0, True, kv, tenant)

    flood = [run(f"f{i}", "flood", i, 300) for i in range(3)]  # 903 of 1000 KV through the next step
    limits = Limits(max_seqs=8, kv_capacity=1000)
    light = Candidate("l", 1, 10, 200, tenant="light")  # needs 201: 97 free
    assert choose_preemption(flood, [light], limits) == Preemption("f2", free_kv=True)
    # 3 against 0: two may go (602 more, 699 in all); a request needing more moves nobody
    assert choose_preemption(flood, [Candidate("l", 1, 10, 700, tenant="light")], limits) is None
    assert choose_preemption(flood, [Candidate("l", 1, 10, 690, tenant="light")], limits) == \
        Preemption("f2", free_kv=True)
    # 2 against 1: not two apart, nobody moves, however short the KV
    two = [*flood[:2], run("l0", "light", 5, 100)]
    assert choose_preemption(two, [Candidate("l", 1, 10, 500, tenant="light")], limits) is None
    # classes without tenant fairness (tenant ''): never
    anon = [run(f"a{i}", "", i, 300) for i in range(3)]
    assert choose_preemption(anon, [Candidate("x", 1, 10, 200)], limits) is None


def test_decode_growth_past_the_kv_pauses_the_richest_tenants_sequence_first() -> None:
    """The running set outgrows the KV: in the lowest class, a sequence of the tenant holding
    the most of its slots goes, not the least KV of anyone (a light tenant's just-admitted
    prompt, which rule 3 then admitted again at the flood's expense, recomputed each step)."""
    def run(rid: str, tenant: str, arrival: float, kv: int) -> SeqState:
        return SeqState(rid, 1, arrival, 0, True, kv, tenant)

    running = [run("f0", "flood", 0, 400), run("f1", "flood", 1, 400), run("l0", "light", 5, 100)]
    assert choose_preemption(running, [], Limits(kv_capacity=902)) == Preemption("f1", True)
    # without tenants (a class without fairness), the least KV, as before
    anon = [run("a0", "", 0, 400), run("a1", "", 1, 400), run("a2", "", 5, 100)]
    assert choose_preemption(anon, [], Limits(kv_capacity=902)) == Preemption("a2", True)


def test_a_higher_class_takes_its_room_from_the_richest_tenant_below_it() -> None:
    """A P0 needs KV held by P1 tenants a (two sequences) and b (one): a's goes. The least KV
    of anyone was b's, whose tenant rule 3 then admitted again in the same step at a's
    expense, its context recomputed (122 tokens where 101 would do)."""
    def run(rid: str, tenant: str, arrival: float, kv: int) -> SeqState:
        return SeqState(rid, 1, arrival, 0, True, kv, tenant)

    running = [run("a1", "a", 0, 100), run("a2", "a", 1, 100), run("b1", "b", 2, 20)]  # 223 through next step
    p0 = Candidate("p0", 0, 5, 30, tenant="c")  # needs 31: 17 free
    assert choose_preemption(running, [p0], Limits(max_seqs=4, kv_capacity=240)) == Preemption("a2", True)


def test_a_lower_class_stream_does_not_keep_a_tenant_behind_from_a_richer_tenants_kv() -> None:
    """Rule 3 with a lower class running: a flood tenant's streams hold P1's KV and a small P2
    stream runs beside them. Pausing the P2 alone does not make room for a light P1 tenant's
    request, pausing it and one flood sequence does: the P2 goes first (its KV freed), then
    the flood's. Before, a lower class running turned rule 3 off altogether, and the light
    request waited for the flood's growth to pause one of its own (67 steps in
    test_batch_scheduler.py)."""
    def run(rid: str, rank: int, tenant: str, arrival: float, kv: int) -> SeqState:
        return SeqState(rid, rank, arrival, 0, True, kv, tenant)

    flood = [run(f"f{i}", 1, "flood", i, 300) for i in range(3)]
    limits = Limits(max_seqs=8, kv_capacity=1000)
    light = Candidate("l", 1, 10, 200, tenant="light")  # needs 201
    p2 = run("p2", 2, "", 0, 5)  # 6 through the next step: 91 free
    assert choose_preemption([*flood, p2], [light], limits) == Preemption("p2", free_kv=True)
    paused = Candidate("p2", 2, 0, 6)  # its KV freed: rule 3 now
    assert choose_preemption(flood, [light, paused], limits) == Preemption("f2", free_kv=True)
    # a P2 keeping its KV while it waits: freed first, the same way
    kept = Candidate("p2", 2, 0, 0, resident_kv=5)
    assert choose_preemption(flood, [light, kept], limits) == Preemption("p2", free_kv=True)
    # where even that would not make room (the flood may give up two of its three), nobody moves
    assert choose_preemption([*flood, p2], [Candidate("l", 1, 10, 700, tenant="light")], limits) is None


def test_kv_a_richer_tenants_paused_sequence_kept_counts_for_a_tenant_behind() -> None:
    """Rule 3 where KV is short and a flood's sequence, paused for an earlier light tenant's
    slot, kept its KV while it waits: a second light tenant needs that KV and one running
    flood sequence's. The kept KV is freed first, then the flood sequence paused. Before,
    only the running sequences the rule allows were counted: not enough, nobody moved, and
    the light request waited for the flood's growth (76 steps in test_batch_scheduler.py)."""
    def run(rid: str, tenant: str, arrival: float, kv: int) -> SeqState:
        return SeqState(rid, 1, arrival, 0, True, kv, tenant)

    running = [run("f0", "flood", 0, 240), run("f1", "flood", 1, 240), run("b", "b", 5, 50)]  # 533
    kept = Candidate("f2", 1, 2, 0, resident_kv=240, tenant="flood")  # 773 through the next step: 227 free
    limits = Limits(max_seqs=3, kv_capacity=1000)
    big = Candidate("c", 1, 10, 550, tenant="c")  # needs 551: f1 (241) and f2's kept KV (240)
    assert choose_preemption(running, [kept, big], limits) == Preemption("f2", free_kv=True)
    freed = Candidate("f2", 1, 2, 241, tenant="flood")
    assert choose_preemption(running, [freed, big], limits) == Preemption("f1", free_kv=True)
    # enough without the kept KV: as before, only the running one goes (its KV freed)
    small = Candidate("c", 1, 10, 300, tenant="c")
    assert choose_preemption(running, [kept, small], limits) == Preemption("f1", free_kv=True)
    # more than both could free: nobody moves
    assert choose_preemption(running, [kept, Candidate("c", 1, 10, 800, tenant="c")], limits) is None


def test_kv_a_paused_sequence_of_the_head_s_class_kept_counts_under_rule_2() -> None:
    """Rule 2 where the head (P1) needs more KV than the lower classes hold, and a P1 behind it
    (a later arrival, paused for a P0's slot) kept its KV: that sequence cannot start before
    the head (admission is in priority order), so its kept KV counts toward the head's room
    and goes first where the lower classes are not enough, then the lower classes as needed.
    Before, only the lower classes were counted: nobody moved, the head waited behind a
    running P2 (and, with the P2 only kept, with a slot empty) until the running P1 ended."""
    limits = Limits(max_seqs=3, kv_capacity=1000)
    head = Candidate("y", 1, 0, 500)  # needs 501
    kept = Candidate("x", 1, 5, 0, resident_kv=400)
    running = [dec("a", 1, 1, kv=300), dec("p2", 2, 2, kv=100)]  # 402 through the next step: 198 free
    # the P2 alone (101) is not enough, the kept KV is: it goes, and the P2 runs on
    assert choose_preemption(running, [head, kept], limits) == Preemption("x", True)
    assert choose_preemption(running, [head, Candidate("x", 1, 5, 401)], limits) is None  # admissible
    # the kept KV and the P2 both needed: the kept KV first, then the P2 (its KV freed)
    big = Candidate("y", 1, 0, 650)  # needs 651: 198 + 400 + 101 = 699
    assert choose_preemption(running, [big, kept], limits) == Preemption("x", True)
    assert choose_preemption(running, [big, Candidate("x", 1, 5, 401)], limits) == Preemption("p2", True)
    # the P2 paused with its KV kept (the reachable form: see test_batch_scheduler.py)
    p2_kept = Candidate("p2", 2, 2, 0, resident_kv=100)
    assert choose_preemption(running[:1], [head, kept, p2_kept], limits) == Preemption("x", True)
    # not enough with everything: nobody moves
    assert choose_preemption(running, [Candidate("y", 1, 0, 800), kept], limits) is None


def test_kv_a_paused_sequence_of_the_head_s_class_kept_is_freed_for_it_with_no_lower_class() -> None:
    """The same with no lower class at all (the batch holds the head's class and P0): a slot is
    free, the head lacks KV that a later P1 paused with its KV kept holds. It is freed; the
    head waited, with the slot empty, until a running sequence ended. A slot short is not
    made by freeing KV: nothing is freed then."""
    head = Candidate("y", 1, 0, 500)
    kept = Candidate("x", 1, 5, 0, resident_kv=400)
    running = [dec("a", 1, 1, kv=300), dec("h", 0, 3, kv=50)]  # 352: 248 free
    assert choose_preemption(running, [head, kept], Limits(max_seqs=3, kv_capacity=1000)) == \
        Preemption("x", True)
    assert choose_preemption(running, [head, kept], Limits(max_seqs=2, kv_capacity=1000)) is None
    # a slot short and only a lower class's kept KV: nothing freed either (it would make no slot)
    p2_kept = Candidate("p2", 2, 2, 0, resident_kv=100)
    assert choose_preemption(running, [head, kept, p2_kept], Limits(max_seqs=2, kv_capacity=1000)) is None


# --- starvation floors on the worker (Limits.floor_slots) -----------------------------------------


def fl(x: SeqState | Candidate) -> SeqState | Candidate:
    """``x`` as claim hands it out by its class's starvation floor."""
    return dataclasses.replace(x, by_floor=True)


def test_a_floor_keeps_floor_of_its_share_of_the_slots_rounded_down() -> None:
    """floor x max_seqs, rounded down: a class never keeps more than its share, and the
    floors' slots never add up to more than the batch; no slot kept is the strict order."""
    assert floor_slots((0.0, 0.3, 0.05), 4) == (0, 1, 0)
    assert floor_slots((0.0, 0.3, 0.05), 16) == (0, 4, 0)
    assert floor_slots((0.0, 0.3, 0.05), 64) == (0, 19, 3)
    assert floor_slots((0.0, 0.29, 0.7), 100) == (0, 29, 70)  # 0.29 x 100 = 28.999999999999996
    assert floor_slots((0.0, 0.2), 4) == () and floor_slots((), 8) == ()
    assert floor_slots((0.5, 0.5), 7) == (3, 3)
    with pytest.raises(InvalidArgument, match="floor_slots"):
        Limits(max_seqs=4, token_budget=8, floor_slots=(2, 3))
    with pytest.raises(InvalidArgument, match="floor_slots"):
        Limits(floor_slots=(0, -1))


def test_a_floor_class_within_its_floor_s_slots_is_no_victim_of_a_higher_class() -> None:
    """P0 waits at a batch full of P0 and one P1 that claim handed out by its floor, which
    keeps one of 4 slots: nothing is paused (without the floor the P1 was, and a P0 flood
    kept it paused). A P1 claimed otherwise (its class above its floor pool-wide) is paused
    as before. With two P1s the one beyond the floor goes, the least KV first; KV short: the
    same, the P1's KV is kept."""
    running = [dec("a", 0, 0), dec("b", 0, 1), dec("c", 0, 2), fl(dec("p1", 1, 3, kv=50))]
    head = [Candidate("w", 0, 9, 10)]
    assert choose_preemption(running, head, Limits(max_seqs=4)) == Preemption("p1", False)
    floors = Limits(max_seqs=4, floor_slots=(0, 1, 0))
    assert choose_preemption(running, head, floors) is None
    claimed_otherwise = [*running[:3], dec("p1", 1, 3, kv=50)]
    assert choose_preemption(claimed_otherwise, head, floors) == Preemption("p1", False)
    two = [dec("a", 0, 0), dec("b", 0, 1), fl(dec("big", 1, 3, kv=500)), fl(dec("small", 1, 4, kv=50))]
    assert choose_preemption(two, head, floors) == Preemption("small", False)
    assert choose_preemption([two[0], two[1], two[2]], head, floors) is None
    # KV, not a slot, is short: the P1 within its floor keeps it, a P2 does not
    kv = Limits(max_seqs=8, kv_capacity=700, floor_slots=(0, 1, 0))
    big = [Candidate("w", 0, 9, 150)]
    assert choose_preemption([dec("a", 0, 0, kv=400), fl(dec("p1", 1, 1, kv=200))], big, kv) is None
    assert choose_preemption([dec("a", 0, 0, kv=400), fl(dec("p1", 1, 1, kv=100)), dec("p2", 2, 2, kv=100)],
                             big, kv) == Preemption("p2", True)


def test_a_class_below_its_floor_s_slots_is_admitted_and_makes_room_ahead_of_higher_classes() -> None:
    """A P1 claimed by its floor, below its floor's slot, goes before a P0 at admission, up
    to its floor's slots (a second P1 goes in class order again); at a full batch of P0s it
    pauses one (the least KV, its cache kept when a slot is all it lacks, freed when KV is
    short too). A P1 claimed otherwise waits in class order, as before."""
    floors = Limits(max_seqs=4, floor_slots=(0, 1, 0))
    waiting = [Candidate("w0", 0, 5, 10), fl(Candidate("w1", 1, 6, 10)), fl(Candidate("w1b", 1, 7, 10))]
    three = [dec("a", 0, 0), dec("b", 0, 1), dec("c", 0, 2)]
    assert choose_admissions(waiting, three, Limits(max_seqs=4)) == ("w0",)
    assert choose_admissions(waiting, three, floors) == ("w1",)
    plain = [Candidate("w0", 0, 5, 10), Candidate("w1", 1, 6, 10)]
    assert choose_admissions(plain, three, floors) == ("w0",)
    assert choose_preemption([*three, dec("d", 0, 3)], plain, floors) is None
    assert choose_admissions(waiting, three[:1], floors) == ("w1", "w0", "w1b")
    full = [*three, dec("d", 0, 3, kv=50)]
    assert choose_preemption(full, waiting, Limits(max_seqs=4)) is None
    assert choose_preemption(full, waiting, floors) == Preemption("d", False)
    # KV short as well: the P0's cache goes
    kv = Limits(max_seqs=4, kv_capacity=4 * 101 + 5, floor_slots=(0, 1, 0))
    assert choose_preemption([dec(f"p0-{i}", 0, i) for i in range(4)], [fl(Candidate("w1", 1, 9, 50))],
                             kv) == Preemption("p0-3", True)
    # a lower class beyond its own floor goes before a higher class (the lowest class first)
    mixed = [dec("a", 0, 0), dec("b", 0, 1), fl(dec("p2", 2, 2)), fl(dec("p2b", 2, 3))]
    floors2 = Limits(max_seqs=4, floor_slots=(0, 1, 1))
    assert choose_preemption(mixed, [fl(Candidate("w1", 1, 9, 10))], floors2) == Preemption("p2b", False)


def test_decode_growth_past_the_kv_pauses_a_class_beyond_its_floor_first() -> None:
    """The running set outgrows the KV: a P1 within its floor's slots keeps its cache and a
    P0 gives it up; with every running sequence within a floor, the lowest class goes."""
    running = [fl(dec("a", 0, 0, kv=500)), fl(dec("b", 1, 1, kv=500))]
    assert choose_preemption(running, [], Limits(kv_capacity=1001)) == Preemption("b", True)
    p1_floor = Limits(kv_capacity=1001, floor_slots=(0, 1))
    both = Limits(kv_capacity=1001, floor_slots=(1, 1))
    assert choose_preemption(running, [], p1_floor) == Preemption("a", True)
    assert choose_preemption(running, [], both) == Preemption("b", True)


def _random_state(rng: random.Random) -> tuple[list[SeqState], list[Candidate], Limits]:
    seqs = rng.randint(1, 6)
    limits = Limits(token_budget=64, max_seqs=seqs, kv_capacity=rng.randint(100, 1500))
    running = [SeqState(f"r{i}", rng.randint(0, 2), i, *(lambda p: (p, p == 0))(rng.choice([0, 0, 30])),
                        rng.randint(0, 200), rng.choice(["", "a", "b"]), rng.random() < 0.5)
               for i in range(rng.randint(0, seqs))]
    waiting = [Candidate(f"w{i}", rng.randint(0, 2), 10 + i, rng.randint(1, 300),
                         rng.choice([0, 0, rng.randint(1, 100)]), rng.choice(["", "a", "b"]),
                         rng.random() < 0.5)
               for i in range(rng.randint(0, 4))]
    return running, waiting, limits


def test_zero_floors_and_floors_of_absent_classes_decide_exactly_as_the_class_order() -> None:
    """No slot kept (floor 0, or rounded down to 0) is the strict class order; so is a floor
    of a class with nothing running or waiting here (its slots are anyone's), and any floor
    where nothing here was claimed by its floor."""
    rng = random.Random(7)
    for _ in range(3000):
        running, waiting, limits = _random_state(rng)
        absent = {0, 1, 2} - {s.class_rank for s in running} - {c.class_rank for c in waiting}
        fl = [(0,) * 3, floor_slots((0.0, 0.1, 0.1), limits.max_seqs)]
        if absent:
            r = min(absent)
            fl.append(tuple(limits.max_seqs if i == r else 0 for i in range(3)))
        for q in fl:
            other = Limits(limits.token_budget, limits.max_seqs, limits.kv_capacity, floor_slots=q)
            assert choose_admissions(waiting, running, other) == choose_admissions(waiting, running, limits)
            assert choose_preemption(running, waiting, other) == choose_preemption(running, waiting, limits)
        # nothing here was claimed by its floor: any floors decide as the class order
        plain_r = [dataclasses.replace(s, by_floor=False) for s in running]
        plain_w = [dataclasses.replace(c, by_floor=False) for c in waiting]
        other = Limits(limits.token_budget, limits.max_seqs, limits.kv_capacity,
                       floor_slots=floor_slots((0.3, 0.3, 0.4), limits.max_seqs) or (0, 0, 1))
        assert choose_admissions(plain_w, plain_r, other) == choose_admissions(plain_w, plain_r, limits)
        assert choose_preemption(plain_r, plain_w, other) == choose_preemption(plain_r, plain_w, limits)
