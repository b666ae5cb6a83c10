"""Process lifecycle helpers for ``qos up``: children bound to their parent, ports checked
before anything starts, and who holds a port when it is taken.

* :func:`bind_to_parent` returns a ``preexec_fn`` that asks Linux to send the child a
  signal when its parent dies (``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``), so no
  child of ``qos up`` outlives it with ppid 1. It runs in the child between fork and exec
  and exits at once if the parent is already gone (the race prctl alone leaves open).
  A standalone ``qos frontend``/``worker``/``controller`` is started without it and is
  unaffected.
* :func:`kill_and_reap` SIGKILLs processes and reaps them within a deadline: one that
  SIGKILL does not end (stuck in the kernel) is named, not waited for.
* :func:`listen_socket` binds the HTTP port in ``qos up`` itself, before any child starts:
  a taken port is refused with a message naming it (and, where /proc tells, the process
  holding it), and the frontends of the stack inherit their sockets, so SO_REUSEPORT never
  lets a stranger's listener (an orphaned frontend of another stack) share the port.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from limiter.errors import ConfigError

PR_SET_PDEATHSIG = 1
# Seconds processes SIGKILLed together get to be reaped. Normally it takes milliseconds, a
# CUDA worker's teardown seconds; one in uninterruptible sleep (a hung GPU driver, a dead NFS
# mount) ends only when that returns, which may be never: no stop may wait for it.
REAP_TIMEOUT_S = 15.0


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return libc.prctl


_PRCTL = _prctl()


def parent_death_supported() -> bool:
    return _PRCTL is not None


def bind_to_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process dies.

    Returns None where Linux' parent-death signal is not available (the caller then has no
    guarantee; ``qos up`` says so)."""
    if _PRCTL is None:
        return None
    parent = os.getpid()
    prctl = _PRCTL

    def preexec() -> None:  # runs in the child, after fork, before exec
        if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:  # the parent died before prctl: do not start at all
            os._exit(1)

    return preexec


def hangup_ignored() -> bool:
    """True when this process was started with SIGHUP ignored (``nohup``): the operator asked
    that a closed terminal not stop it, so no SIGHUP handler may take that back."""
    return signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def kill_and_reap(procs: Mapping[str, subprocess.Popen], timeout_s: float | None = None) -> list[str]:
    """SIGKILL each of ``procs`` (name -> process) that still runs, then reap them all within
    one deadline (``REAP_TIMEOUT_S`` unless given): '<name> (pid N)' for each one still not
    reaped, left behind rather than waited for."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + (REAP_TIMEOUT_S if timeout_s is None else timeout_s)
    left = []
    for name, proc in procs.items():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            left.append(f"{name} (pid {proc.pid})")
    return left


# --- ports ---------------------------------------------------------------------------------

def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port`` (any address), from /proc/net/tcp{,6}."""
    inodes: set[str] = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10 or parts[3] != "0A":  # 0A: LISTEN
                continue
            if int(parts[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(parts[9])
    return inodes


def port_holders(port: int) -> list[str]:
    """'pid N (command line)' for each process this user can see listening on ``port``."""
    inodes = _listening_inodes(port)
    if not inodes:
        return []
    wanted = {f"socket:[{i}]" for i in inodes}
    found: list[str] = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            fds = list((pid_dir / "fd").iterdir())
        except OSError:
            continue  # another user's process, or gone
        for fd in fds:
            try:
                if os.readlink(fd) in wanted:
                    cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    found.append(f"pid {pid_dir.name} ({cmd.strip()[:120]})")
                    break
            except OSError:
                continue
    return found


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_port_free(host: str, port: int, name: str = "--port") -> None:
    """Raise ConfigError naming ``port`` (and its holder) if anyone listens on it.

    The probe binds without SO_REUSEPORT (so a reuse-port listener counts as taken) and with
    SO_REUSEADDR (so connections of a previous run in TIME_WAIT do not)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            probe.listen(1)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                holders = port_holders(port)
                who = f": held by {'; '.join(holders)}" if holders else ""
                raise ConfigError(name, f"port {port} on {host} is already in use{who}") from exc
            raise ConfigError(name, f"cannot listen on {host}:{port}: {exc}") from exc


def listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A listening socket on host:port for one frontend of the stack (inheritable)."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno != errno.EADDRINUSE:
            raise ConfigError("--port", f"cannot listen on {host}:{port}: {exc}") from exc
        holders = port_holders(port)
        who = f": held by {'; '.join(holders)}" if holders else ""
        raise ConfigError("--port", f"port {port} on {host} is already in use{who}") from exc
    sock.set_inheritable(True)
    return sock
