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
* :func:`check_port_free` and :func:`listen_socket` check and bind the HTTP port in ``qos
  up`` itself, before any child starts: a taken port is refused with a message naming it
  (and, where /proc tells, the process holding it), also when the stranger listens on the
  other family's address where the stack's clients would reach it (``[::1]`` beside
  ``127.0.0.1``: ``localhost`` resolves there first). :func:`share_listen_socket` gives every
  frontend of the stack the one socket, bound without SO_REUSEPORT, so no stranger's
  listener (an orphaned frontend of another stack, a later ``--reuse-port`` process) can
  share the port with the stack, before or after it starts.
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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

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


# Addresses where a stranger's listener on the port takes clients meant for the stack on a
# host, though binding that host does not conflict with it (another family, or a specific
# IPv6 address beside the IPv4 wildcard): `localhost` resolves to ::1 first on most systems.
_ALSO_REACHED = {
    "127.0.0.1": ("::1", "clients of localhost may connect there first"),
    "localhost": ("::1", "clients of localhost may connect there first"),
    "::1": ("127.0.0.1", "clients of localhost may connect there"),
    "0.0.0.0": ("::", "IPv6 clients, localhost's ::1 among them, connect there"),
    "::": ("0.0.0.0", "IPv4 clients connect there"),  # (a dual-stack probe covers it, unless bindv6only)
}


def _probe(host: str, port: int, v6only: bool = False) -> OSError | None:
    """Bind and listen on host:port as a stack would: the error, or None when free.

    Without SO_REUSEPORT (so a reuse-port listener counts as taken) and with SO_REUSEADDR (so
    connections of a previous run in TIME_WAIT do not). ``v6only``: an IPv6 wildcard probes
    the IPv6 side alone."""
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if v6only:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind((host, port))
            probe.listen(1)
    except OSError as exc:
        return exc
    return None


def _in_use(name: str, host: str, port: int, note: str = "") -> ConfigError:
    holders = port_holders(port)
    who = f": held by {'; '.join(holders)}" if holders else ""
    return ConfigError(name, f"port {port} on {host} is already in use{note}{who}")


def check_port_free(host: str, port: int, name: str = "--port") -> None:
    """Raise ConfigError naming ``port`` (and its holder) if anyone listens on it: on ``host``,
    or on the address of the other family where the stack's clients would reach a stranger
    instead (``_ALSO_REACHED``; not checked where that family is not available)."""
    if (exc := _probe(host, port)) is not None:
        if exc.errno == errno.EADDRINUSE:
            raise _in_use(name, host, port) from exc
        raise ConfigError(name, f"cannot listen on {host}:{port}: {exc}") from exc
    if host in _ALSO_REACHED:
        other, why = _ALSO_REACHED[host]
        exc = _probe(other, port, v6only=other == "::")
        if exc is not None and exc.errno == errno.EADDRINUSE:
            raise _in_use(name, other, port, f" ({why} instead of {host})") from exc


def listen_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening socket on host:port (inheritable); ``reuse_port`` only for a private stack
    on a free port (the benchmarks), never for ``qos up``'s (see :func:`share_listen_socket`)."""
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
        raise _in_use("--port", host, port) from exc
    sock.set_inheritable(True)
    return sock


class _Listener(Protocol):
    sock: socket.socket | None

    def close_sock(self) -> None: ...


def share_listen_socket(frontends: Sequence[_Listener], host: str, port: int) -> None:
    """Bind host:port once, without SO_REUSEPORT, and give each frontend its own descriptor of
    that one socket (``.sock``, inheritable; the caller closes each once its child holds it).

    One socket, not one per frontend in a SO_REUSEPORT group: the kernel lets any process of
    the same user join such a group, so a stranger started later with SO_REUSEPORT (a
    standalone ``qos frontend --reuse-port``, another stack's orphan) silently took a share of
    the stack's connections. Against a socket without SO_REUSEPORT its bind fails with
    EADDRINUSE. The frontends accept from the one queue; the socket closes when the last of
    them exits (connections then refused, not left hanging in a backlog nobody accepts)."""
    shared = listen_socket(host, port)
    try:
        for c in frontends:
            c.sock = shared.dup()
            c.sock.set_inheritable(True)
    except OSError as exc:
        for c in frontends:
            c.close_sock()
        raise ConfigError("--port", f"cannot share the socket on {host}:{port}: {exc}") from exc
    finally:
        shared.close()
