"""`qos up` process lifecycle, as an operator meets it: the terminal's Ctrl-C reaches `qos up`
alone and the stack stops in order (Redis last) in a few seconds; a second Ctrl-C kills at
once; no child outlives `qos up`; a taken port is refused before anything starts; a dead
worker is reported while the stack keeps serving, and `--restart` brings it back."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.redis_server import free_port
from tests.support.stalling_proxy import StallingProxy
from tests.support.up_stack import Up, alive, children, complete, stream, wait_for, write_config


@pytest.fixture(autouse=True)
def _hangup_as_a_terminal_leaves_it() -> Iterator[None]:
    """The processes these tests start get SIGHUP at its default, as from a terminal: a suite
    run under nohup (SIGHUP ignored, which children inherit) made every role keep ignoring it,
    as a nohup'd role must, and the SIGHUP tests failed (a loaded pass run with nohup). The
    nohup tests ignore it again themselves."""
    old = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, old)


def _role_pids(up: Up) -> dict[str, int]:
    """'redis' / 'frontend' / 'controller' / 'worker-N' -> pid, from qos up's children."""
    out = {}
    for pid, cmd in children(up.proc.pid).items():
        if cmd.startswith("redis-server"):
            out["redis"] = pid
        elif " frontend " in cmd:
            out[f"frontend-{len([k for k in out if k.startswith('frontend')])}"] = pid
        elif " controller " in cmd:
            out["controller"] = pid
        elif " worker " in cmd:
            out[cmd.split("--worker-id ")[1].split()[0]] = pid
    return out


def _wait_for_both_frontends(up: Up) -> None:
    """Both frontends serve the port: each inherited the stack's one listening socket."""
    seen: set[str] = set()

    def both_frontends_answered() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{up.port}/healthz", timeout=10) as r:
            seen.add(json.loads(r.read())["frontend"])
        return len(seen) == 2
    wait_for(both_frontends_answered, 30, "both frontends to answer /healthz")


def _order(up: Up, *patterns: str) -> list[int]:
    idx = []
    for p in patterns:
        line = up.line(p)
        assert line is not None, f"no line matching {p!r}:\n{up.output}"
        idx.append(up.lines.index(line))
    return idx


def test_terminal_ctrl_c_reaches_qos_up_alone_and_the_stack_stops_in_order(tmp_path):
    config = write_config(tmp_path / "qos.toml", time_scale=3.0)  # ~35 ms per token
    port = free_port()
    with Up(port, "--config", str(config), "--engine", "sim", "--workers", "2") as up:
        up.wait_ready()
        pids = _role_pids(up)
        assert {"redis", "frontend-0", "controller", "up-worker-0", "up-worker-1"} <= set(pids), pids
        for role, pid in pids.items():  # a session each: the terminal's SIGINT reaches none of them
            assert os.getsid(pid) == pid, f"{role} shares a session with qos up"

        # A stream in flight when Ctrl-C comes finishes: the frontend stops first and waits
        # for it while the workers and Redis still run.
        result: dict[str, object] = {}
        first = threading.Event()

        def client() -> None:
            try:
                result["sse"], result["usage"] = stream(port, 80, on_first=first.set)
            except Exception as exc:  # reported below
                result["error"] = exc

        t = threading.Thread(target=client)
        t.start()
        assert first.wait(60), "the stream's first token did not arrive within 60 s"
        t0 = time.monotonic()
        up.ctrl_c()
        t.join(60)
        assert not t.is_alive(), "the stream did not end within 60 s of Ctrl-C"
        assert "error" not in result, result.get("error")
        assert str(result["sse"]).rstrip().endswith("data: [DONE]")
        assert result["usage"]["completion_tokens"] == 80
        assert up.wait_exit(60) == 0, up.output
        print(f"\n[Ctrl-C mid-stream] stream finished, stack stopped {time.monotonic() - t0:.1f} s later")
    fe, wk, ct, rd, done = _order(up, r"stopping 1 frontends", r"stopping 2 workers",
                                  r"stopping 1 controllers", r"stopping redis", r"^qos up: stopped")
    assert fe < wk < ct < rd < done, up.output
    # Redis went last: nobody lost it while stopping.
    assert "Redis unavailable" not in up.output and "retrying" not in up.output, up.output
    assert [r for r, p in pids.items() if alive(p)] == []


def test_an_idle_stack_stops_without_waiting_out_any_grace(tmp_path):
    # Grace and drain of two minutes: an idle stack that stops well inside them waited for
    # nothing. How fast it stops is a figure (printed), not an assertion about this machine.
    config = write_config(tmp_path / "qos.toml", grace_s=120.0, drain_s=120.0)
    with Up(free_port(), "--config", str(config), "--engine", "sim", "--workers", "2",
            "--frontends", "2") as up:
        up.wait_ready()
        pids = _role_pids(up)
        _wait_for_both_frontends(up)
        t0 = time.monotonic()
        up.ctrl_c()
        assert up.wait_exit(90) == 0, up.output
        took = time.monotonic() - t0
    print(f"\n[idle stop] 2 frontends, 2 workers, controller, redis: stopped in {took:.1f} s")
    assert [r for r, p in pids.items() if alive(p)] == []


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    # A stream that would take minutes, and a frontend grace longer than the test: only the
    # second Ctrl-C can end this stop quickly.
    with _up_mid_stream(tmp_path) as (up, pids):
        up.ctrl_c()
        up.wait_line(r"stopping 1 frontends", 30, "the frontends' stop line")
        time.sleep(0.5)  # it is draining, not dead: the first Ctrl-C alone would take minutes
        assert up.proc.poll() is None, up.output
        t0 = time.monotonic()
        up.ctrl_c()
        # The grace and the drain are 120 s: exiting well inside them is the second Ctrl-C's doing.
        rc = up.wait_exit(90, "qos up to exit after the second Ctrl-C")
        print(f"\n[second Ctrl-C] exited {time.monotonic() - t0:.1f} s later")
    assert "interrupted again" in up.output
    # Killed, not stopped cleanly: the shell's status for SIGINT (it exited 0, as a clean stop).
    assert rc == 128 + signal.SIGINT, up.output
    assert [r for r, p in pids.items() if alive(p)] == []


def test_two_quick_ctrl_c_stop_at_once(tmp_path):
    # An impatient operator presses Ctrl-C twice in a row: both arrive before qos up's next
    # look (it polls every 0.2 s). The second must still mean "now", not be taken for part
    # of the first and leave the 120 s grace and drain to run. (The second is a SIGTERM, which
    # does what Ctrl-C does: two SIGINTs sent back to back may be merged into one by the
    # kernel; two different signals never are, so both surely arrive before the next look.)
    with _up_mid_stream(tmp_path) as (up, pids):
        t0 = time.monotonic()
        up.ctrl_c()
        os.killpg(up.proc.pid, signal.SIGTERM)
        rc = up.wait_exit(60, "qos up to exit after two quick Ctrl-Cs")
        print(f"\n[two quick Ctrl-Cs] exited {time.monotonic() - t0:.1f} s later")
    assert "interrupted again" in up.output, up.output
    assert rc == 128 + signal.SIGTERM, up.output  # the signal that forced the kill
    assert [r for r, p in pids.items() if alive(p)] == []


@contextlib.contextmanager
def _up_mid_stream(tmp_path: Path) -> Iterator[tuple[Up, dict[str, int]]]:
    """A one-worker `qos up` whose frontend grace and worker drain outlast the test, with a
    stream that would take minutes under way: (the stack, its role pids)."""
    config = write_config(tmp_path / "qos.toml", time_scale=20.0, grace_s=120.0, drain_s=120.0)
    port = free_port()
    with Up(port, "--config", str(config), "--engine", "sim", "--workers", "1") as up:
        up.wait_ready()
        pids = _role_pids(up)
        first = threading.Event()
        threading.Thread(target=lambda: _swallow(lambda: stream(port, 2000, on_first=first.set)),
                         daemon=True).start()
        assert first.wait(60), "the stream's first token did not arrive within 60 s"
        yield up, pids


def _swallow(fn) -> None:
    try:
        fn()
    except Exception:  # the stream is cut on purpose
        pass


def test_no_child_outlives_a_killed_qos_up_even_mid_stream(tmp_path):
    # Grace and drain far longer than the test: the children must see that the stack is
    # gone (Redis went with qos up) instead of waiting them out.
    with _up_mid_stream(tmp_path) as (up, pids):
        assert len(pids) == 4, pids
        up.proc.kill()  # no chance to stop anything itself
        up.proc.wait()
        t0 = time.monotonic()
        try:
            # 90 s is inside the 120 s grace and drain: the children noticed, not timed out.
            wait_for(lambda: not any(alive(p) for p in pids.values()), 90,
                     "every child of the killed qos up to exit")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; left: { {r: p for r, p in pids.items() if alive(p)} }") from None
        took = time.monotonic() - t0
    print(f"\n[parent killed] every child gone {took:.1f} s after qos up")


def test_a_taken_port_is_refused_before_anything_starts(tmp_path):
    # What an orphaned frontend of an earlier stack looks like: a SO_REUSEPORT listener.
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen(8)
    port = holder.getsockname()[1]
    try:
        with Up(port, "--config", str(write_config(tmp_path / "qos.toml")), "--engine", "sim",
                "--workers", "1", "--frontends", "2") as up:
            rc = up.wait_exit(60, "qos up to refuse the port")
            spawned = [line for line in up.lines if "ready at" in line or "stopping" in line]
    finally:
        holder.close()
    assert rc == 2, up.output
    assert f"port {port} on 127.0.0.1 is already in use" in up.output, up.output
    assert f"held by pid {os.getpid()}" in up.output, up.output
    assert spawned == [], up.output  # nothing was started, so nothing had to be stopped


def test_a_stranger_cannot_bind_the_port_beside_a_running_stack(tmp_path):
    # Two frontends share the port, yet a later SO_REUSEPORT listener of the same user (a
    # standalone `qos frontend --reuse-port`, another stack's orphan) is refused: with one
    # socket per frontend in a SO_REUSEPORT group the kernel let it in, and it took a share
    # of the stack's connections without a word.
    with Up(free_port(), "--config", str(write_config(tmp_path / "qos.toml")), "--engine", "sim",
            "--workers", "1", "--frontends", "2") as up:
        up.wait_ready()
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0")):
            with socket.socket(family, socket.SOCK_STREAM) as stranger:
                stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                with pytest.raises(OSError) as refused:
                    stranger.bind((host, up.port))
                    stranger.listen(8)
                assert refused.value.errno == errno.EADDRINUSE, (host, refused.value)
        _wait_for_both_frontends(up)
        up.ctrl_c()
        assert up.wait_exit(90) == 0, up.output


def test_a_dead_worker_is_reported_and_the_stack_keeps_serving(tmp_path):
    config = write_config(tmp_path / "qos.toml", time_scale=3.0, lease_ms=2000)
    port = free_port()
    with Up(port, "--config", str(config), "--engine", "sim", "--workers", "2") as up:
        up.wait_ready()
        pids = _role_pids(up)
        r = redis.Redis.from_url(up.redis_url)
        results: list[tuple[str, dict | None] | Exception] = []
        started = threading.Barrier(5)

        def client() -> None:
            try:
                results.append(stream(port, 150, on_first=lambda: started.wait(60)))
            except Exception as exc:
                results.append(exc)

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        started.wait(60)  # every stream has its first token

        def busy_worker() -> str | None:
            for w in ("up-worker-0", "up-worker-1"):
                if int(r.hget(f"qos:{{tiny}}:worker:{w}", "held") or 0) > 0:
                    return w
            return None
        victim = wait_for(busy_worker, 20, "a worker's heartbeat to show it holds requests")
        os.kill(pids[victim], signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "streams still open 120 s after the kill"
        # Nothing lost: every stream finished whole, the dead worker's resumed by the other.
        assert all(not isinstance(x, Exception) for x in results), results
        broken = [sse[-300:] for sse, _ in results if not sse.rstrip().endswith("data: [DONE]")]
        assert broken == [], f"streams broken by the worker's death: {broken}"
        assert [u["completion_tokens"] for _, u in results] == [150] * 4
        idx = int(victim.rsplit("-", 1)[1])
        up.wait_line(rf"WORKER worker-{idx} \(pid {pids[victim]}\) DIED with exit status -9", 10,
                     "the loud report of the dead worker")
        assert up.proc.poll() is None, up.output  # still serving
        assert complete(port, "still there?", 4)["usage"]["completion_tokens"] == 4

        # The last worker of the pool gone: the stack stops on its own, non-zero.
        other = "up-worker-1" if victim == "up-worker-0" else "up-worker-0"
        os.kill(pids[other], signal.SIGKILL)
        assert up.wait_exit(60, "qos up to stop once no worker is left") == 1
        r.close()
    assert "no worker is left in the pool; stopping the stack" in up.output
    assert [role for role, p in pids.items() if alive(p)] == []


def _controller_pids(up: Up) -> dict[str, int]:
    """Controller id ('up-controller-a', ...) -> pid, from qos up's children."""
    return {cmd.split("--id ")[1].split()[0]: pid for pid, cmd in children(up.proc.pid).items()
            if " controller " in cmd}


def test_a_dead_leading_controller_leaves_the_standby_leading_and_the_stack_serving(tmp_path):
    """With --standby, the leading controller's kill -9 is reported and the standby takes the
    lease while the stack keeps serving (a stream open across the kill ends whole); only the
    last controller's death stops the stack. Before, any controller's death stopped the whole
    stack, so the standby could never take over."""
    config = write_config(tmp_path / "qos.toml", time_scale=3.0)
    port = free_port()
    with Up(port, "--config", str(config), "--engine", "sim", "--workers", "1", "--standby") as up:
        up.wait_ready()
        ctl = _controller_pids(up)
        assert len(ctl) == 2, ctl
        r = redis.Redis.from_url(up.redis_url)

        def leader() -> str | None:
            raw = r.get("qos:{tiny}:leader")
            return raw.decode().split(".")[0] if raw else None
        first = wait_for(leader, 30, "a controller to lead")
        standby = next(c for c in ctl if c != first)
        results: list[tuple[str, dict | None] | Exception] = []
        started = threading.Event()

        def client() -> None:
            try:
                results.append(stream(port, 120, on_first=started.set))
            except Exception as exc:
                results.append(exc)
        t = threading.Thread(target=client)
        t.start()
        assert started.wait(60), "no first token"
        os.kill(ctl[first], signal.SIGKILL)
        up.wait_line(rf"CONTROLLER {first} \(pid {ctl[first]}\) exited with -9", 10,
                     "the report of the dead controller")
        wait_for(lambda: leader() == standby, 30, "the standby to take the lease")
        t.join(120)
        assert not t.is_alive(), "the stream still open 120 s after the kill"
        assert up.proc.poll() is None, up.output  # still serving
        assert not isinstance(results[0], Exception), results
        sse, usage = results[0]
        assert sse.rstrip().endswith("data: [DONE]") and usage["completion_tokens"] == 120, sse[-300:]
        assert complete(port, "still there?", 4)["usage"]["completion_tokens"] == 4

        # The last controller gone: the stack stops on its own, non-zero.
        os.kill(ctl[standby], signal.SIGKILL)
        assert up.wait_exit(60, "qos up to stop once no controller is left") == 1
        r.close()
    last = f"{standby} (pid {ctl[standby]}) exited with -9 (nothing is restarted silently); stopping"
    assert last in up.output, up.output


def test_restart_brings_a_dead_worker_back(tmp_path):
    config = write_config(tmp_path / "qos.toml")
    port = free_port()
    with Up(port, "--config", str(config), "--engine", "sim", "--workers", "1", "--restart") as up:
        up.wait_ready()
        r = redis.Redis.from_url(up.redis_url)
        os.kill(_role_pids(up)["up-worker-0"], signal.SIGKILL)
        up.wait_line(r"WORKER worker-0 .* DIED", 10, "the report of the dead worker")
        up.wait_line(r"restarting worker-0 in 1 s", 10, "the restart notice")
        up.wait_line(r"worker-0 restarted \(pid \d+, restart 1\)", 30, "the restart")
        wait_for(lambda: r.zscore("qos:{tiny}:workers", "up-worker-0-r1") is not None, 60,
                 "a heartbeat of the restarted worker up-worker-0-r1")
        assert complete(port, "back?", 4)["usage"]["completion_tokens"] == 4
        assert up.proc.poll() is None, up.output
        up.ctrl_c()
        assert up.wait_exit(30) == 0, up.output
        r.close()


def _workers_that_die_at_start(tmp_path: Path, which: bytes) -> dict[str, str]:
    """The env of a `qos up` whose worker processes started with worker id ``which`` (b"": every
    worker) exit 3 at once, before the ready line: a worker whose engine fails to load, say. A
    sitecustomize on PYTHONPATH does it in the child, whatever the machine's speed."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "argv = open('/proc/self/cmdline', 'rb').read().split(b'\\0')\n"
        "if b'worker' in argv and b'--worker-id' in argv:\n"
        f"    if {which!r} in (b'', argv[argv.index(b'--worker-id') + 1]):\n"
        "        os._exit(3)\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH", "")]))}


def test_restart_brings_back_a_worker_that_dies_while_the_stack_starts(tmp_path):
    # Only a death after the ready line was restarted: one before it (an engine that failed
    # to load the first time) stopped the whole stack, --restart or not.
    config = write_config(tmp_path / "qos.toml")
    port = free_port()
    with Up(port, "--config", str(config), "--engine", "sim", "--workers", "1", "--restart",
            env=_workers_that_die_at_start(tmp_path, b"up-worker-0")) as up:
        up.wait_ready()
        died, again, restarted, ready = _order(
            up, r"WORKER worker-0 \(pid \d+\) DIED with exit status 3", r"restarting worker-0 in 1 s",
            r"worker-0 restarted \(pid \d+, restart 1\)", r"^qos up: ready at")
        assert died < again < restarted < ready, up.output
        assert complete(port, "back?", 4)["usage"]["completion_tokens"] == 4
        up.ctrl_c()
        assert up.wait_exit(30) == 0, up.output


def test_restart_gives_up_on_a_worker_that_always_dies_while_the_stack_starts(tmp_path):
    # The same back-off as once serving (1+2+4+8+16 s), then the start fails: not a wait for
    # the whole --ready-timeout, nor restarts for ever.
    config = write_config(tmp_path / "qos.toml")
    with Up(free_port(), "--config", str(config), "--engine", "sim", "--workers", "1", "--restart",
            "--ready-timeout", "600", env=_workers_that_die_at_start(tmp_path, b"")) as up:
        assert up.wait_exit(240, "qos up to give up on the worker") == 1
    assert up.line(r"worker-0 restarted \(pid \d+, restart 5\)") is not None, up.output
    assert up.line(r"worker-0 died 6 times in a row; not restarting it again") is not None, up.output
    assert up.line(r"^qos up: no worker is left in the pool.*while starting") is not None, up.output
    assert up.line(r"ready at") is None, up.output


def test_a_worker_that_dies_while_the_stack_starts_stops_it_without_restart(tmp_path):
    config = write_config(tmp_path / "qos.toml")
    with Up(free_port(), "--config", str(config), "--engine", "sim", "--workers", "1",
            env=_workers_that_die_at_start(tmp_path, b"")) as up:
        assert up.wait_exit(120, "qos up to fail its start") == 1
    # The role, its pid and exit status, and what would have kept the stack going.
    assert up.line(r"^qos up: worker-0 \(pid \d+\) exited with status 3 while starting.*--restart") \
        is not None, up.output
    assert up.line(r"^qos up: stopped") is not None, up.output


def test_a_worker_drained_on_purpose_is_not_reported_dead_nor_restarted(tmp_path):
    """A SIGTERM an operator sends one worker drains it, and it exits 0: that was reported as
    "!!! WORKER ... DIED with exit status 0" and, with --restart, undone."""
    config = write_config(tmp_path / "qos.toml")
    port = free_port()
    with Up(port, "--config", str(config), "--engine", "sim", "--workers", "2", "--restart") as up:
        up.wait_ready()
        os.kill(_role_pids(up)["up-worker-0"], signal.SIGTERM)
        up.wait_line(r"worker-0 \(pid \d+\) drained and stopped \(exit status 0\).*not restarted", 30,
                     "the report of the drained worker")
        assert complete(port, "still serving?", 4)["usage"]["completion_tokens"] == 4
        assert "DIED" not in up.output and "restarting worker-0" not in up.output, up.output
        up.ctrl_c()
        assert up.wait_exit(30) == 0, up.output


def test_a_role_killed_past_its_stop_limit_makes_qos_up_exit_1(tmp_path):
    """A role that does not stop within its limit (here the controller, frozen by SIGSTOP:
    5 s, then 10 s more) is SIGKILLed and named; `qos up` exited 0 after it, as after a
    clean stop, so a script or a service manager read success (a review)."""
    config = write_config(tmp_path / "qos.toml")
    port = free_port()
    with Up(port, "--config", str(config), "--engine", "sim") as up:
        up.wait_ready()
        os.kill(_role_pids(up)["controller"], signal.SIGSTOP)
        up.ctrl_c()
        assert up.wait_exit(60) == 1, up.output
        assert up.line(r"controller.* did not stop in time; killing"), up.output
        assert up.line(r"exit status 1: .*controller.* had to be killed"), up.output


@pytest.mark.parametrize("role", ["frontend", "worker", "controller"])
def test_sighup_stops_a_standalone_role_like_sigterm(tmp_path, redis_server, role):
    """A closed terminal (SIGHUP) stops each role cleanly: exit 0, gone from the heartbeat set."""
    redis_server.client().flushall()
    config = write_config(tmp_path / "qos.toml")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("QOS_")},
           "QOS_REDIS_URL": redis_server.url, "OMP_NUM_THREADS": "1"}
    port = free_port()
    argv = {"frontend": ["frontend", "--port", str(port)], "worker": ["worker", "--engine", "sim",
            "--worker-id", "w-hup"], "controller": ["controller", "--id", "c-hup"]}[role]
    proc = subprocess_popen([sys.executable, "-m", "limiter.cli", *argv, "--config", str(config),
                             "--log-level", "INFO"], env)
    r = redis_server.client()
    try:
        if role == "frontend":
            wait_for(lambda: r.zcard("qos:{tiny}:frontends") == 1, 60, "the frontend's first heartbeat")
        elif role == "worker":
            wait_for(lambda: r.zscore("qos:{tiny}:workers", "w-hup") is not None, 60,
                     "the worker's first heartbeat")
        else:
            wait_for(lambda: r.get("qos:{tiny}:leader") is not None, 60, "the controller to take the lease")
        proc.send_signal(signal.SIGHUP)
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = proc.stdout.read().decode()
    assert rc == 0, out
    if role == "frontend":
        assert r.zcard("qos:{tiny}:frontends") == 0, out
    elif role == "worker":
        assert "SIGHUP: draining" in out
        assert r.zscore("qos:{tiny}:workers", "w-hup") is None, out
    else:
        assert "releasing leadership" in out and r.get("qos:{tiny}:leader") is None, out


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_a_stop_signal_while_the_frontend_starts_waits_for_the_startup_then_cleans_up(
        tmp_path, redis_server, sig):
    """A SIGHUP landing after the frontend's first heartbeat but before its startup was done
    raised aiohttp's GracefulExit inside the startup: the startup was cancelled halfway, the
    cleanup skipped, and the process hung past the test's 30 s (loaded pass 18, in
    test_sighup_stops_a_standalone_role_like_sigterm). Here the first heartbeat's reply is
    held back, so the signal lands exactly there."""
    redis_server.client().flushall()
    config = write_config(tmp_path / "qos.toml")
    r = redis_server.client()
    with StallingProxy(redis_server.port) as proxy:
        proxy.hold_replies_after(b"$4\r\nZADD\r\n")  # the heartbeat's ZADD (scripts say 'ZADD')
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("QOS_")},
               "QOS_REDIS_URL": proxy.url, "OMP_NUM_THREADS": "1"}
        proc = subprocess_popen([sys.executable, "-m", "limiter.cli", "frontend", "--port", str(free_port()),
                                 "--config", str(config), "--log-level", "INFO"], env)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(x.decode() for x in proc.stdout), daemon=True)
        reader.start()
        try:
            wait_for(lambda: r.zcard("qos:{tiny}:frontends") == 1, 60,
                     "the first heartbeat to reach Redis (its reply held back)")
            proc.send_signal(sig)
            wait_for(lambda: proc.poll() is not None or any(f"{sig.name}: stopping" in x for x in lines),
                     30, f"the frontend to log the {sig.name} (or exit)")
            proxy.release()
            rc = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            reader.join(5)
    out = "".join(lines)
    assert rc == 0, out
    assert r.zcard("qos:{tiny}:frontends") == 0, out  # it left, as a clean stop does
    assert "listening on" not in out, out  # stopped before it ever listened


@contextlib.contextmanager
def _nohup() -> Iterator[None]:
    """What `nohup` does: a process started inside ignores SIGHUP from the start (an ignored
    signal stays ignored across fork and exec)."""
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, old)


def _ignores_sighup(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGHUP - 1) & 1)
    raise AssertionError(f"no SigIgn line for pid {pid}")


def test_qos_up_under_nohup_is_not_stopped_by_a_hangup(tmp_path):
    # `nohup qos up &`, then the terminal closes: the operator asked for SIGHUP to be
    # ignored. qos up installed its own SIGHUP handler over nohup's SIG_IGN and stopped the
    # whole stack when the shell sent its jobs SIGHUP.
    config = write_config(tmp_path / "qos.toml")
    port = free_port()
    with _nohup():
        up = Up(port, "--config", str(config), "--engine", "sim", "--workers", "1")
    with up:
        up.wait_ready()
        assert _ignores_sighup(up.proc.pid), "qos up took SIGHUP back from nohup"
        os.killpg(up.proc.pid, signal.SIGHUP)  # the terminal goes away
        assert complete(port, "still there?", 4)["usage"]["completion_tokens"] == 4
        assert up.proc.poll() is None and up.line(r"stopping") is None, up.output
        up.ctrl_c()
        assert up.wait_exit(30) == 0, up.output


@pytest.mark.parametrize("role", ["frontend", "worker", "controller"])
def test_a_standalone_role_under_nohup_keeps_ignoring_sighup(tmp_path, redis_server, role):
    """`nohup qos worker &`: each role took SIGHUP like SIGTERM even when started with SIGHUP
    ignored, so the shell's SIGHUP to its jobs on logout stopped a nohup'd role."""
    redis_server.client().flushall()
    config = write_config(tmp_path / "qos.toml")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("QOS_")},
           "QOS_REDIS_URL": redis_server.url, "OMP_NUM_THREADS": "1"}
    argv = {"frontend": ["frontend", "--port", str(free_port())], "worker": ["worker", "--engine", "sim",
            "--worker-id", "w-nohup"], "controller": ["controller", "--id", "c-nohup"]}[role]
    with _nohup():
        proc = subprocess_popen([sys.executable, "-m", "limiter.cli", *argv, "--config", str(config)], env)
    r = redis_server.client()
    try:
        # each installs its signal handlers before its first heartbeat (the lease, for a controller)
        if role == "frontend":
            wait_for(lambda: r.zcard("qos:{tiny}:frontends") == 1, 60, "the frontend's first heartbeat")
        elif role == "worker":
            wait_for(lambda: r.zscore("qos:{tiny}:workers", "w-nohup") is not None, 60,
                     "the worker's first heartbeat")
        else:
            wait_for(lambda: r.get("qos:{tiny}:leader") is not None, 60, "the controller to take the lease")
        assert _ignores_sighup(proc.pid), f"{role} took SIGHUP back from nohup"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, proc.stdout.read().decode()


def subprocess_popen(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parent.parent)


def test_a_stack_that_is_not_ready_says_what_it_waits_for(tmp_path):
    config = write_config(tmp_path / "qos.toml")
    # 50 ms: no child can even have imported its modules by then, on any machine.
    with Up(free_port(), "--config", str(config), "--engine", "sim", "--workers", "1",
            "--ready-timeout", "0.05") as up:
        assert up.wait_exit(60, "qos up to give up starting") == 1
    line = up.line(r"not ready within 0.05 s: ")
    assert line is not None, up.output
    assert "/readyz" in line or "no heartbeat yet from up-worker-0" in line, line
    assert up.line(r"^qos up: stopped") is not None, up.output


def test_a_frontend_refuses_a_listen_fd_that_is_not_a_socket():
    env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
    out = subprocess.run([sys.executable, "-m", "limiter.cli", "frontend", "--listen-fd", "0"], env=env,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 2, out.stderr
    assert "--listen-fd: 0 is not an open socket" in out.stderr, out.stderr


@pytest.mark.parametrize("fd", ["-1", "99999999999999999999"])
def test_a_frontend_refuses_a_negative_or_huge_listen_fd_without_a_traceback(fd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
    out = subprocess.run([sys.executable, "-m", "limiter.cli", "frontend", "--listen-fd", fd], env=env,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert f"--listen-fd: {fd} is not an open socket" in out.stderr, out.stderr


def test_a_closed_terminal_sighup_stops_qos_up_like_ctrl_c(tmp_path):
    config = write_config(tmp_path / "qos.toml")
    with Up(free_port(), "--config", str(config), "--engine", "sim", "--workers", "1") as up:
        up.wait_ready()
        pids = _role_pids(up)
        os.killpg(up.proc.pid, signal.SIGHUP)  # what the terminal does when it goes away
        assert up.wait_exit(30) == 0, up.output
    fe, wk, rd = _order(up, r"stopping 1 frontends", r"stopping 1 workers", r"stopping redis")
    assert fe < wk < rd, up.output
    assert [r for r, p in pids.items() if alive(p)] == []


def test_qos_up_runs_against_a_redis_with_the_documented_acl_user(tmp_path):
    """`qos up --redis-url` as an operator with the least-privilege user of docs/reliability.md:
    ready, serving, stopped cleanly, and not one command refused (its own readiness check,
    the pruning and the reply-stream TTL included)."""
    from tests.support.redis_server import RedisServer
    from tests.test_security_redis import ADMIN, PASSWORD, create_acl_user

    server = RedisServer().start()
    try:
        create_acl_user(server.client())
        admin = redis.Redis(port=server.port, username=ADMIN[0], password=ADMIN[1])
        url = f"redis://qos:{PASSWORD}@127.0.0.1:{server.port}/0"
        port = free_port()
        with Up(port, "--config", str(write_config(tmp_path / "qos.toml")), "--engine", "sim",
                "--workers", "1", "--redis-url", url) as up:
            up.wait_ready()
            assert complete(port, "acl", 4)["usage"]["completion_tokens"] == 4
            up.ctrl_c()
            assert up.wait_exit(30) == 0, up.output
        assert admin.execute_command("ACL", "LOG") == [], up.output
        assert "NOPERM" not in up.output, up.output
        # A wrong password is refused with a clear line, before any child starts.
        bad = url.replace(PASSWORD, "wrong")
        with Up(free_port(), "--config", str(tmp_path / "qos.toml"), "--redis-url", bad) as up:
            assert up.wait_exit(60, "qos up to refuse the password") == 1
        assert "qos up: Redis refused: AuthenticationError" in up.output, up.output
        assert "Traceback" not in up.output and "stopping 1 frontends" not in up.output, up.output
        admin.close()
    finally:
        server.stop()
