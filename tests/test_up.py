"""`qos up` end to end: a private Redis and the torch tiny engine, requests through the
official openai SDK, `qos status --json` against it, Ctrl-C stops every child."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.support.qos_up import QOS
from tests.support.redis_server import free_port
from tests.support.up_stack import Up, alive


def test_qos_up_serves_requests_and_stops_every_child(tmp_path):
    port = free_port()
    with Up(port, "--engine", "torch", "--workers", "1", "--frontends", "2") as up:
        ready = up.wait_ready().line(r"^qos up: ready at")
        assert f"http://127.0.0.1:{port}" in ready and "demo-p0" in ready and "demo-admin" in ready
        assert len(up.known) >= 5  # redis, 2 frontends, controller, worker

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo-p1")
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, seed=1)
        assert done.usage.completion_tokens == 8 and done.usage.prompt_tokens == 6
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in chat if c.choices]
        assert len(pieces) >= 1

        out = subprocess.run([QOS, "status", "--json", "--redis-url", up.redis_url], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        snap = json.loads(out.stdout)
        tiny = snap["pools"]["tiny"]
        assert set(tiny["classes"]["P1"]) >= {"rate", "burst", "tokens", "queued", "inflight", "compliance"}
        assert tiny["classes"]["P1"]["counters"]["done"] >= 2
        assert all("last_seen_s" in w for w in tiny["workers"].values()) and len(tiny["workers"]) == 1

        up.ctrl_c()
        assert up.wait_exit(60) == 0, up.output
        assert up.line(r"qos up: stopped"), up.output
        time.sleep(0.2)
        assert [pid for pid in up.known if alive(pid)] == []


def test_qos_up_without_redis_server_uses_an_embedded_redis_and_says_so(tmp_path):
    bindir = tmp_path / "bin"  # a PATH with python but no redis-server
    bindir.mkdir()
    (bindir / "python").symlink_to(Path(sys.executable))
    port = free_port()
    with Up(port, "--engine", "sim", "--workers", "1", env={"PATH": str(bindir)}) as up:
        up.wait_ready(120)
        assert up.line(r"embedded in-process Redis.*demos only"), up.output
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo-p0", max_retries=0)
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=4)
        assert done.usage.completion_tokens == 4
        up.ctrl_c()
        assert up.wait_exit(60) == 0, up.output


@pytest.mark.parametrize(("argv", "named"), [
    (["--frontends", "0"], "--frontends"),
    (["--engine", "openai"], "--upstream-url"),
    (["--upstream-model", "llama-3"], "--upstream-model"),  # the sim engine has no upstream
    (["--no-upstream-priority"], "--upstream-priority"),
    (["--demo-duration", "-1"], "--demo-duration"),
])
def test_a_bad_flag_is_refused_by_name_before_anything_starts(argv, named, capsys):
    from limiter.cli import main

    assert main(["up", "--port", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and "config error" in err


def test_the_demo_load_without_a_duration_goes_on_past_its_first_round() -> None:
    """`--demo-duration 0` is "until Ctrl-C", but the load was one hour-long schedule: after an
    hour it was sent, and the demo stopped. Rounds follow one another, each its own draw."""
    import itertools

    from limiter.localstack.demo_load import demo_arrivals, demo_loads

    loads = demo_loads("sim")
    endless = list(itertools.islice(demo_arrivals(loads, 0, seed=7, round_s=2.0), 200))
    offsets = [o for o, _, _ in endless]
    assert offsets == sorted(offsets) and offsets[-1] > 3 * 2.0  # several rounds, in time order
    first, second = [o for o in offsets if o < 2.0], [o - 2.0 for o in offsets if 2.0 <= o < 4.0]
    assert first and second and first != second  # each round drawn afresh
    bounded = list(demo_arrivals(loads, 5.0, seed=7))
    assert bounded and max(o for o, _, _ in bounded) < 5.0  # a duration ends the schedule


def test_qos_up_with_a_cluster_config_serves_on_its_private_redis(tmp_path):
    """A deployment's config (redis.cluster = true, or QOS_REDIS_CLUSTER=1 in the shell) and
    no --redis-url: qos up starts a private standalone redis-server, and told every child it
    was a Redis Cluster. They all took the refusal for an outage and retried; qos up waited
    out its ready timeout (120 s by default) and failed with "/readyz answers 503 (not
    connected to Redis yet)". Its own Redis is standalone, so its children must be told so."""
    port = free_port()
    with Up(port, "--engine", "sim", "--workers", "1", "--ready-timeout", "30",
            env={"QOS_REDIS_CLUSTER": "1"}) as up:
        up.wait_ready(60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo-p0", max_retries=0)
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=4)
        assert done.usage.completion_tokens == 4
        up.ctrl_c()
        assert up.wait_exit(60) == 0, up.output
