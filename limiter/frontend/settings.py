"""Frontend settings: the config file's ``[frontend]`` table, then CLI flags, validated once."""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass
from typing import Any

from limiter.config import DEMO_ADMIN_KEY, DEMO_KEYS, QosConfig, build_section, hash_key
from limiter.errors import ConfigError
from limiter.frontend.cors import check_origins


@dataclass(frozen=True)
class FrontendSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    reuse_port: bool = False  # SO_REUSEPORT: several processes share one port
    max_body_bytes: int = 1 << 20
    allow_demo_keys_public: bool = False  # serve the published demo keys on a public address
    request_timeout_s: float = 600.0  # safety net: no request lives longer than this
    shutdown_grace_s: float = 30.0  # on SIGTERM, in-flight requests get this long to finish
    heartbeat_s: float = 2.0  # ZADD frontends; must stay well below the pool's frontend_ttl_ms
    redis_max_connections: int = 32  # per process (per master on a cluster), whatever the requests in flight
    body_timeout_s: float = 30.0  # a request body must arrive within this (slow-body clients: 408)
    idle_timeout_s: float = 75.0  # a connection with no request in progress is closed after this
    reap_s: float = 5.0  # janitor pass (reap_expired) over each pool; 0 = leave it to workers/controller
    tokenize_timeout_s: float = 5.0  # tokenizer = "upstream": longest wait for the model server's /tokenize
    # /metrics and /healthz of this process alone on a port of its own (0: none). Processes
    # sharing the API port (reuse_port, `qos up --frontends N`) each answer its /metrics in
    # turn, so counters read from it jump between processes: scrape these instead.
    metrics_port: int = 0
    metrics_host: str = ""  # "" = the API's host
    # /metrics on the API port too. Its series name tenants: where that port faces clients,
    # set false and scrape metrics_port on an internal address instead.
    api_metrics: bool = True
    # Origins whose pages may call the API from a browser (CORS; limiter/frontend/cors.py):
    # "*" for any, as vLLM's default; none (the default): no CORS headers, preflights are 405.
    cors_origins: tuple[str, ...] = ()


def is_loopback(host: str) -> bool:
    """True only for addresses that cannot be reached from another machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def uses_demo_keys(cfg: QosConfig) -> bool:
    """Whether any tenant accepts one of the published demo keys (demo config or a copy)."""
    demo = {hash_key(k) for k in (*DEMO_KEYS, DEMO_ADMIN_KEY)}
    return cfg.demo or any(h in demo for t in cfg.tenants for h in t.key_sha256)


def load_settings(cfg: QosConfig, overrides: dict[str, Any] | None = None) -> FrontendSettings:
    """Build from ``cfg.frontend`` plus non-None ``overrides`` (CLI flags), then validate."""
    settings = build_section("frontend", FrontendSettings, cfg.frontend)
    changes = {k: v for k, v in (overrides or {}).items() if v is not None}
    if changes:
        settings = build_section("frontend", FrontendSettings, {**dataclasses.asdict(settings), **changes})
    return validate(settings, cfg)


def validate(s: FrontendSettings, cfg: QosConfig) -> FrontendSettings:
    def check(ok: bool, name: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"frontend.{name}", message)

    check(bool(s.host), "host", "must not be empty")
    check(0 <= s.port <= 65535, "port", "must be in [0, 65535]")
    check(1024 <= s.max_body_bytes <= 64 << 20, "max_body_bytes", "must be in [1024, 67108864]")
    check(1 <= s.request_timeout_s <= 86_400, "request_timeout_s", "must be in [1, 86400]")
    check(0 <= s.shutdown_grace_s <= 3600, "shutdown_grace_s", "must be in [0, 3600]")
    check(4 <= s.redis_max_connections <= 1024, "redis_max_connections", "must be in [4, 1024]")
    check(0 < s.tokenize_timeout_s <= 600, "tokenize_timeout_s", "must be in (0, 600]")
    check(0.1 <= s.body_timeout_s <= 3600, "body_timeout_s", "must be in [0.1, 3600]")
    check(0.1 <= s.idle_timeout_s <= 3600, "idle_timeout_s", "must be in [0.1, 3600]")
    check(s.reap_s == 0 or 0.1 <= s.reap_s <= 3600, "reap_s", "must be 0 or in [0.1, 3600]")
    check(0 <= s.metrics_port <= 65535, "metrics_port", "must be in [0, 65535]")
    check(s.metrics_port == 0 or s.metrics_port != s.port, "metrics_port",
          f"must not be the API's port ({s.port}): it serves this process's metrics alone")
    check(s.api_metrics or s.metrics_port != 0, "api_metrics",
          "false needs a metrics_port: this process's /metrics would be served nowhere")
    check_origins(s.cors_origins, "frontend.cors_origins")
    ttl_s = min(p.frontend_ttl_ms for p in cfg.pools) / 1000
    check(0.05 <= s.heartbeat_s <= ttl_s / 3, "heartbeat_s",
          f"must be in [0.05, {ttl_s / 3:g}] (a third of the shortest pools[].frontend_ttl_ms)")
    if uses_demo_keys(cfg) and not is_loopback(s.host) and not s.allow_demo_keys_public:
        raise ConfigError("frontend.host", f"refusing to serve the published demo keys on {s.host!r}: "
                          "use a loopback address, a config file with your own keys, "
                          "or --allow-demo-keys-public")
    return s
