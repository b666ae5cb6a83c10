"""A TCP relay in front of a real redis-server that can hold back Redis' replies.

It lands an event (a signal, a crash) at an exact point of a process' Redis conversation:
``hold_replies_after(b"ZADD")`` forwards every command as usual, so Redis applies them, but
once a client sends one containing that marker, nothing more goes back to any client until
``release()``. The process is then stuck awaiting that reply, a state the test can wait for.
``cut_replies_after(b"EVALSHA", keep=5)`` instead closes the client's connection once
``keep`` bytes of the replies that follow such a command went back: Redis ran the commands,
and the client's read breaks in the middle of its replies.
"""

from __future__ import annotations

import select
import socket
import threading


class StallingProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self._target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._marker: bytes | None = None
        self._cut_marker: bytes | None = None
        self._cut_keep = 0
        self._held = threading.Event()  # replies are being held back
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._spawn(self._accept)

    def hold_replies_after(self, marker: bytes) -> None:
        self._marker = marker

    def cut_replies_after(self, marker: bytes, keep: int) -> None:
        """Close the connection of the next client that sends ``marker`` once ``keep`` bytes of
        the replies after it went back (once only: later connections are relayed whole)."""
        self._cut_keep, self._cut_marker = keep, marker

    def release(self) -> None:
        self._marker = None
        self._held.clear()

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            self._sockets += [client, upstream]
            self._spawn(self._relay, client, upstream)

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        pending = b""  # replies held back
        cut_left: int | None = None  # reply bytes this client still gets before its cut
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([client, upstream], [], [], 0.05)
                if client in ready:
                    data = client.recv(65536)
                    if not data:
                        break
                    if self._marker is not None and self._marker in data:
                        self._held.set()
                    if self._cut_marker is not None and self._cut_marker in data:
                        self._cut_marker, cut_left = None, self._cut_keep
                    upstream.sendall(data)
                if upstream in ready:
                    data = upstream.recv(65536)
                    if not data:
                        break
                    pending += data
                if pending and not self._held.is_set():
                    if cut_left is not None and len(pending) >= cut_left:
                        client.sendall(pending[:cut_left])
                        break
                    if cut_left is not None:
                        cut_left -= len(pending)
                    client.sendall(pending)
                    pending = b""
            except OSError:
                break
        for s in (client, upstream):
            s.close()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for s in self._sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(5)

    def __enter__(self) -> StallingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
