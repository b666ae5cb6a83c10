"""An in-process Redis for single-machine demos when no ``redis-server`` binary exists.

fakeredis's TCP server runs the same Lua scripts (the samples' msgpack falls back to
lua/include/msgpack.lua there). It lives in the ``qos up`` process, keeps nothing on disk
and serves one machine: a demo convenience, never a deployment.
"""

from __future__ import annotations

import threading
from typing import Any

from limiter.errors import ConfigError
from limiter.localstack.redis_server import free_port


class EmbeddedRedis:
    def __init__(self) -> None:
        self.port = free_port()
        self._server: Any = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        try:
            from fakeredis import TcpFakeServer
        except ImportError as exc:
            raise ConfigError("--redis-url", "no redis-server binary on PATH and fakeredis is not "
                              "installed: install Redis, pass --redis-url, or pip install "
                              "'inference-qos[demo]'") from exc
        self._server = TcpFakeServer(("127.0.0.1", self.port), server_type="redis")
        threading.Thread(target=self._server.serve_forever, name="embedded-redis", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
