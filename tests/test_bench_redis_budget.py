"""`qos bench redis-budget`: the per-request arithmetic, and a tiny real run (structure and
signs only, never speed)."""

from __future__ import annotations

import json

import pytest

from limiter.bench import callgrind
from limiter.bench import redis_budget as rb
from limiter.bench.slowlog import SLOWLOG_US, quantile_us
from limiter.cli import build_parser
from limiter.keys import policy_text
from tests.support.helpers import refused_by_name


def test_tokens_per_push_follows_the_worker_flush() -> None:
    assert rb.tokens_per_push(12.5, 50, 16) == 4  # a push every 4 steps of 12.5 ms
    assert rb.tokens_per_push(20, 50, 16) == 3
    assert rb.tokens_per_push(1, 50, 16) == 16  # flush_tokens caps it
    assert rb.tokens_per_push(100, 50, 16) == 1  # steps longer than flush_ms: every step


def test_an_unstreamed_request_pushes_every_unstreamed_flush_ms_however_many_tokens() -> None:
    assert rb.unstreamed_tokens_per_push(12.5, 50, 1000) == 80  # not capped at flush_tokens
    assert rb.unstreamed_tokens_per_push(12.5, 2000, 1000) == 160  # never more often than the class
    assert rb.unstreamed_tokens_per_push(2000, 50, 1000) == 1  # steps longer than that: every step


def test_pushes_per_request() -> None:
    assert rb.pushes_per_request(1, 4) == (0, 0)  # the only token rides on complete
    assert rb.pushes_per_request(2, 4) == (1, 0)
    assert rb.pushes_per_request(8, 4) == (1, 1)  # 1 | 2-5 pushed | 6-8 on complete
    assert rb.pushes_per_request(9, 4) == (1, 1)
    assert rb.pushes_per_request(10, 4) == (1, 2)
    assert rb.pushes_per_request(256, 4) == (1, 63)


def test_budget_arithmetic() -> None:
    us = {"admit": 40.0, "claim x1": 60.0, "claim x8": 200.0, "push_tokens (first)": 10.0,
          "push_tokens": 5.0, "renew_leases": 640.0, "cancel check": 32.0, "complete": 50.0}
    b = rb.budget(us, tokens=8, per_push=4, claim_batch=8, step_ms=10, lease_ms=300, renew_held=64,
                  flush_ms=40)
    # 8 tokens x 10 ms on the worker = 80 ms, renewed every 100 ms: 0.8 of a 64-entry call;
    # its cancels checked every 40 ms: 2 entries of a 64-entry SMISMEMBER
    assert b["us"] == {"admit": 40.0, "claim": 25.0, "push_tokens": 15.0, "renew_leases": 8.0,
                       "cancel_check": 1.0, "complete": 50.0}
    assert b["pushes"] == 2 and b["total_us"] == pytest.approx(139.0)
    assert b["goal_us"] == 150 + 2 * 8 and b["meets_goal"] and b["admit_meets_goal"]
    assert b["requests_per_s"] == pytest.approx(1e6 / 139.0)
    # at the worker's own flush_ms (50 ms): 1.6 entries
    default = rb.budget(us, tokens=8, per_push=4, claim_batch=8, step_ms=10, lease_ms=300)
    assert default["us"]["cancel_check"] == pytest.approx(1.6 * 32.0 / 64)
    # a worker running 8 at once also pushes them 8 to a call (the first token still alone)
    batched = rb.budget(us | {"push_tokens x8": 16.0}, tokens=8, per_push=4, claim_batch=8, step_ms=10,
                        lease_ms=300, renew_held=64)
    assert batched["us"]["push_tokens"] == pytest.approx(10.0 + 16.0 / 8)
    alone = rb.budget(us | {"push_tokens x8": 16.0}, tokens=8, per_push=4, claim_batch=1, step_ms=10,
                      lease_ms=300, renew_held=64)
    assert alone["us"]["push_tokens"] == 15.0
    # ...and their first tokens too, made at the same step
    firsts = rb.budget(us | {"push_tokens x8": 16.0, "push_tokens (first) x8": 24.0}, tokens=8, per_push=4,
                       claim_batch=8, step_ms=10, lease_ms=300, renew_held=64)
    assert firsts["us"]["push_tokens"] == pytest.approx(24.0 / 8 + 16.0 / 8)
    # ...and its frontends' admits came 8 to a call: the admit goal is judged on that share
    merged = rb.budget(us | {"admit": 60.0, "admit x8": 320.0}, tokens=8, per_push=4, claim_batch=8,
                       step_ms=10, lease_ms=300, renew_held=64)
    assert merged["us"]["admit"] == 40.0 and merged["admit_meets_goal"]
    single = rb.budget(us | {"admit": 60.0, "admit x8": 320.0}, tokens=8, per_push=4, claim_batch=1,
                       step_ms=10, lease_ms=300, renew_held=64)
    assert single["us"]["admit"] == 60.0 and not single["admit_meets_goal"]
    # ...and completes the 8 in one call when they finish at the same step
    together = us | {"complete x8": 160.0}
    for batch, share in ((8, 20.0), (1, 50.0)):
        b = rb.budget(together, tokens=8, per_push=4, claim_batch=batch, step_ms=10, lease_ms=300)
        assert b["us"]["complete"] == share
    # a client that does not stream: after the first token, pushes of 80 tokens, 8 a call
    quiet = us | {"push_tokens x8": 16.0, "push_tokens x8 unstreamed": 40.0}
    b = rb.budget(quiet, tokens=256, per_push=4, claim_batch=8, step_ms=10, lease_ms=300,
                  unstreamed_per_push=80)
    assert not b["streamed"] and b["pushes"] == 1 + 3  # 1 | 2-81 | 82-161 | 162-241 | 242-256 on complete
    assert b["us"]["push_tokens"] == pytest.approx(10.0 + 3 * 40.0 / 8)
    streamed = rb.budget(quiet, tokens=256, per_push=4, claim_batch=8, step_ms=10, lease_ms=300)
    assert streamed["streamed"] and streamed["pushes"] == 64
    assert rb.budget(quiet, tokens=8, per_push=4, claim_batch=8, step_ms=10, lease_ms=300,
                     unstreamed_per_push=80)["pushes"] == 1  # the first token; the rest on complete
    with pytest.raises(ValueError, match="batches of 8"):
        rb.budget(quiet, tokens=8, per_push=4, claim_batch=1, step_ms=10, lease_ms=300,
                  unstreamed_per_push=80)
    worse = rb.budget(us | {"admit": 51.0}, tokens=1, per_push=4, claim_batch=1, step_ms=10, lease_ms=300)
    assert worse["pushes"] == 0 and not worse["admit_meets_goal"]
    renewals, cancel_checks = 0.1 * 640 / rb.RENEW_HELD, 0.2 * 32 / rb.RENEW_HELD  # 10 ms on the worker
    assert worse["total_us"] == pytest.approx(51 + 60 + renewals + cancel_checks + 50)
    assert not worse["meets_goal"]  # 162 > 152


def test_pushes_of_a_gpu_step_share_their_calls_the_rest_stays_eight() -> None:
    us = {"admit": 40.0, "admit x8": 160.0, "claim x1": 60.0, "claim x8": 200.0, "push_tokens (first)": 10.0,
          "push_tokens": 5.0, "renew_leases": 640.0, "cancel check": 32.0, "complete": 50.0,
          "complete x8": 160.0,
          "push_tokens x8": 16.0, "push_tokens (first) x8": 24.0, "push_tokens x8 unstreamed": 40.0,
          "push_tokens x64": 64.0, "push_tokens (first) x64": 128.0, "push_tokens x64 unstreamed": 192.0}
    wide = rb.budget(us, tokens=256, per_push=4, claim_batch=8, step_ms=10, lease_ms=300, push_batch=64)
    assert wide["us"]["push_tokens"] == pytest.approx(128.0 / 64 + 63 * 64.0 / 64)
    assert wide["us"]["admit"] == 20.0 and wide["us"]["claim"] == 25.0 and wide["us"]["complete"] == 20.0
    assert wide["push_batch"] == 64
    quiet = rb.budget(us, tokens=256, per_push=4, claim_batch=8, step_ms=10, lease_ms=300,
                      unstreamed_per_push=80, push_batch=64)
    assert quiet["us"]["push_tokens"] == pytest.approx(128.0 / 64 + 3 * 192.0 / 64)
    alone = rb.budget(us, tokens=256, per_push=4, claim_batch=1, step_ms=10, lease_ms=300, push_batch=64)
    assert alone["us"]["push_tokens"] == 10.0 + 63 * 5.0 and alone["push_batch"] == 1
    assert rb.phase_names(64)[6:10] == ("push_tokens (first) x64", "push_tokens", "push_tokens x64",
                                        "push_tokens x64 unstreamed")
    assert rb.phase_names() == rb.PHASES


async def test_a_run_with_wider_pushes_measures_them_and_refuses_what_does_not_divide() -> None:
    report = await rb.run_budget(requests=64, rounds=1, push_rounds=1, tokens=(256,), push_batch=32)
    assert [p.name for p in report.phases] == list(rb.phase_names(32))
    wide = {p.name: p for p in report.phases}
    assert wide["push_tokens x32"].calls == 64 // 32 and wide["push_tokens x32"].inner["hset"] == 32
    assert wide["push_tokens (first) x32"].calls == 1 and wide["push_tokens (first) x32"].inner["hset"] == 32
    assert wide["push_tokens x32 unstreamed"].inner["hset"] == 32
    assert report.meta["push_batch"] == 32
    assert [b["push_batch"] for b in report.budgets] == [1, 32, 32]
    rb.render(report)
    for bad in (7, 65, 24):  # 24 does not divide the 32 requests of a half
        with pytest.raises(ValueError, match="push_batch"):
            await rb.run_budget(requests=64, rounds=1, push_batch=bad)
    assert build_parser().parse_args(["bench", "redis-budget"]).push_batch == rb.PUSH_BATCH
    for args in (["--push-batch", "4"], ["--push-batch", "48", "--requests", "128"]):
        parsed = build_parser().parse_args(["bench", "redis-budget", *args])
        assert parsed.func(parsed) == 2, args


def test_best_phases_keeps_the_least_time_per_call() -> None:
    def ph(name: str, us: float) -> rb.Phase:
        return rb.Phase(name, 10, us, us, us, {})
    best = rb.best_phases([[ph("complete", 9.0), ph("admit", 5.0)], [ph("admit", 4.0), ph("complete", 11.0)]])
    assert [(p.name, p.usec_per_call) for p in best] == [("admit", 4.0), ("complete", 9.0)]


async def test_tiny_run(tmp_path) -> None:
    report = await rb.run_budget(requests=32, rounds=1, push_rounds=1, frontends=3)
    assert [p.name for p in report.phases] == list(rb.PHASES)
    for p in report.phases:
        assert p.calls > 0 and p.usec_per_call > 0, p
        if p.p50_us is not None:  # None: the median call was under SLOWLOG_US, not logged
            assert p.max_us is not None and SLOWLOG_US <= p.p50_us <= p.max_us, p
        assert sum(p.inner.values()) >= 1, p  # every script calls Redis at least once
    assert report.phases[rb.PHASES.index("renew_leases")].calls == 1  # all 32 held in one call
    check = report.phases[rb.PHASES.index("cancel check")]
    assert check.calls == 1 and check.inner == {"smismember": 1.0}  # ...and one SMISMEMBER for them
    assert report.meta["renew_held"] == 32
    assert [(b["tokens"], b["claim_batch"], b["streamed"]) for b in report.budgets] == \
        [(t, c, True) for t in rb.TOKENS for c in rb.CLAIM_BATCHES] + [(t, 8, False) for t in rb.TOKENS]
    assert report.meta["unstreamed_tokens_per_push"] == 80 and report.meta["max_tokens"] == rb.MAX_TOKENS
    unstreamed = report.phases[rb.PHASES.index("push_tokens x8 unstreamed")]
    # 8 requests pushed a call, from the 3 frontends in turn: one reply entry for each frontend
    assert unstreamed.calls == 32 // 8 and unstreamed.inner.get("hset") == 8 and unstreamed.inner["xadd"] == 3
    alone = report.phases[rb.PHASES.index("push_tokens")]
    assert alone.inner.get("hset") == 1 and alone.inner["xadd"] == 1
    for b in report.budgets:
        assert set(b["us"]) == {"admit", "claim", "push_tokens", "renew_leases", "cancel_check", "complete"}
        assert all(v > 0 for v in b["us"].values()), b
        assert b["total_us"] == pytest.approx(sum(b["us"].values()))
        # the shard's CPU for the same calls, their I/O included, and the requests/s it leaves
        assert b["cpu_us"] > 0 and b["requests_per_s_cpu"] == pytest.approx(1e6 / b["cpu_us"])
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(rb.render(report))
    shown = console.export_text()
    assert "scripts' time alone" in shown and "I/O included" in shown and "scale-out" in shown
    path = tmp_path / "budget.json"
    rb.write_json(report, str(path))
    data = json.loads(path.read_text())
    assert len(data["phases"]) == len(rb.PHASES) and data["meta"]["private_server"] is True
    assert data["meta"]["frontends"] == 3 and data["meta"]["reply_entries"] == "grouped"


def test_cli_parses() -> None:
    args = build_parser().parse_args(["bench", "redis-budget", "--requests", "64", "--tokens", "8",
                                      "--json", "x"])
    assert args.requests == 64 and args.tokens == [8] and args.json == "x"
    assert args.frontends == 1 and args.reply_entries == "grouped"
    assert args.redis_url is None


async def test_a_baseline_lua_dir_is_measured_in_the_same_rounds(tmp_path) -> None:
    from limiter.scripts import lua_dir

    report = await rb.run_budget(requests=16, rounds=1, push_rounds=1, tokens=(8,), baseline=lua_dir())
    assert [p.name for p in report.baseline] == list(rb.PHASES)
    assert all(p.usec_per_call > 0 for p in report.baseline)
    assert report.meta["baseline"] == str(lua_dir())
    assert [b["tokens"] for b in report.baseline_budgets] == [b["tokens"] for b in report.budgets]
    rb.render(report)  # the comparison table renders


def test_a_quantile_counts_the_calls_too_fast_to_be_logged() -> None:
    """Nearest rank (ceil(q * calls)), as the other benches' percentiles: the median of an
    even count is its lower middle (it was the upper one)."""
    assert quantile_us([20, 30, 40, 50], 4, 0.5) == 30.0  # every call logged
    assert quantile_us([20, 30, 40, 50, 60], 5, 0.5) == 40.0
    assert quantile_us([20, 30, 40, 50], 4, 1.0) == 50.0
    assert quantile_us(list(range(100)), 100, 0.99) == 98.0  # the 99th of 100, not the last
    assert quantile_us([30, 40, 50], 4, 0.5) == 30.0  # one under the threshold, not logged
    assert quantile_us([40, 50], 4, 0.5) is None  # the median call was among the unlogged
    assert quantile_us([], 4, 1.0) is None


async def test_the_scripts_inner_commands_are_not_logged_while_measured(aredis) -> None:
    """Logging them is time spent inside the script's call (17-28 % of admit's): only calls
    slower than SLOWLOG_US are in the log after a phase."""
    d = rb.Driver(aredis, per_push=4, private=True)
    try:
        cls, _ = await d.setup()
        phase = await d.measure("admit", [d.admit(i, cls) for i in range(8)])
        assert phase.calls == 8
        inner_calls = sum(phase.inner.values()) * phase.calls
        assert inner_calls >= 8 * 10  # not vacuous: admit runs some twenty commands
        log = await aredis.slowlog_get(-1)
        inner_logged = [e for e in log if not e["command"].upper().startswith(b"EVALSHA")]
        # a busy machine may stretch a few past the threshold, not half of them
        assert len(inner_logged) < inner_calls / 2, (len(inner_logged), inner_calls)
    finally:
        # the server is the session's: back to Redis's defaults
        await aredis.config_set("slowlog-log-slower-than", 10_000)
        await aredis.config_set("slowlog-max-len", 128)


@pytest.mark.skipif(callgrind.missing() is not None, reason=f"no valgrind: {callgrind.missing()}")
async def test_instructions_are_counted_and_tell_a_dearer_script_apart(tmp_path) -> None:
    """--instructions: every phase's instructions per call, and a push_tokens that does ~3M
    instructions' more work a call is told apart in every push phase, where the other
    phases (the same scripts) differ by far less. (A step of Lua's garbage collector, ~1M
    instructions, runs every 50 script calls: a phase of 1 or 2 calls, as here over 16
    requests, may or may not get one; the docs compare runs of 256 requests or more.)"""
    import shutil

    from limiter.scripts import lua_dir

    dearer = tmp_path / "lua"
    shutil.copytree(lua_dir(), dearer)
    push = dearer / "push_tokens.lua"
    work = "local function main()\n  for i = 1, 1000 do local _ = tostring(i * 1.5) end\n"
    text = push.read_text()
    assert text.count("local function main()\n") == 1
    push.write_text(text.replace("local function main()\n", work))
    report = await rb.run_budget(requests=16, rounds=1, push_rounds=1, tokens=(8,), baseline=dearer,
                                 instructions=True)
    now, was = report.instructions(), report.instructions(baseline=True)
    assert set(now) == set(was) == set(rb.PHASES)
    assert all(v > 0 for v in now.values()), now
    calls = {p.name: p.calls for p in report.phases}
    for name in rb.PHASES:
        if name.startswith("push_tokens"):  # 3M a call more, less a collector step (at most ~2M)
            assert was[name] - now[name] > 500_000, (name, was[name], now[name])
        else:  # the same scripts: in all, at most about a collector step apart
            assert abs(was[name] - now[name]) * calls[name] < 3_000_000, (name, was[name], now[name])
    for b, base in zip(report.budgets, report.baseline_budgets, strict=True):
        assert 0 < b["instructions"] < base["instructions"]
    assert report.meta["instructions"] is True
    assert all(p.p50_us is None for p in report.phases)  # SLOWLOG off: its entries would count
    rb.render(report)


async def test_instructions_are_refused_with_a_server_given(tmp_path) -> None:
    with pytest.raises(ValueError, match="private server"):
        await rb.run_budget(requests=16, redis_url="redis://127.0.0.1:1/0", instructions=True)


async def test_a_plain_commands_phase_reads_its_own_calls_from_the_slowlog(aredis) -> None:
    """The cancel check is a phase of SMISMEMBERs, not of scripts: its p50 and max are of its
    logged SMISMEMBERs (they were looked for among EVALSHAs, so always '<10 us')."""
    d = rb.Driver(aredis, per_push=4, private=True)
    try:
        await d.setup()
        await aredis.config_set("slowlog-log-slower-than", 0)  # every call logged
        phase = await d.measure("cancel check", [lambda: aredis.smismember(d.keys.cancels, ["a", "b"])
                                                 for _ in range(8)], command="smismember")
        assert phase.calls == 8
        assert phase.p50_us is not None and phase.max_us is not None
    finally:
        await aredis.config_set("slowlog-log-slower-than", 10_000)
        await aredis.config_set("slowlog-max-len", 128)


@pytest.mark.parametrize(("flags", "named"), [
    (["--tokens-per-push", "0"], "--tokens-per-push: must be in [1, "),  # found by review: `or 1`
    (["--tokens-per-push", "-3"], "--tokens-per-push: must be in [1, "),
    (["--step-ms", "nan"], "--step-ms: must be in (0, 60000]"),  # passed `<= 0`
    (["--step-ms", "inf"], "--step-ms: must be in (0, 60000]"),
])
def test_a_bad_redis_budget_flag_is_refused_by_name_not_replaced_by_the_default(
        flags: list[str], named: str, capsys, monkeypatch) -> None:
    refused_by_name(monkeypatch, capsys, rb, "run_budget", ["bench", "redis-budget", *flags], named)


@pytest.mark.parametrize("binding", ["bench", "other"])
async def test_a_binding_ceiling_is_measured_on_the_path_it_names(aredis, binding) -> None:
    """``--binding-ceiling bench``: the measured requests' class's ceiling binds, so their
    claims charge it and mark them (``ceil_out``), nothing held back; ``other``: another
    class's binds, the measured requests are never charged, and a renewal leaves them unmarked
    (it looks, and finds their own ceiling at the capacity)."""
    d = rb.Driver(aredis, per_push=4, private=True, binding_ceiling=binding)
    cls, _ = await d.setup()
    policy = policy_text(await aredis.hgetall(d.keys.policy))
    capacity = float(policy["capacity"])
    binds = {c for c in policy["classes"].split(",") if float(policy[f"{c}.ceil"]) < capacity}
    assert (binds == {cls}) if binding == "bench" else (len(binds) == 1 and cls not in binds), binds
    for i in range(8):
        await d.admit(i, cls)()
    await d.claim(8)()
    assert len(d.claimed) == 8  # nothing held back by the ceiling
    await d.push(d.claimed[0], 4)()
    await d.renew(d.claimed)()
    recs = [await aredis.hmget(d.keys.request(c.request_id), ["ceil_out", "c_ceil"]) for c in d.claimed]
    if binding == "bench":
        assert all(r[0] is not None and float(r[1]) > 0 for r in recs), recs
    else:
        assert all(r[0] is None and float(r[1]) == 0 for r in recs), recs


def test_a_binding_ceiling_flag_names_its_choices() -> None:
    with pytest.raises(ValueError, match="binding_ceiling must be one of none, bench, other"):
        rb.Driver(None, per_push=4, private=True, binding_ceiling="P2")  # type: ignore[arg-type]
    args = build_parser().parse_args(["bench", "redis-budget", "--binding-ceiling", "other"])
    assert args.binding_ceiling == "other"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "redis-budget", "--binding-ceiling", "P2"])
