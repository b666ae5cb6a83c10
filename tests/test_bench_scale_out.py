"""`qos bench scale-out`: the arithmetic, /proc parsing, and one tiny real run on a real
3-master cluster (outcomes and shape, never speed)."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time

import pytest

from limiter.bench import load_processes, procstat, scale_report
from limiter.bench import scale_math as sm
from limiter.bench import scale_out as so
from limiter.cli import build_parser
from tests.support.helpers import refused_by_name


def test_shard_figures_subtract_the_background_at_its_rate() -> None:
    d = sm.ShardDelta(cpu_s=0.55, calls=10_100, evalsha=420)
    bg = sm.ShardDelta(cpu_s=0.01, calls=20, evalsha=4)  # over 2 s: 0.005 CPU-s, 10 calls, 2 EVALSHA per s
    f = sm.shard_figures(d, wall_s=10.0, requests=100, background=bg, background_s=2.0)
    assert f["cpu_ms_per_request"] == pytest.approx(5.0)  # (0.55 - 0.05) / 100
    assert f["cpu_ms_per_request_raw"] == pytest.approx(5.5)
    assert f["calls_per_request"] == pytest.approx(100.0)  # (10100 - 100) / 100
    assert f["evalsha_per_request"] == pytest.approx(4.0)  # (420 - 20) / 100
    assert f["busy"] == pytest.approx(0.055)
    assert f["ceiling_rps"] == pytest.approx(200.0)  # 1 / 5 ms


def test_shard_figures_of_a_shard_whose_pool_was_not_loaded() -> None:
    f = sm.shard_figures(sm.ShardDelta(0.02, 50, 5), wall_s=4.0, requests=0)
    assert f["busy"] == pytest.approx(0.005)
    assert f["cpu_ms_per_request"] is None and f["ceiling_rps"] is None


def test_ratios_drift_and_projection() -> None:
    assert sm.ratios([100.0, 150.0, 290.0]) == [1.0, 1.5, 2.9]
    assert sm.ratios([0.0, 5.0]) == [None, None]
    assert sm.cost_drift([None, 0.5, 0.55]) == [None, 1.0, 1.1]  # from the first phase it was loaded in
    proj = sm.projection([2000.0, 1800.0, 2200.0])
    assert [p["requests_s"] for p in proj] == [2000.0, 3800.0, 6000.0]
    assert [p["ratio"] for p in proj] == [1.0, 1.9, 3.0]
    assert sm.projection([1000.0], headroom=0.5)[0]["requests_s"] == 500.0
    assert sm.ceiling_rps(0.0005) == 2000.0 and sm.ceiling_rps(0.0) is None


def test_size_fleet() -> None:
    s = sm.size_fleet(1000, 10.0, shard_us_per_request=500.0, frontend_us_per_request=800.0, headroom=0.5)
    # 10,000 req/s; a shard at half a core carries 1,000, a frontend core 625
    assert s == {"gpus": 1000, "requests_s": 10_000.0, "shard_rps": 1000.0, "shards": 10,
                 "frontend_rps_per_core": 625.0, "frontend_cores": 16, "max_gpus_per_pool": 100}
    assert sm.size_fleet(1, 10.0, 500.0, 800.0)["shards"] == 1  # never less than one
    with pytest.raises(ValueError):
        sm.size_fleet(100, 10.0, 500.0, 800.0, headroom=1.5)


def test_shard_us_with_pushes() -> None:
    assert sm.shard_us_with_pushes(450.0, 1, 53, 120.0) == pytest.approx(450 + 52 * 120)


def test_pools_elsewhere() -> None:
    keys = {"a": {"p0": 10, "p1": 0}, "b": {"p0": 0, "p1": 7}, "c": {"p0": 2, "p1": 0}}
    assert sm.pools_elsewhere(keys, {"p0": "a", "p1": "b"}) == {"p0": 2, "p1": 0}


def test_proc_stat_parsing() -> None:
    line = "4242 (qos (frontend) x) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0 100 0 0"
    assert procstat.parse_process_cpu_s(line, ticks_s=100) == pytest.approx(3.0)
    a = procstat.MachineTicks.parse("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3 4")
    b = procstat.MachineTicks.parse("cpu  200 0 200 800 100 0 0 0 0 0\ncpu0 1 2 3 4")
    assert (a.busy, a.total) == (200, 1000)
    assert procstat.busy_share(a, b) == pytest.approx(200 / 300)
    assert procstat.busy_share(a, a) is None
    assert procstat.process_cpu_s(2**22 + 12345) == 0.0  # no such process
    assert procstat.MachineTicks.read().total > 0


def test_spec_checks_and_cli() -> None:
    with pytest.raises(ValueError):
        so.ScaleSpec(pools=4).check()
    with pytest.raises(ValueError):
        so.ScaleSpec(headroom=0).check()
    with pytest.raises(ValueError, match="client processes"):
        so.ScaleSpec(client_processes=0).check()
    args = build_parser().parse_args(["bench", "scale-out", "--seconds", "2", "--pools", "2", "--out", "d"])
    assert (args.seconds, args.pools, args.out, args.frontends) == (2.0, 2, "d", so.DEFAULT_FRONTENDS)
    assert args.client_processes == 1
    args = build_parser().parse_args(["bench", "scale-out", "--client-processes", "4"])
    assert args.client_processes == 4


def test_clients_split_over_processes() -> None:
    assert load_processes.shares(16, 3) == [6, 5, 5]
    assert load_processes.shares(2, 4) == [1, 1]  # no process without a client
    assert sum(load_processes.shares(31, 8)) == 31


async def test_a_client_process_stuck_past_the_phase_is_killed(monkeypatch) -> None:
    monkeypatch.setattr(load_processes, "CHILD_GRACE_S", 1.0)
    spawned: list[asyncio.subprocess.Process] = []
    spawn = asyncio.create_subprocess_exec

    async def spawned_too(*args, **kwargs):
        spawned.append(child := await spawn(*args, **kwargs))
        return child

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spawned_too)
    with socket.socket() as silent:  # takes connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(TimeoutError):
            await load_processes.run_clients(1, url, "k", ["p"], 0.5, 1, 1, time.time())
    assert len(spawned) == 1 and spawned[0].returncode is not None  # killed, not left behind


async def test_a_client_process_that_fails_early_ends_the_phase_at_once(monkeypatch) -> None:
    """A child that dies at once is reported then, not when the others end (they are killed)."""
    spawned: list[asyncio.subprocess.Process] = []
    spawn = asyncio.create_subprocess_exec

    async def second_fails(*args, **kwargs):
        if spawned:  # the second child exits 3 at once; the first runs its phase
            args = (sys.executable, "-c", "import sys; sys.stderr.write('broken\\n'); sys.exit(3)")
        spawned.append(child := await spawn(*args, **kwargs))
        return child

    monkeypatch.setattr(asyncio, "create_subprocess_exec", second_fails)
    with socket.socket() as silent:  # the first child's requests never end
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="a load process exited 3: broken"):
            await load_processes.run_clients(2, url, "k", ["p"], 60.0, 2, 1, time.time())
        assert time.monotonic() - t0 < 30.0, "reported only once the other child's 60 s phase ended"
    assert [c.returncode is not None for c in spawned] == [True, True]  # the first killed


async def test_a_client_process_that_fails_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"a load process exited 2: .*--seconds must be > 0"):
        await load_processes.run_clients(1, "http://127.0.0.1:9", "k", ["p"], 0.0, 1, 1, 0.0)


@pytest.mark.parametrize("client_processes", [1, 2])
async def test_tiny_run_on_a_three_master_cluster(tmp_path, client_processes: int) -> None:
    spec = so.ScaleSpec(frontends=1, seconds=1.0, idle_s=0.5, concurrency=4, max_seqs=16,
                        client_processes=client_processes)
    report = await so.run_scale_out(spec, log=lambda _line: None)
    pools, home = report["pools"], report["home"]
    assert len(pools) == 3 and len(set(home.values())) == 3  # one pool per master
    assert [ph["pools"] for ph in report["phases"]] == [1, 2, 3]
    for ph in report["phases"]:
        assert ph["errors"] == 0, ph
        # the clients' CPU, in child processes too: per request (any HTTP client spends well over
        # 50 us on one; a parent that only waits for its client processes, ~0), not per second
        # of wall time, which a loaded machine's fewer requests made 0.05 cores (rounded) once
        assert ph["role_cpu_ms_per_request"]["client"] > 0.05, ph
        for p in ph["loaded"]:
            assert ph["completed"][p] > 0, (p, ph)  # every loaded pool served requests
            s = ph["shards"][p]
            # under 2 scripts a request is possible: admits and completions of one turn merge
            assert s["evalsha_per_request"] > 0 and s["calls_per_request"] > s["evalsha_per_request"], s
            assert s["ceiling_rps"] and s["ceiling_rps"] > 0
    first = report["phases"][0]
    loaded = first["shards"][pools[0]]
    for p in pools[1:]:  # the idle shards only did their background while pool 0 was loaded
        assert first["shards"][p]["requests"] == 0
        assert first["shards"][p]["evalsha"] < loaded["evalsha"] / 4, first["shards"]
    iso = report["isolation"]
    assert iso["keys_elsewhere"] == dict.fromkeys(pools, 0)
    assert all(iso["keys_by_shard"][home[p]][p] > 0 for p in pools)
    assert [r["pools"] for r in report["projection"]] == [1, 2, 3]
    assert [s["gpus"] for s in report["sizing"]] == list(so.FLEETS)
    written = scale_report.write_out(report, tmp_path)
    data = json.loads(written[0].read_text())
    assert set(data) >= {"params", "pools", "home", "phases", "background", "isolation", "projection",
                         "sizing", "cost_drift", "goals"}
    assert written[1].read_text().count("| pools |") == 1
    scale_report.render(report)  # the terminal tables render too


async def test_a_cancel_while_the_cluster_starts_stops_every_node_it_started(monkeypatch) -> None:
    """Found by review: ``cluster = await asyncio.to_thread(LocalRedisCluster(...).start, 3)``
    stood before the try whose finally stops the cluster, so a cancel (Ctrl-C) during the start
    left its 3 redis-servers and their dirs behind: the thread went on starting them, and
    nothing held the cluster to stop. Now the start is inside the try, and a cancel waits for
    the thread to end before the stop (a stop while it ran would miss the nodes after it)."""
    import threading

    entered, release = threading.Event(), threading.Event()
    made: list[FakeCluster] = []

    class FakeCluster:
        def __init__(self, extra: list[str]) -> None:
            self.nodes: list[int] = []
            self.stopped: list[int] = []
            made.append(self)

        def start(self, masters: int) -> FakeCluster:
            entered.set()
            release.wait(30)  # the test lets it go once the run is cancelled (never a wait on time)
            self.nodes += list(range(masters))  # the nodes a real start has up by now
            return self

        def stop(self) -> None:
            self.stopped += self.nodes

    monkeypatch.setattr(so, "LocalRedisCluster", FakeCluster)
    run = asyncio.ensure_future(so.run_scale_out(so.ScaleSpec(), log=lambda _s: None))
    await asyncio.to_thread(entered.wait, 30)
    run.cancel()
    await asyncio.sleep(0)  # the cancel reaches the run while its start's thread still runs
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert [c.stopped for c in made] == [[0, 1, 2]]


@pytest.mark.parametrize(("flag", "value"), [
    ("--seconds", "nan"), ("--seconds", "inf"), ("--idle-seconds", "nan"), ("--idle-seconds", "inf"),
    ("--rps-per-gpu", "nan"), ("--rps-per-gpu", "inf"), ("--headroom", "nan"), ("--seconds", "0"),
])
def test_a_scale_out_time_or_rate_that_is_not_finite_is_refused_by_name(
        flag: str, value: str, capsys, monkeypatch) -> None:
    """Found by review: NaN passed `<= 0` (--idle-seconds nan: an idle interval that never
    ended) and inf passed as well."""
    refused_by_name(monkeypatch, capsys, so, "run_scale_out", ["bench", "scale-out", flag, value],
                    f"{flag}: must be in (0, ", stream="out")
