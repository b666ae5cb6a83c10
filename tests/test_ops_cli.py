"""`qos status --json` and `qos top` against a real Redis, read-only."""

from __future__ import annotations

import contextlib
import json
import re

import pytest

from limiter.cli import build_parser, main
from limiter.keys import PoolKeys
from tests.support.helpers import admit


async def test_status_json_has_the_documented_fields(scripts, pool, redis_server, capsys):
    await admit(scripts, pool, cls="P0", input_tokens=10, max_tokens=5)
    await admit(scripts, pool, cls="P2", input_tokens=10, max_tokens=5)
    await scripts.claim(pool, "w1", 1)
    await scripts.client.zadd(pool.workers, {"w1": 4102444800000 - 10})
    await scripts.client.hset(
        pool.worker("w1"), mapping={"engine": "sim", "simulated": 1, "tokens_s": 12.5, "batch_size": 3}
    )
    await scripts.client.hset(pool.compliance, mapping={"P0": 0.995})
    fence, _ = await scripts.acquire_leader(pool, "ctl", 1000)
    await scripts.set_rates(pool, "ctl", fence, {"classes": {"P0": {"reason": "hold"}}}, {"P0.rate": 11000})

    import asyncio

    rc = await asyncio.to_thread(main, ["status", "--json", "--redis-url", redis_server.url])
    assert rc == 0
    snap = json.loads(capsys.readouterr().out)
    tiny = snap["pools"]["tiny"]
    for cls in ("P0", "P1", "P2"):
        for field in ("rate", "burst", "tokens", "queued", "inflight", "compliance"):
            assert field in tiny["classes"][cls], (cls, field)
    assert tiny["classes"]["P0"]["rate"] == 11000
    assert tiny["classes"]["P0"]["inflight"] == 1 and tiny["classes"]["P2"]["queued"] == 1
    assert tiny["classes"]["P0"]["compliance"] == 0.995 and tiny["classes"]["P1"]["compliance"] is None
    assert tiny["compliance_age_s"] is None  # no controller has stamped it
    assert "last_seen_s" in tiny["workers"]["w1"] and tiny["workers"]["w1"]["tokens_s"] == 12.5
    assert tiny["decisions"][0]["version"] == 1


async def test_a_worker_whose_heartbeat_expired_reads_as_silent(scripts, pool, redis_server, capsys):
    """A worker killed without leaving stays in the set until a live one prunes it (twice its
    heartbeat TTL); its stats hash is gone after one TTL. It read as any worker, "-" for every
    figure and a growing last-seen: now it says it is silent (a newcomer's walk)."""
    import asyncio

    await scripts.client.zadd(pool.workers, {"w1": 4102444800000 - 10, "dead": 4102444800000 - 10})
    await scripts.client.hset(pool.worker("w1"), mapping={"engine": "sim", "simulated": 1})
    rc = await asyncio.to_thread(main, ["status", "--json", "--redis-url", redis_server.url])
    workers = json.loads(capsys.readouterr().out)["pools"]["tiny"]["workers"]
    assert rc == 0 and workers["dead"]["note"].startswith("silent") and "note" not in workers["w1"], workers
    rc = await asyncio.to_thread(main, ["status", "--redis-url", redis_server.url])
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if line.count("│") > 3}
    assert rc == 0 and "SILENT" in rows["dead"] and "SILENT" not in rows["w1"], rows


async def test_top_renders_a_frame(scripts, pool, redis_server, capsys):
    import asyncio

    await scripts.client.zadd(pool.workers, {"w1": 1})
    rc = await asyncio.to_thread(
        main, ["top", "--iterations", "1", "--interval", "0.1", "--redis-url", redis_server.url]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "pool tiny" in out and "w1" in out


async def test_top_shows_why_the_rates_moved_and_how_sure_the_capacity_is(scripts, pool, redis_server,
                                                                          capsys):
    """Per class the newest decision's reason; the capacity estimate with its source and
    confidence; each worker's step budget (issue: an operator must see why rates moved)."""
    import asyncio

    await scripts.client.zadd(pool.workers, {"w1": 4102444800000 - 10})
    await scripts.client.hset(pool.worker("w1"), mapping={
        "engine": "sim", "tokens_s": 12.5, "capacity_tokens_s": 9000, "token_budget": 96,
        "token_budget_max": 256})
    sec, _usec = await scripts.client.time()
    await scripts.client.hset(pool.compliance, mapping={
        "P0": 0.995, ".capacity": 41000.0, ".capacity_source": "workers", ".capacity_confidence": 0.8,
        ".updated_ms": (int(sec) - 7200) * 1000, ".controller": "ctl"})  # two hours old: a dead one's
    fence, _ = await scripts.acquire_leader(pool, "ctl", 1000)
    record = {"classes": {"P0": {"reason": "hold"}, "P1": {"reason": "tighten_self"},
                          "P2": {"reason": "tighten_lower_for_P1"}}}
    await scripts.set_rates(pool, "ctl", fence, record, {"P1.rate": 9000})
    rc = await asyncio.to_thread(
        main, ["top", "--iterations", "1", "--interval", "0.1", "--redis-url", redis_server.url]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "tighten_self" in out and "tighten_lower_for_P1" in out
    assert "measured 41,000 from workers" in out and "confidence 80 %" in out
    assert "96 / 256" in out
    assert re.search(r"720\d s old", out), out  # a dead controller's numbers show as old


async def test_a_class_named_like_an_estimate_field_keeps_its_own_compliance(aredis):
    """Classes named ``capacity`` and ``updated_ms``: the controller's compliance hash holds
    their scores and its capacity estimate side by side, and status reads each back as what
    it is (the estimate's fields used to be plain ``capacity``, ``updated_ms``, ...: a class
    of that name and the estimate overwrote each other)."""
    import dataclasses

    from limiter.config import demo_config, validate
    from limiter.controller.capacity import CapacityEstimate
    from limiter.controller.observe import publish
    from limiter.controller.settings import ControllerSettings
    from limiter.controller.slo_window import WindowStats
    from limiter.status import snapshot

    base = demo_config()
    names = {"P0": "capacity", "P1": "updated_ms", "P2": "P2"}
    classes = tuple(dataclasses.replace(c, name=names[c.name]) for c in base.classes)
    tenants = tuple(dataclasses.replace(t, default_class=names[t.default_class], max_class=names[t.max_class])
                    for t in base.tenants)
    cfg = validate(dataclasses.replace(base, classes=classes, tenants=tenants))
    settings = ControllerSettings(controller_id="ctl").resolved(cfg)
    window = {"capacity": WindowStats(10, 9, 10, 9, True), "updated_ms": WindowStats(4, 1, 4, 1, True),
              "P2": WindowStats(5, 5, 5, 5, False)}
    from limiter.scripts import Scripts

    await publish(Scripts(aredis), PoolKeys("tiny"), settings, 1_000.0, window,
                  CapacityEstimate(value=41_000.0, source="workers", live_workers=2, busy_intervals=3,
                                   confidence=0.8))
    tiny = (await snapshot(aredis, cfg))["pools"]["tiny"]
    assert tiny["classes"]["capacity"]["compliance"] == 0.9
    assert tiny["classes"]["updated_ms"]["compliance"] == 0.25
    assert tiny["classes"]["P2"]["compliance"] is None
    assert tiny["measured_capacity"] == 41_000.0 and tiny["capacity_source"] == "workers"
    assert tiny["capacity_confidence"] == 0.8


async def test_status_and_top_survive_odd_redis_contents(scripts, pool, redis_server, capsys):
    """A worker id in the heartbeat set that is no valid name (written by hand, or by an old
    version) made `qos status` fail with InvalidName; a decision whose `classes` is not an
    object made `qos top`'s table raise."""
    import asyncio

    alive = 4102444800000 - 10
    await scripts.client.zadd(pool.workers, {"w1": alive, "bad id:with{braces}": alive})
    await scripts.client.xadd(pool.decisions, {"version": 7, "controller": "ctl",
                                               "d": json.dumps({"classes": [1]})})
    rc = await asyncio.to_thread(main, ["status", "--json", "--redis-url", redis_server.url])
    assert rc == 0
    tiny = json.loads(capsys.readouterr().out)["pools"]["tiny"]
    assert "w1" in tiny["workers"] and "bad id:with{braces}" in tiny["workers"]
    rc = await asyncio.to_thread(main, ["top", "--iterations", "1", "--interval", "0.1", "--redis-url",
                                        redis_server.url])
    assert rc == 0 and "w1" in capsys.readouterr().out


async def test_a_workers_kv_use_is_a_percentage_and_odd_fields_stay_text(scripts, pool, redis_server, capsys):
    """kv use is a 0-1 fraction: it was rounded to a whole number, so a worker at 97 % read
    "1" (full) and one at 30 % "0". A host named like a number became one, and a field
    reading "nan" made `--json` print NaN, which is not JSON."""
    import asyncio

    alive = 4102444800000 - 10
    await scripts.client.zadd(pool.workers, {"w1": alive})
    await scripts.client.hset(pool.worker("w1"), mapping={"kv_use": "0.97", "host": "1e3", "tokens_s": "nan",
                                                          "engine": "sim"})
    await scripts.client.hset(pool.compliance, mapping={"P0": "nan", ".capacity": "inf"})  # pool figures too
    rc = await asyncio.to_thread(main, ["status", "--json", "--redis-url", redis_server.url])
    assert rc == 0
    out = capsys.readouterr().out
    assert "NaN" not in out  # Python's json reads it; JSON has no NaN
    w1 = json.loads(out)["pools"]["tiny"]["workers"]["w1"]
    assert (w1["kv_use"], w1["host"], w1["tokens_s"]) == (0.97, "1e3", "nan")
    tiny = json.loads(out)["pools"]["tiny"]
    assert tiny["classes"]["P0"]["compliance"] is None and tiny["measured_capacity"] is None
    rc = await asyncio.to_thread(main, ["status", "--redis-url", redis_server.url])
    assert rc == 0 and "97.0 %" in capsys.readouterr().out


@pytest.mark.parametrize("argv, flag", [
    (["top", "--iterations", "-1"], "--iterations"),  # ran for ever
    (["top", "--interval", "0"], "--interval"),  # polled Redis flat out
    (["status", "--decisions", "-3"], "--decisions"),  # showed none
    (["status", "--decisions", "99999999999999999999"], "--decisions"),  # Redis' own error, no flag named
])
def test_status_and_top_refuse_bad_flags_by_name(argv, flag, capsys):
    # an address nothing listens on: a flag refused before any connection is tried
    assert main([*argv, "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert f"config error: {flag}: must be" in capsys.readouterr().err


async def test_status_needs_no_tokenizer_file_of_the_pools(scripts, pool, redis_server, tmp_path, capsys):
    """`qos status` loaded each pool's tokenizer.json to validate the config: on an operator's
    host without the model's files it exited 2 (found by a review of the operator paths). A
    role that counts no tokens (status, top, workers, the controller) reads no such file;
    `qos config check` and the frontend still do."""
    import asyncio

    from limiter.config import demo_config
    from limiter.localstack.toml_writer import write_toml
    from tests.support.helpers import three_classes

    path = write_toml({"redis": {"url": redis_server.url}, "classes": three_classes(),
                       "pools": [{"name": "tiny", "tokenizer": str(tmp_path / "absent" / "tokenizer.json")}],
                       "tenants": [{"name": "user", "key_sha256": [demo_config().tenants[0].key_sha256[0]]}]},
                      tmp_path / "qos.toml")
    rc = await asyncio.to_thread(main, ["status", "--json", "--config", str(path)])
    assert rc == 0, capsys.readouterr().err
    assert "tiny" in json.loads(capsys.readouterr().out)["pools"]
    assert main(["config", "check", str(path)]) == 2
    assert "pools[0].tokenizer" in capsys.readouterr().err


async def test_status_says_a_pool_is_not_initialised(redis_server, sync_redis, capsys):
    """An empty Redis (the wrong database, say) showed a table of dashes: only --json said
    so (`initialised: false`)."""
    import asyncio

    rc = await asyncio.to_thread(main, ["status", "--redis-url", redis_server.url])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0 and "NOT INITIALISED" in out
    # ... and says which Redis it read: `qos status` with no flag reads 6379, not the private
    # Redis of the `qos up` stack a newcomer just started
    assert f"NOT INITIALISED in {redis_server.url}" in out and "--redis-url" in out


async def test_top_rides_through_a_redis_outage_and_says_so(monkeypatch):
    """`qos top` quit (exit 1) at the first read that found no Redis: the live view an operator
    keeps open through a failover or a restart. It now shows the outage, since when, over the
    last view, and carries on; it shows the deployment again once Redis answers."""
    import asyncio
    import io

    from rich.console import Console

    from limiter import ops_cli
    from tests.support.redis_server import RedisServer

    frames: list[str] = []

    class Frames:  # rich's Live draws nothing mid-run off a terminal: the frames as text
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __enter__(self) -> Frames:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def update(self, renderable: object) -> None:
            console = Console(width=200, file=io.StringIO(), record=True)
            console.print(renderable)
            frames.append(console.export_text())

    monkeypatch.setattr(ops_cli, "Live", Frames)
    server = RedisServer().start()
    try:
        server.client().zadd(PoolKeys("tiny").workers, {"w1": 1})
        args = build_parser().parse_args(["top", "--iterations", "0", "--interval", "0.1",
                                          "--redis-url", server.url])
        top = asyncio.create_task(ops_cli._top(args))

        async def shown(what: str, unless: str = "\0") -> str:
            deadline = asyncio.get_running_loop().time() + 30
            while not (frames and what in frames[-1] and unless not in frames[-1]):
                assert not top.done(), "qos top ended"
                assert asyncio.get_running_loop().time() < deadline, \
                    f"qos top to show {what!r}: {frames[-1:]}"
                await asyncio.sleep(0.05)
            return frames[-1]

        await shown("w1", unless="unavailable")
        server.kill()
        down = await shown("Redis unavailable since")
        assert "the last view below" in down and "w1" in down, down
        server.start()  # the same port
        server.client().zadd(PoolKeys("tiny").workers, {"w1": 1})  # (a kill may lose the last second)
        await shown("w1", unless="unavailable")
        top.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await top
    finally:
        server.stop()


def test_top_through_an_outage_says_why_redis_did_not_answer(capsys):
    """The outage note said only "Redis unavailable since ...": a wrong password (redis-py's
    AuthenticationError is a ConnectionError, so an outage) or a bad TLS certificate left
    `qos top` retrying for ever without the reason it had printed before (it quit naming it)."""
    from tests.support.redis_server import RedisServer

    server = RedisServer().start()
    try:
        server.client().config_set("requirepass", "sekret")
        rc = main(["top", "--iterations", "1", "--interval", "0.1", "--redis-url", server.url])
    finally:
        server.stop()
    out = capsys.readouterr().out
    assert rc == 1 and "Redis unavailable since" in out, out
    assert "Authentication required" in out, out


def test_a_simulated_worker_is_labelled_as_its_log_labels_it():
    """The engine column read "sim (sim)": the marker repeated the engine's name instead of
    saying what it means, as the worker's log does ("[SIMULATED]")."""
    import io

    from rich.console import Console

    from limiter.ops_cli import render

    cls = {"rate": 1.0, "ceil": 1.0, "burst": 1.0, "tokens": 1.0, "queued": 0, "inflight": 0,
           "compliance": None}
    snap = {"pools": {"tiny": {"model": "tiny", "capacity": 1.0, "policy_version": 1, "classes": {"P0": cls},
                               "workers": {"w1": {"engine": "sim", "simulated": "1"},
                                           "w2": {"engine": "torch", "simulated": "0"}},
                               "decisions": []}}}
    out = io.StringIO()
    Console(file=out, width=200).print(render(snap))
    rows = {line.split("│")[1].strip(): line for line in out.getvalue().splitlines() if line.count("│") > 3}
    assert "sim (SIMULATED)" in rows["w1"] and "(sim)" not in out.getvalue()
    assert "torch" in rows["w2"] and "SIMULATED" not in rows["w2"]
