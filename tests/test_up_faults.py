"""`qos up` when its private redis-server cannot start (what is left behind, what is said:
run in-process, nothing but Redis is started before the failure), its demo load (a config
without the demo keys, a Ctrl-C once the timed schedule is sent), the roles' own ports (a
stranger on the IPv6 side included), a child that SIGKILL does not end, and the data dirs a
killed `qos up` leaves."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from limiter.cli import main
from limiter.localstack.launcher import wait_for
from tests.support.redis_server import free_port


@pytest.fixture
def redis_on_a_taken_port(tmp_path, monkeypatch):
    """A PATH whose redis-server is the real one told to listen on a port somebody holds, as
    when the free port qos up picked is taken before redis-server binds it; and a TMPDIR of
    the test's own, to see what qos up leaves there."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = holder.getsockname()[1]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "redis-server"
    fake.write_text(f"#!/bin/sh\nexec {shutil.which('redis-server')} \"$@\" --port {taken}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    for var in ("QOS_CONFIG", "QOS_REDIS_URL", "QOS_REDIS_CLUSTER"):
        monkeypatch.delenv(var, raising=False)
    yield tmp, taken
    holder.close()


def test_a_redis_server_that_fails_to_start_leaves_no_temp_dir(redis_on_a_taken_port):
    tmp, _taken = redis_on_a_taken_port
    rc = main(["up", "--port", str(free_port()), "--workers", "1"])
    assert rc == 1
    # RedisServer.start raises without removing its mkdtemp'd --dir; run() never gets an object
    # to stop, so every failed start leaves a /tmp/qos-redis-* directory behind.
    assert [p.name for p in tmp.iterdir()] == []


def test_a_redis_server_that_fails_to_start_says_why(redis_on_a_taken_port, capsys):
    _tmp, taken = redis_on_a_taken_port
    rc = main(["up", "--port", str(free_port()), "--workers", "1"])
    assert rc == 1
    err = capsys.readouterr()
    out = err.out + err.err
    # All qos up says is "redis-server exited with 1": its output goes to /dev/null, so the
    # port conflict (or a bad flag, a full disk...) is never reported.
    assert "in use" in out or str(taken) in out, out


def _start_while_taken(server, port: int) -> None:
    """Start ``server`` while another socket listens on ``port`` (one it chose itself)."""
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", port))
        thief.listen(1)
        server.start()


def test_a_free_port_taken_before_the_server_binds_it_is_replaced_by_another():
    # free_port() only says a port was free a moment ago: another process (a second test
    # worker, anything on the host) may be handed it too. A server on a port it chose itself
    # starts on another; one whose port the caller named still fails (the test above).
    from limiter.localstack.redis_server import RedisServer

    server = RedisServer()
    taken = server.port
    _start_while_taken(server, taken)
    try:
        assert server.port != taken
        assert server.client().ping()
        assert "Address already in use" not in (server.dir / "redis.log").read_text(errors="replace")
    finally:
        server.stop()


def test_a_cluster_nodes_bus_port_taken_before_it_binds_is_replaced_too():
    # A cluster node binds two ports: a taken bus port (--cluster-port) fails its start the
    # same way, and the retry must pick a new bus port, not only a new port.
    from limiter.localstack.redis_server import RedisServer

    server = RedisServer(extra=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"],
                         cluster_bus=True)
    taken = server.bus_port
    _start_while_taken(server, taken)
    try:
        assert server.bus_port != taken
        assert server.client().ping()
        assert server.client().config_get("cluster-port")["cluster-port"] == str(server.bus_port)
    finally:
        server.stop()


# --- `qos up --demo-load` ------------------------------------------------------------------------

def _demo_keys_config(path, time_scale: float):
    """The demo's three keys and classes, with a slow simulated GPU (requests stay open)."""
    from limiter.config import hash_key
    from limiter.localstack.toml_writer import write_toml
    from tests.support.helpers import three_classes

    tenants = [{"name": f"demo-{c.lower()}", "key_sha256": [hash_key(f"demo-{c.lower()}")],
                "default_class": c, "max_class": c} for c in ("P0", "P1", "P2")]
    return write_toml({
        "redis": {"url": "redis://127.0.0.1:1/0"},
        "classes": three_classes(),
        "pools": [{"name": "tiny", "context_tokens": 16384, "lease_ms": 2000}],
        "tenants": tenants,
        "frontend": {"shutdown_grace_s": 2.0, "heartbeat_s": 0.5},
        "worker": {"time_scale": time_scale, "drain_timeout_s": 2.0, "heartbeat_s": 0.5},
    }, path)


def test_ctrl_c_at_the_end_of_a_timed_demo_load_is_not_ignored_for_30_s(tmp_path):
    # run_demo_load: once the schedule of --demo-duration is sent it waits up to 30 s for the
    # open streams (asyncio.wait(tasks, timeout=30)) without looking at should_stop(): a
    # Ctrl-C (or a dead frontend) in that window is not acted on until the 30 s are over.
    import urllib.request

    from limiter.localstack.demo_load import demo_arrivals, demo_loads
    from tests.support.up_stack import Up

    cfg = _demo_keys_config(tmp_path / "qos.toml", time_scale=200.0)
    port = free_port()
    scheduled = len(list(demo_arrivals(demo_loads("sim"), 2.0, 7)))  # what run_demo_load sends (seed 7)

    def sent_and_open() -> tuple[float, float] | None:
        """(requests the frontend finished, requests open) once every scheduled one came in
        and some are still open; else None."""
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()

        def total(name: str) -> float:
            return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(name + "{"))

        done, open_ = total("qos_frontend_requests_total"), total("qos_frontend_inflight")
        return (done, open_) if done + open_ >= scheduled and open_ > 0 else None

    with Up(port, "--config", str(cfg), "--engine", "sim", "--demo-load", "--demo-duration", "2") as up:
        up.wait_ready(180)
        # the 2 s schedule is sent (every request of it reached the frontend) and slow streams
        # are still open: the 30 s wait for them is under way
        done, open_ = wait_for(sent_and_open, 60, f"the {scheduled} scheduled requests sent, some still open")
        up.ctrl_c()
        sent = time.monotonic()
        # Within 15 s: the 30 s wait it was stuck in ended ~28 s after the Ctrl-C (waited for
        # up to 60 s, this test passed on that bug: found by a review)
        up.wait_line(r"^qos up: stopping", 15, "the stop to begin well before the 30 s wait ends")
        print(f"\n[demo stop] the stop began {time.monotonic() - sent:.1f} s after Ctrl-C "
              f"({done:g} of {scheduled} requests done, {open_:g} open)")


def test_demo_load_with_a_config_that_has_no_demo_keys_is_refused(tmp_path):
    # demo_loads() always sends with the keys demo-p0/p1/p2 and classes P0/P1/P2: with an
    # operator's own config every request is a 401 ("other" in the table) and qos up exits 0.
    from tests.support.up_stack import Up, write_config

    cfg = write_config(tmp_path / "qos.toml")
    port = free_port()
    with Up(port, "--config", str(cfg), "--engine", "sim", "--demo-load", "--demo-duration", "3") as up:
        rc = up.wait_exit(180)
        assert rc != 0 and "--demo-load" in up.output, f"rc={rc}\n{up.output[-3000:]}"


def test_a_failed_first_start_keeps_a_data_dir_the_caller_gave(tmp_path):
    """A first start that fails removes the temp dir RedisServer made, never a data dir the
    caller gave it."""
    from tests.support.redis_server import RedisServer

    data = tmp_path / "data"
    data.mkdir()
    (data / "appendonly.aof").write_text("keep me")
    with socket.socket() as taken:  # bound, not listening: redis-server cannot bind it
        taken.bind(("127.0.0.1", 0))
        server = RedisServer(dir=data, port=taken.getsockname()[1])
        with pytest.raises(RuntimeError):
            server.start(timeout_s=3)
    assert (data / "appendonly.aof").exists(), "the caller's data dir was deleted"


def test_start_on_a_port_another_redis_holds_fails(redis_server):
    """When another redis-server holds the port (taken since free_port() looked), its answer
    to a ping passed for ours: start returned as started while its own server had exited, and
    the caller used (the test fixtures FLUSHALL) somebody else's Redis."""
    from tests.support.redis_server import RedisServer

    server = RedisServer(port=redis_server.port)
    try:
        with pytest.raises(RuntimeError):
            server.start(timeout_s=3)
    finally:
        server.stop()


# --- the roles' own ports --------------------------------------------------------------------------

def _metrics_config(path, worker_port: int = 0, controller_port: int = 0, frontend_port: int = 0):
    from limiter.config import hash_key
    from limiter.localstack.toml_writer import write_toml
    from tests.support.helpers import three_classes

    return write_toml({
        "redis": {"url": "redis://127.0.0.1:1/0"},
        "classes": three_classes(),
        "pools": [{"name": "tiny", "context_tokens": 4096}],
        "tenants": [{"name": "user", "key_sha256": [hash_key("k")]}],
        "frontend": {"metrics_port": frontend_port},
        "worker": {"metrics_port": worker_port},
        "controller": {"metrics_port": controller_port},
    }, path)


@pytest.mark.parametrize("flags, section", [(["--workers", "2"], "worker"), (["--standby"], "controller"),
                                            (["--frontends", "2"], "frontend")])
def test_a_metrics_port_two_children_would_share_is_refused_before_anything_starts(
        redis_on_a_taken_port, tmp_path, capsys, flags, section):
    # worker.metrics_port with --workers 2: every worker of the stack listens on the same port,
    # so the second always failed -- after Redis, the frontends and the first worker had
    # started ("worker-1 exited with 2 while starting"). The same for --standby controllers.
    tmp, _taken = redis_on_a_taken_port
    cfg = _metrics_config(tmp_path / "qos.toml", **{f"{section}_port": free_port()})
    rc = main(["up", "--config", str(cfg), "--port", str(free_port()), "--ready-timeout", "60", *flags])
    out = capsys.readouterr()
    assert rc == 2, out
    assert f"{section}.metrics_port" in out.err, out
    assert [p.name for p in tmp.iterdir()] == [], "a redis-server was started"


def _listener(host: str) -> socket.socket:
    """A stranger listening on host:(a free port); on an IPv6 address for IPv6 only (its IPv4
    side is what the probe of the stack's own host sees). The port is one the other address
    family has free too: the test expects the stranger to be what is reported, and a port
    the OS hands out on one family may be held on the other (a cluster node of a test
    running beside this one held it on 127.0.0.1, and that holder was reported). Skips where
    this machine cannot."""
    ipv6 = ":" in host
    for _ in range(20):
        try:
            sock = socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:
            pytest.skip(f"no IPv6 on this machine: {exc}")
        try:
            if ipv6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, 0))
        except OSError as exc:
            sock.close()
            pytest.skip(f"cannot listen on {host} on this machine: {exc}")
        if _free_on_the_other_family(sock.getsockname()[1], ipv6):
            sock.listen(1)
            return sock
        sock.close()
    raise AssertionError(f"no port free on both address families in 20 tries (stranger {host})")


def _free_on_the_other_family(port: int, ipv6: bool) -> bool:
    """Can ``port`` be bound on every address of the family ``host`` is not of?"""
    try:
        probe = socket.socket(socket.AF_INET if ipv6 else socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        return True  # no IPv6 here: nothing there can hold it
    with probe:
        try:
            if not ipv6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(("0.0.0.0" if ipv6 else "::", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("stranger, seen_on", [("0.0.0.0", "0.0.0.0"), ("::1", "::")])
def test_a_taken_metrics_port_is_refused_before_anything_starts(redis_on_a_taken_port, tmp_path, capsys,
                                                                 stranger, seen_on):
    # [::1]: worker.metrics_host is 0.0.0.0 by default, which a listener on [::1]:PORT does
    # not conflict with, so it went unseen: a scraper of localhost:PORT reached the stranger.
    tmp, _taken = redis_on_a_taken_port
    with _listener(stranger) as holder:
        port = holder.getsockname()[1]
        cfg = _metrics_config(tmp_path / "qos.toml", worker_port=port)
        rc = main(["up", "--config", str(cfg), "--port", str(free_port()), "--ready-timeout", "60"])
    out = capsys.readouterr()
    assert rc == 2, out
    assert f"worker.metrics_port: port {port} on {seen_on} is already in use" in out.err, out
    assert f"held by pid {os.getpid()}" in out.err, out
    assert [p.name for p in tmp.iterdir()] == [], "a redis-server was started"


@pytest.mark.parametrize("stranger", ["::1", "::"])
def test_a_stranger_on_the_ipv6_side_of_the_http_port_is_refused(redis_on_a_taken_port, capsys, stranger):
    # The probe bound 127.0.0.1 (the default --host) only: a listener on [::1]:PORT, or on
    # [::]:PORT for IPv6 only, went unseen, and a client of http://localhost:PORT (localhost
    # resolving to ::1 first) reached the stranger instead of the stack.
    tmp, _taken = redis_on_a_taken_port
    with _listener(stranger) as holder:
        port = holder.getsockname()[1]
        rc = main(["up", "--port", str(port), "--workers", "1", "--ready-timeout", "60"])
    out = capsys.readouterr()
    assert rc == 2, out
    assert f"--port: port {port} on ::1 is already in use" in out.err, out
    assert f"held by pid {os.getpid()}" in out.err, out
    assert [p.name for p in tmp.iterdir()] == [], "a redis-server was started"


# --- stopping: a child SIGKILL does not end ------------------------------------------------------

def test_a_child_that_sigkill_does_not_end_is_reported_not_waited_for(monkeypatch, capsys):
    # kill_children sent SIGKILL and then waited for each child with no deadline: a process
    # stuck in the kernel (uninterruptible sleep: a hung GPU driver, a dead NFS mount) ends
    # only when that returns, and `qos up` hung with it after "stopping".
    from limiter import lifecycle
    from limiter.localstack.launcher import Child, Stack

    proc = subprocess.Popen(["sleep", "120"])
    proc.kill = lambda: None  # what SIGKILL does to a process in uninterruptible sleep: nothing yet
    monkeypatch.setattr(lifecycle, "REAP_TIMEOUT_S", 0.5)
    stack = Stack("redis://127.0.0.1:1/0", "http://127.0.0.1:1",
                  children=[Child("worker-0", "worker", ["sleep"], proc=proc)])
    done = threading.Event()
    t = threading.Thread(target=lambda: (stack.kill_children(), done.set()), daemon=True)
    t.start()
    try:
        assert done.wait(60), "kill_children still waits for a child SIGKILL did not end"
        err = capsys.readouterr().err
        assert f"worker-0 (pid {proc.pid})" in err, err
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        t.join(30)


# --- the private redis-server's data dir ---------------------------------------------------------

def test_a_data_dir_left_by_a_killed_qos_up_is_removed_at_the_next_start(tmp_path, monkeypatch):
    # SIGKILL gives qos up no chance to remove its /tmp/qos-redis-* dir: each one killed left
    # one behind, for good. The next start removes those whose owner is gone.
    from limiter.localstack.up import start_redis
    from tests.support.up_stack import Up, alive, write_config

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with Up(free_port(), "--config", str(write_config(tmp_path / "qos.toml")), "--engine", "sim",
            "--workers", "1", env={"TMPDIR": str(tmp)}) as up:
        up.wait_ready()
        (left,) = tmp.glob("qos-redis-*")
        up.proc.kill()  # no chance to clean anything up
        up.proc.wait()
    # (Up.close SIGKILLed what was left, redis-server among its children)
    wait_for(lambda: not any(alive(p) for p in up.known), 60, "every child of the killed qos up to exit")
    assert left.is_dir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    _url, server = start_redis(argparse.Namespace(redis_url=None))
    try:
        assert not left.exists(), "the killed qos up's data dir is still there"
        assert list(tmp.iterdir()) == [server.dir]
    finally:
        server.stop()


def test_a_start_on_an_external_redis_sweeps_too(tmp_path, monkeypatch):
    # The sweep ran only where qos up started its own redis-server: a user who switched to
    # --redis-url kept every dir the killed runs before had left.
    from limiter.localstack.up import start_redis

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    left, _ = _dir_of_a_process_that_died(tmp, start=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    url, server = start_redis(argparse.Namespace(redis_url="redis://127.0.0.1:1/0"))
    assert (url, server) == ("redis://127.0.0.1:1/0", None)
    assert not left.exists(), "a dead qos up's data dir survived a start with --redis-url"


def _dir_of_a_process_that_died(tmp: Path, start: bool) -> tuple[Path, int]:
    """A RedisServer made (and, if ``start``, started) by a process that then died without
    stopping it: (its data dir, the redis-server pid or 0)."""
    code = ("import os, tempfile, sys\n"
            f"tempfile.tempdir = {str(tmp)!r}\n"
            "from limiter.localstack.redis_server import RedisServer\n"
            "s = RedisServer()\n"
            f"if {start}: s.start()\n"
            "print(s.dir, s.proc.pid if s.proc else 0, flush=True)\n"
            "os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    d, pid = out.stdout.split()
    return Path(d), int(pid)


def test_the_sweep_removes_only_data_dirs_it_can_prove_abandoned(tmp_path, monkeypatch):
    from limiter.localstack.redis_server import RedisServer, remove_stale_dirs
    from tests.support.up_stack import alive

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    abandoned, _ = _dir_of_a_process_that_died(tmp, start=False)
    served, server_pid = _dir_of_a_process_that_died(tmp, start=True)  # its redis-server still runs
    unmarked = tmp / "qos-redis-unmarked"  # e.g. one an older qos up made: no owner recorded
    unmarked.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    live = RedisServer()  # this process's own: its owner is alive
    try:
        remove_stale_dirs(tmp)
        assert not abandoned.exists()
        assert served.exists(), "removed under a redis-server that still runs"
        assert unmarked.exists() and live.dir.exists()
        os.kill(server_pid, signal.SIGKILL)
        wait_for(lambda: not alive(server_pid), 30, "the orphaned redis-server to go")
        remove_stale_dirs(tmp)
        assert not served.exists()
        assert unmarked.exists() and live.dir.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server_pid, signal.SIGKILL)
        live.stop()



# --- a running stack's stop: the signals that come during it, what is said about a death ---

def _mid_stream_stack(tmp_path: Path):
    """A one-worker `qos up` whose grace and drain outlast the test, a long stream under way."""
    from tests.support.up_stack import Up, stream, write_config

    config = write_config(tmp_path / "qos.toml", time_scale=20.0, grace_s=120.0, drain_s=120.0)
    port = free_port()
    up = Up(port, "--config", str(config), "--engine", "sim", "--workers", "1")
    up.wait_ready()
    first = threading.Event()

    def run() -> None:
        with contextlib.suppress(Exception):  # the stream is cut on purpose
            stream(port, 2000, on_first=first.set)

    threading.Thread(target=run, daemon=True).start()
    assert first.wait(60), "the stream's first token did not arrive within 60 s"
    return up


def test_a_second_sighup_during_the_stop_does_not_kill_the_stack(tmp_path):
    # A closed terminal may send two SIGHUPs (the shell's to its jobs, the kernel's to the
    # foreground group). The first starts the stop; the second, arriving once the stop has
    # begun, was taken for a second Ctrl-C: every process killed at once, the open stream
    # cut, exit 129. Only SIGINT/SIGTERM escalate.
    old = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as from a terminal, even under nohup
    try:
        up = _mid_stream_stack(tmp_path)
    finally:
        signal.signal(signal.SIGHUP, old)
    with up:
        os.killpg(up.proc.pid, signal.SIGHUP)
        up.wait_line(r"stopping 1 frontends", 30, "the frontends' stop line")
        time.sleep(0.5)  # the stop is under way
        os.killpg(up.proc.pid, signal.SIGHUP)
        time.sleep(2.0)
        assert "interrupted again" not in up.output, up.output
        assert up.proc.poll() is None, up.output  # still finishing the stream within its grace
        up.ctrl_c()  # an operator's Ctrl-C still means "now"
        assert up.wait_exit(60) == 128 + signal.SIGINT, up.output
    assert "interrupted again" in up.output, up.output


def test_a_redis_that_dies_while_serving_says_why(tmp_path):
    # Its output goes to /dev/null and its log to its data dir, which the stop removes: all
    # an operator read was "redis-server exited with 0", the reason gone with the dir.
    from tests.support.up_stack import Up, children, write_config

    config = write_config(tmp_path / "qos.toml")
    with Up(free_port(), "--config", str(config), "--engine", "sim", "--workers", "1") as up:
        up.wait_ready()
        redis_pid = next(p for p, c in children(up.proc.pid).items() if c.startswith("redis-server"))
        os.kill(redis_pid, signal.SIGTERM)  # what an OOM killer's or an admin's stop looks like
        assert up.wait_exit(60) == 1, up.output
    line = up.line(r"^qos up: redis-server exited with 0")
    assert line is not None and "Received SIGTERM" in line, up.output


def test_the_demo_keys_on_a_public_host_are_refused_unless_allowed_and_the_flag_reaches_the_frontends(
        capsys) -> None:
    """The refusal named `--allow-demo-keys-public`, a flag `qos up` did not have (a newcomer's
    walk of the README): refused before anything starts without it; with it, the checks pass
    and every frontend `qos up` starts is given it."""
    from limiter.cli import build_parser
    from limiter.config import demo_config
    from limiter.localstack.launcher import build_commands
    from limiter.localstack.up import stop_limits

    assert main(["up", "--host", "0.0.0.0", "--port", str(free_port())]) == 2
    assert "--allow-demo-keys-public" in capsys.readouterr().err
    args = build_parser().parse_args(["up", "--host", "0.0.0.0", "--frontends", "2",
                                      "--allow-demo-keys-public"])
    args.config = None
    stop_limits(demo_config(), args)  # the frontends' settings are valid
    frontends = [c for c in build_commands(args) if c.role == "frontend"]
    assert len(frontends) == 2 and all("--allow-demo-keys-public" in c.argv for c in frontends)
