"""``qos bench run`` / ``qos bench overhead``: the workload rule, the configs of the modes,
the summary arithmetic, and a short real run of every mode (sim engine, private Redis).

The smoke run checks that ``results.json`` has every documented field, that the numbers
are sane (percentiles ordered, attainment in 0..1, something completed) and that, in a
small overload, qos beats fifo on P0's TTFT p99. Figures are drawn from the run's files
but not judged here (timing on a shared 2-core box is noisy); docs/benchmarks.md has them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from limiter import config as config_mod
from limiter.bench import trace as tr
from limiter.bench.driver import Record
from limiter.bench.modes import ALL_MODES, FIFO_CLASS, MODES, mode_spec, to_toml
from limiter.bench.report import class_stats, markdown, targets, window_tokens
from limiter.bench.runner import BenchParams, redraw, run_bench, speedup_for
from limiter.config import DEFAULT_CLASSES
from limiter.localstack.loadgen import Result

CLASS_FIELDS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "max_gap_ms", "slo_attainment",
                "completed", "rejected_429", "rejected_503", "max_queue_wait_ms", "served_tokens")


# --- flags ----------------------------------------------------------------------------------------

RUN = ("run", "limiter.bench.runner", "run_bench")
OVERHEAD = ("overhead", "limiter.bench.overhead", "run_overhead")


@pytest.mark.parametrize(("command", "flags", "named"), [
    (RUN, ["--token-budget", "0"], "--token-budget: must be >= 1"),  # was: the default, silently
    (RUN, ["--token-budget", "-256"], "--token-budget: must be >= 1"),
    (RUN, ["--token-budget", "8"], "--token-budget: must be >= --max-seqs (16)"),
    (RUN, ["--max-seqs", "0"], "--max-seqs: must be in [1, 1024]"),
    (RUN, ["--frontends", "0"], "--frontends: must be in [1, 64]"),
    (RUN, ["--time-scale", "-1"], "--time-scale: must be in (0, 1000]"),
    (RUN, ["--time-scale", "nan"], "--time-scale: must be in (0, 1000]"),
    # found by review: 0 passed, and the calibration divided by zero
    (RUN, ["--time-scale", "0"], "--time-scale: must be in (0, 1000]"),
    # found by review: NaN, or a start past the trace's last arrival, left nothing to send
    (RUN, ["--trace-start", "nan"], "--trace-start: must be in [0, "),
    (RUN, ["--trace-start", "-1"], "--trace-start: must be in [0, "),
    (RUN, ["--trace-start", "1e9"], "--trace-start: must be in [0, "),
    (RUN, ["--drain", "-5"], "--drain: must be in [0, 3600]"),
    (RUN, ["--torch-threads", "0"], "--torch-threads: must be >= 1"),
    (RUN, ["--capacity-rps", "0"], "--capacity-rps: must be > 0"),
    (OVERHEAD, ["--chunk-tokens", "0"], "--chunk-tokens: must be in [1, 100000]"),
    (OVERHEAD, ["--seconds", "0"], "--seconds: must be in (0, 3600]"),
    (OVERHEAD, ["--seconds", "inf"], "--seconds: must be in (0, 3600]"),
    (OVERHEAD, ["--rate", "-1"], "--rate: must be in (0, 1000000]"),
    (OVERHEAD, ["--rate", "inf"], "--rate: must be in (0, 1000000]"),  # found by review: spun forever
    (OVERHEAD, ["--rate", "nan"], "--rate: must be in (0, 1000000]"),
    (OVERHEAD, ["--concurrency", "0"], "--concurrency: must be in [1, 10000]"),
    (OVERHEAD, ["--output-tokens", "0"], "--output-tokens: must be in [1, 100000]"),
    (OVERHEAD, ["--workers", "0"], "--workers: must be in [1, 64]"),
    (OVERHEAD, ["--max-seqs", "2000"], "--max-seqs: must be in [1, 1024]"),
    (OVERHEAD, ["--step-ms", "-1"], "--step-ms: must be in [0, 10000]"),
    (OVERHEAD, ["--step-ms", "nan"], "--step-ms: must be in [0, 10000]"),
    (OVERHEAD, ["--step-ms", "20"], "--step-ms: paces the echo server as a model server: it needs --engine"),
])
def test_a_bad_stack_flag_is_refused_by_name_before_anything_starts(
        command: tuple[str, str, str], flags: list[str], named: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from limiter import cli

    name, module, runs = command
    started: list[object] = []
    monkeypatch.setattr(importlib.import_module(module), runs, lambda *a, **k: started.append(a))
    assert cli.main(["bench", name, *flags]) == 2
    assert named in capsys.readouterr().err
    assert started == []


async def test_the_echo_server_streams_in_its_chunks_with_the_usage_asked_for() -> None:
    """The overhead bench's baseline, and the model server behind its openai workers: chunks
    of --chunk-tokens, the running usage on each when asked (vLLM's continuous_usage_stats),
    the final usage, [DONE]; /v1/models for the worker's probe."""
    from aiohttp.test_utils import TestClient, TestServer

    from limiter.bench.echo import make_app

    async with TestClient(TestServer(make_app(chunk_tokens=3))) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 7, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        r = await client.post("/v1/completions", json=body)
        events = [e.removeprefix("data: ") for e in (await r.text()).strip().split("\n\n")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
        assert texts == ["xxx", "xxx", "x", ""] and chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert [c["usage"]["completion_tokens"] for c in chunks[:3]] == [3, 6, 7]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
            "prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
        plain = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
        assert "usage" not in await plain.text()  # nothing asked, nothing sent (the baseline's bytes)
        assert (await (await client.get("/v1/models")).json())["data"][0]["id"] == "echo"
    with pytest.raises(ValueError, match="chunk_tokens"):
        make_app(chunk_tokens=0)
    with pytest.raises(ValueError, match="step_ms"):
        make_app(step_ms=-1)


async def test_an_echo_server_whose_port_was_taken_starts_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """free_port() then the child's bind: a port taken in between costs a try, not the run."""
    import socket

    from limiter.bench import overhead
    from limiter.localstack.redis_server import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy, free_port()])
        monkeypatch.setattr(overhead, "free_port", lambda: next(ports))
        async with overhead.echo_server(chunk_tokens=16) as (url, _pid):
            async with aiohttp.ClientSession() as session, session.get(f"{url}/readyz") as r:
                assert r.status == 200
        assert not url.endswith(f":{busy}")


async def test_the_echo_servers_steps_pace_every_stream_together() -> None:
    """--step-ms: the streams open at a step all go on at it (a cancelled one does not stop
    it for the others), and a paced answer is the same answer."""
    from aiohttp.test_utils import TestClient, TestServer

    from limiter.bench.echo import Steps, make_app

    steps = Steps(0.005)
    runner = asyncio.create_task(steps.run())
    try:
        waiters = [asyncio.create_task(steps.next()) for _ in range(3)]
        await asyncio.sleep(0)
        waiters[0].cancel()
        await asyncio.wait_for(asyncio.gather(*waiters[1:]), 10)
        assert waiters[0].cancelled()
    finally:
        runner.cancel()
    async with TestClient(TestServer(make_app(chunk_tokens=2, step_ms=1))) as client:
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True})
        events = [e.removeprefix("data: ") for e in (await r.text()).strip().split("\n\n")]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["xx", "xx", "x", ""]


# --- workload --------------------------------------------------------------------------------------

def test_shipped_trace_loads_with_its_attribution() -> None:
    rows = tr.load_trace()
    assert len(rows) == 19366 and rows[0].t_s == 0.0
    assert all(b.t_s >= a.t_s for a, b in itertools.pairwise(rows))
    readme = (tr.DATA_DIR / "README.md").read_text()
    assert "CC-BY 4.0" in readme and "Splitwise" in readme
    assert (tr.DATA_DIR / "LICENSE-CC-BY-4.0.txt").exists()


def test_class_rule_is_seeded_and_matches_its_documentation() -> None:
    rows = tr.load_trace()
    a = tr.assign_classes(rows, tr.ClassRule(seed=1))
    assert a == tr.assign_classes(rows, tr.ClassRule(seed=1))
    assert a != tr.assign_classes(rows, tr.ClassRule(seed=2))
    mix = tr.class_mix(a)  # docs/benchmarks.md: 45 % P0, 47 % P1, 8 % P2
    assert 0.42 < mix["P0"]["share"] < 0.48 and 0.44 < mix["P1"]["share"] < 0.50
    assert 0.07 < mix["P2"]["share"] < 0.10
    short = [x for x, row in zip(a, rows, strict=True) if row.context_tokens <= 1024]
    assert 0.75 < sum(x.cls == "P0" for x in short) / len(short) < 0.85  # short prompts: mostly P0
    for arr, row in zip(a, rows, strict=True):
        assert (arr.cls == "P2") == (row.context_tokens >= 4000)
        if arr.cls == "P2":
            assert arr.prompt_tokens + arr.max_tokens <= 32768
        else:
            assert (arr.prompt_tokens, arr.max_tokens) == (row.context_tokens, row.generated_tokens)
    assert max(x.prompt_tokens for x in a if x.cls == "P2") > 30000  # the original problem's 32K prompts


def test_bad_trace_row_names_its_line(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:47.0,abc,1\n")
    with pytest.raises(ValueError, match=r"t.csv:3"):
        tr.load_trace(p)


def test_speedup_offers_the_asked_tokens() -> None:
    arrivals = tr.assign_classes(tr.load_trace()[:3000])
    s = speedup_for(arrivals, tokens_s=10_000, duration_s=30)
    window = tr.time_scaled(arrivals, s, 30)
    offered = sum(a.prompt_tokens + a.max_tokens for a in window) / 30
    assert 0.9 * 10_000 < offered < 1.1 * 10_000
    assert window[0].at_s == 0 and window[-1].at_s < 30
    assert [a.index for a in window] == list(range(len(window)))


# --- modes -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ALL_MODES)
def test_mode_configs_round_trip_through_toml(mode: str, tmp_path: Path) -> None:
    spec = mode_spec(mode, capacity_tokens_s=12_000, context_tokens=40960)
    path = tmp_path / "c.toml"
    path.write_text(to_toml(spec.cfg))
    assert config_mod.load(path, env={}) == spec.cfg
    if mode.startswith("fifo"):
        # the reference differs from fifo in its workers' chunked prefill only
        assert spec.cfg == mode_spec("fifo", capacity_tokens_s=12_000, context_tokens=40960).cfg
        assert spec.cfg.class_names() == [FIFO_CLASS] and not spec.controller
        assert {t.max_class for t in spec.cfg.tenants} == {FIFO_CLASS}
        assert spec.chunked_prefill == (mode == "fifo-chunked")
    elif mode == "priority":
        assert all(c.floor == 0 for c in spec.cfg.classes) and not spec.controller
        assert spec.cfg.pools[0].capacity_tokens_s >= 1e12
    else:
        assert spec.controller and spec.cfg.pools[0].capacity_tokens_s == 12_000


# --- summary arithmetic ----------------------------------------------------------------------------

def _rec(cls: str, status: int = 200, ttft: float = 100.0, times: tuple[float, ...] = (1.0, 1.02, 1.04),
         out: int = 3, inp: int = 10) -> Record:
    arrival = tr.Arrival(0, 0.0, cls, inp, out, 0.0)
    res = Result(cls=cls, sent_s=0.9, status=status, ttft_ms=ttft if status == 200 else None,
                 token_times=list(times) if status == 200 else [], output_tokens=out if status == 200 else 0,
                 input_tokens=inp if status == 200 else 0, error="" if status == 200 else "x")
    return Record(arrival, res, 0.0)


def test_class_stats_counts_rejections_as_slo_misses() -> None:
    p0 = DEFAULT_CLASSES[0]
    recs = [_rec("P0"), _rec("P0", ttft=900.0), _rec("P0", status=429), _rec("P0", status=503)]
    s = class_stats(recs, p0, [5.0, 7.0])
    assert (s["completed"], s["rejected_429"], s["rejected_503"], s["failed"]) == (2, 1, 1, 0)
    assert s["slo_attainment"] == 0.25
    assert s["ttft_p50_ms"] <= s["ttft_p99_ms"] == 900.0
    assert s["max_queue_wait_ms"] == 7.0 and s["served_tokens"] == 26
    assert s["tpot_p50_ms"] == pytest.approx(20.0) and s["max_gap_ms"] == pytest.approx(20.0)


def test_window_tokens_counts_only_what_came_back_in_the_window() -> None:
    rec = _rec("P1", times=(1.0, 2.0, 3.0, 4.0), out=4, inp=100)
    assert window_tokens([rec], t0=0.0, duration_s=2.5) == 100 + 2
    assert window_tokens([rec], t0=0.0, duration_s=0.5) == 0



def test_output_tokens_s_counts_only_the_output_that_came_back_in_the_window() -> None:
    """Found by review: output_tokens_s divided every output token, those the drain after the
    window delivered too, by the window's length (throughput_tokens_s beside it counts the
    window's alone): 4 tokens at 1-4 s over a 2.5 s window read 1.6/s, where 2 came in it."""
    from limiter.bench.report import mode_summary

    rec = _rec("P1", times=(1.0, 2.0, 3.0, 4.0), out=4, inp=100)
    assert window_tokens([rec], t0=0.0, duration_s=2.5, prompts=False) == 2
    m = mode_summary([rec], classes=["P1"], slos={"P1": None}, samples=[], tenant_of={}, t0=0.0,
                     duration_s=2.5)
    assert m["output_tokens_s"] == 0.8 and m["throughput_tokens_s"] == round(102 / 2.5, 1)


# --- a real run --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench")
    # max_seqs 6: the worker's Redis pool (8 connections, no wait) fails with more requests
    # held at once (reported); 6 keeps every worker's concurrent calls within it.
    params = BenchParams(engine="sim", modes=MODES, load=2.0, duration_s=6.0, drain_s=8.0, workers=2,
                         max_seqs=6, gap_probe=False, out_dir=str(out), calibrate="engine")
    results = asyncio.run(run_bench(params, quiet=True))
    return results, out


def test_smoke_run_writes_every_documented_field(smoke: tuple[dict[str, Any], Path]) -> None:
    results, out = smoke
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["schema"] == "qos-bench-run/1" and set(on_disk["modes"]) == set(MODES)
    for key in ("engine", "load", "duration_s", "seed", "trace", "workers", "capacity", "arrivals",
                "class_mix"):
        assert key in on_disk["params"], key
    for mode, m in on_disk["modes"].items():
        assert m["engine"] == "sim" and m["simulated"] is True
        assert m["chunked_prefill"] is (mode != "fifo"), mode  # the workers' flag, as the mode set it
        assert m["throughput_tokens_s"] > 0, mode
        assert m["server_work_s"] > 0 and m["slo_goodput_rps"] >= 0, mode  # the workers' own count
        assert m["preemptions"] >= 0 and m["recompute_tokens"] >= 0, mode
        assert set(m["classes"]) == {"P0", "P1", "P2"}
        for cls, c in m["classes"].items():
            for f in CLASS_FIELDS:
                assert f in c, (mode, cls, f)
            assert c["sent"] == c["completed"] + c["rejected_429"] + c["rejected_503"] + c["failed"]
            if c["slo_attainment"] is not None:
                assert 0.0 <= c["slo_attainment"] <= 1.0
            if c["completed"]:
                assert c["ttft_p50_ms"] <= c["ttft_p99_ms"]
                if c["tpot_p50_ms"] is not None:
                    assert c["tpot_p50_ms"] <= c["tpot_p99_ms"]
        assert m["classes"]["P0"]["completed"] > 0, mode
    assert all({"target", "value", "goal", "met"} <= set(t) for t in on_disk["targets"])
    rows = (out / "requests.jsonl").read_text().splitlines()
    assert len(rows) == sum(m["sent"] for m in on_disk["modes"].values())
    assert results["params"]["arrivals"] == on_disk["modes"]["fifo"]["sent"]
    md = markdown(on_disk)
    assert "| qos | P0 |" in md and "| fifo | P2 |" in md and "P0 SLO attainment (qos)" in md


def test_smoke_run_qos_beats_fifo_on_p0_ttft(smoke: tuple[dict[str, Any], Path]) -> None:
    results, _ = smoke
    fifo = results["modes"]["fifo"]["classes"]["P0"]["ttft_p99_ms"]
    qos = results["modes"]["qos"]["classes"]["P0"]["ttft_p99_ms"]
    assert qos < fifo, (qos, fifo)


def test_plots_are_drawn_from_the_run_files(smoke: tuple[dict[str, Any], Path]) -> None:
    _, out = smoke
    paths = redraw(out)
    names = {"latency_cdf.png", "ttft_over_time.png", "rates.png", "served_share.png"}
    assert {p.name for p in paths} == names
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_chunked_reference_splits_the_work_gap_into_chunking_and_scheduling() -> None:
    modes = {"fifo": {"server_work_s": 100.0}, "fifo-chunked": {"server_work_s": 90.0},
             "qos": {"server_work_s": 81.0}}
    rows = {r["target"]: r["value"] for r in targets({"params": {"load": 1.0}, "modes": modes})}
    assert rows["work done by the workers qos / fifo (weighted tokens/s in the window)"] == 0.81
    chunking = "work done by the workers fifo-chunked / fifo (what chunked prefill costs, for reference)"
    scheduling = "work done by the workers qos / fifo-chunked (what the scheduling costs, for reference)"
    assert rows[chunking] == 0.9 and rows[scheduling] == 0.9
    without = {r["target"] for r in targets({"params": {"load": 1.0}, "modes": {"fifo": modes["fifo"]}})}
    assert not any("fifo-chunked" in t for t in without)


def test_targets_report_what_was_not_measured() -> None:
    rows = targets({"params": {"load": 1.5, "class_max_wait_ms": {"P2": 60000}, "class_floor": {"P2": 0.05}},
                    "modes": {}})
    assert rows and all(r["met"] is None for r in rows)


@pytest.mark.slow
def test_overhead_smoke() -> None:
    from limiter.bench.overhead import run_overhead

    report = asyncio.run(run_overhead(seconds=2.0, concurrency=8, rate=20, log=lambda _s: None))
    assert report["throughput_ratio"] > 0
    rc = report["full"]["redis_commands"]
    assert rc["per_request"] > 0 and "EVALSHA admit" in rc["by_command_per_request"]
    assert report["full"]["latency"]["completed"] > 0
    thr = report["full"]["throughput"]
    assert thr["cpu_ms_per_request"]["frontend"] > 0 and thr["cpu_ms_per_request"]["redis"] > 0


@pytest.mark.slow
def test_overhead_smoke_in_front_of_a_model_server() -> None:
    """--engine openai: the workers front a second echo process, counted as the upstream."""
    from limiter.bench.overhead import render, run_overhead

    report = asyncio.run(run_overhead(seconds=2.0, concurrency=8, rate=20, engine="openai", chunk_tokens=1,
                                      log=lambda _s: None))
    assert report["params"]["engine"] == "openai" and report["params"]["chunk_tokens"] == 1
    assert report["full"]["latency"]["completed"] > 0 and report["full"]["latency"]["errors"] == 0
    assert report["full"]["throughput"]["cpu_ms_per_request"]["upstream"] > 0
    assert "EVALSHA complete" in report["full"]["redis_commands"]["by_command_per_request"]
    assert "in front of an echo server" in str(render(report).title)


@pytest.mark.slow
def test_torch_smoke(tmp_path: Path) -> None:
    params = BenchParams(engine="torch", modes=("fifo", "qos"), load=1.0, duration_s=8.0, drain_s=15.0,
                         workers=1, token_budget=64, out_dir=str(tmp_path), capacity_rps=2.0)
    results = asyncio.run(run_bench(params, quiet=True))
    assert results["modes"]["qos"]["engine"] == "torch" and results["modes"]["qos"]["simulated"] is False
    assert results["modes"]["qos"]["gap_probe"]["during_client_ms"] is not None


@pytest.mark.slow
def test_stack_calibration_is_below_the_engine_figure(tmp_path: Path) -> None:
    from limiter.bench.runner import CONTEXT_TOKENS, stack_spec, workload
    from limiter.bench.stackcal import calibrate

    p = BenchParams(workers=2, max_seqs=6)
    cap, record = asyncio.run(calibrate("sim", workload(p), stack_spec(p), how="stack",
                                        context_tokens=CONTEXT_TOKENS["sim"], work_dir=tmp_path))
    assert 0.2 < record["stack_over_engine"] <= 1.05
    assert cap.out_weight > 5 and cap.requests_s > 0


def test_overhead_cpu_split_per_request_and_per_role_ceiling() -> None:
    from limiter.bench.overhead import cpu_split
    from limiter.bench.procstat import MachineTicks

    pids = {"client": [1], "frontend": [2, 3], "redis": [4]}
    split = cpu_split(pids, {"client": 1.0, "frontend": 2.0, "redis": 0.0},
                      {"client": 1.5, "frontend": 3.0, "redis": 0.0},
                      (MachineTicks(100, 1000), MachineTicks(280, 1200)), wall_s=2.0, completed=1000)
    assert split["cpu_ms_per_request"] == {"client": 0.5, "frontend": 1.0, "redis": 0.0}
    assert split["cores"] == {"client": 0.25, "frontend": 0.5, "redis": 0.0}
    # two frontend processes at 1 ms of CPU per request: 2,000 req/s on a core each
    assert split["ceiling_requests_s"] == {"client": 2000, "frontend": 2000, "redis": None}
    assert split["machine_busy"] == 0.9


async def _served(handler: Any, *, scheduled_ago_s: float | None = None) -> Result:
    """One ``stream_completion`` against a test server answering with ``handler``."""
    import time

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from limiter.localstack.loadgen import stream_completion

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        scheduled = None if scheduled_ago_s is None else time.monotonic() - scheduled_ago_s
        return await stream_completion(session, str(server.make_url("")).rstrip("/"), "k", "m", "hi", 2, "P0",
                                       timeout_s=30, scheduled_s=scheduled)


def _sse_handler(events: list[str]) -> Any:
    from aiohttp import web

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in events:
            await resp.write(f"data: {e}\n\n".encode())
        await resp.write_eof()
        return resp
    return handler


CHUNK = json.dumps({"choices": [{"index": 0, "text": "x", "finish_reason": None}]})


async def test_a_stream_that_ends_without_done_is_not_counted_answered() -> None:
    """A 200 stream cut short (no ``[DONE]``, no error event) is an error, so the benchmarks'
    latency figures (over the answered only) do not count it: it counted as an answer, with
    the end to end of its cut."""
    cut = await _served(_sse_handler([CHUNK]))
    assert not cut.ok and cut.error == "stream_truncated" and cut.text == "x"
    whole = await _served(_sse_handler([CHUNK, "[DONE]"]))
    assert whole.ok and whole.text == "x"


async def test_an_open_loop_request_is_timed_from_its_slot_not_from_when_it_ran() -> None:
    """An open-loop client late to send (its event loop busy) counts the wait: the request's
    times start at the slot it was scheduled for (coordinated omission otherwise hides it)."""
    late = await _served(_sse_handler([CHUNK, "[DONE]"]), scheduled_ago_s=0.5)
    assert late.ok and late.ttft_ms >= 500 and late.e2e_ms >= 500


def test_the_overhead_table_shows_the_failed_requests_its_latencies_leave_out() -> None:
    from rich.console import Console

    from limiter.bench.overhead import render

    def phase(errors: int) -> dict[str, Any]:
        return {"sent": 100, "completed": 100 - errors, "errors": errors, "requests_s": 10.0,
                **{f"{m}_{q}_ms": 1.0 for m in ("e2e", "ttft") for q in ("p50", "p99")}}

    report = {"params": {"prompt_tokens": 16, "output_tokens": 16, "workers": 1, "cpus": 2, "concurrency": 8,
                         "rate": 20, "engine": "sim"},
              "echo": {"throughput": phase(0), "latency": phase(0)},
              "full": {"throughput": phase(0), "latency": phase(7),
                       "redis_commands": {"per_request": 8.0, "per_request_minus_background": 7.9,
                                          "target": 9}},
              "throughput_ratio": 0.2,
              "added_latency": {f"{m}_{q}_ms": 0.0 for m in ("e2e", "ttft") for q in ("p50", "p99")}}
    console = Console(width=200, record=True)
    console.print(render(report))
    row = next(line for line in console.export_text().splitlines() if "errors / sent" in line)
    assert "0/100, 0/100" in row and "0/100, 7/100" in row


async def test_a_closed_loop_throughput_counts_only_what_was_answered_inside_its_seconds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each closed-loop client sends until ``seconds`` are up and then waits for its last
    request: those answers come after the phase, so they are not part of its rate (they made
    requests_s too high by up to ``concurrency`` requests over ``seconds``). Here every answer
    takes 0.3 s: two clients answer 3 each in the first second and a 4th each at 1.2 s."""
    import contextlib
    import time

    from limiter.bench import overhead as ov

    async def answer(_session: Any, _url: str, _key: str, _model: str, _prompt: str, _n: int, cls: str,
                     **_kw: Any) -> Result:
        sent = time.monotonic()
        await asyncio.sleep(0.3)
        return Result(cls=cls, sent_s=sent, status=200, output_tokens=16, ttft_ms=1.0,
                      e2e_ms=(time.monotonic() - sent) * 1000)

    @contextlib.asynccontextmanager
    async def no_server(*_a: Any, **_kw: Any) -> Any:
        yield "http://127.0.0.1:9", 0

    monkeypatch.setattr(ov, "stream_completion", answer)
    monkeypatch.setattr(ov, "echo_server", no_server)
    thr = (await ov.measure_echo(1.0, 2, None, 16, lambda _s: None))["throughput"]
    assert thr["completed"] == 8  # every answer is still counted as answered ...
    assert thr["requests_s"] == 6.0  # ... but the rate is of the 6 inside the second


def test_qos_help_names_every_bench_mode() -> None:
    """`qos --help`'s line for `bench` listed its modes by hand and had lost `control` and
    `plot` (a newcomer's walk of the README): every mode registered is named there."""
    import argparse

    from limiter.cli import build_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    bench_help = next(a.help for a in sub._choices_actions if a.dest == "bench")
    modes = next(a for a in sub.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    missing = [m for m in modes.choices if m not in bench_help]
    assert not missing, f"qos --help's bench line leaves out {missing}: {bench_help}"


@pytest.mark.parametrize("markdown", [[], ["--markdown"]])
def test_bench_plot_of_a_directory_without_a_run_names_the_problem(tmp_path: Path, capsys, markdown) -> None:
    """`qos bench plot DIR` of a missing directory, or of one without results.json, was a
    FileNotFoundError traceback."""
    from limiter.cli import main

    for d in (tmp_path / "missing", tmp_path):
        assert main(["bench", "plot", str(d), *markdown]) == 2
        err = capsys.readouterr().err
        assert "results.json" in err and "Traceback" not in err, err


@pytest.mark.parametrize(("args", "flag"), [
    (["run", "--out", "/proc/qos-bench"], "--out"),
    (["tenants", "--out", "/dev/null/x"], "--out"),
    (["redis-budget", "--json", "/nonexistent-dir/x.json"], "--json"),
    (["admission", "--json", "."], "--json"),
    (["overhead", "--json", "/nonexistent-dir/a/b.json"], "--json"),
    (["control", "--noise-out", "/nonexistent-dir/n.json"], "--noise-out"),
])
def test_an_output_path_a_mode_cannot_write_is_refused_before_it_runs(capsys, args: list[str],
                                                                     flag: str) -> None:
    """Found when the mode wrote its figures, a run of minutes ended in a traceback and lost
    them (--out /proc/x at once; --json into a missing directory after the whole run). Each
    returns here at once: nothing was started."""
    from limiter.cli import main

    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert f"config error: {flag}: " in err and "Traceback" not in err, err


@pytest.mark.parametrize(("item", "said"), [("target=abc", "controller.target: must be a number"),
                                            ("nosuch=1", "controller.nosuch: unknown field")])
def test_a_bad_controller_setting_is_refused_before_the_stack_starts(capsys, item: str, said: str) -> None:
    """Checked only by the controller process, it ended the run once the stack was up (the
    start-up spent) with that process's exit as a traceback."""
    from limiter.cli import main

    assert main(["bench", "run", "--controller", item]) == 2
    err = capsys.readouterr().err
    assert f"config error: --controller: {said}" in err and "Traceback" not in err, err


def test_a_bench_stacks_status_lines_name_the_bench_not_qos_up(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bench stack stopping printed "qos up: stopping 1 frontends ..." though nobody had run
    `qos up` (a newcomer's walk): its lines name the bench stack; `qos up`'s keep its name."""
    import sys

    from limiter.bench.stack import LoggedStack
    from limiter.localstack.launcher import Child, Stack

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    bench = LoggedStack("redis://unused", "http://unused", log_dir=tmp_path)
    up = Stack("redis://unused", "http://unused")
    for stack, label in ((bench, "bench stack"), (up, "qos up")):
        child = Child("fe0", "frontend", sleeper)
        stack.start(child, {})
        stack.stop(5.0) if stack is bench else stack.stop({"frontend": 5.0})
        assert not child.running
        out = capsys.readouterr().out
        assert f"{label}: stopping 1 frontends" in out, out
        assert stack is up or "qos up" not in out, out
