"""Controller settings: the config's ``[controller]`` table, then CLI flags, validated once.

One frozen dataclass so the lease loop, the sample consumer and the tick read the same,
already-checked values. Everything the control law needs is derived here too (shares and
ceilings from ``[[classes]]``, SLOs from ``slo_ttft_ms`` / ``slo_tpot_ms``), so a bad value
is reported at start as ``controller.<field>`` -- never as a crash in the middle of a tick.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from limiter.config import PoolConfig, QosConfig, build_section
from limiter.controller.capacity import CapacityConfig, CapacityEstimator
from limiter.controller.control_law import ControlConfig, ControlTunables
from limiter.errors import ConfigError
from limiter.keys import NAME_RE
from limiter.slo import ClassSLO

# The law's rate floors (ControlConfig.min_shares) when ``floors`` is not configured, as a
# fraction of each class's share: the top class keeps half, the others 30 %
# (docs/control-law.md: 0.30 / 0.105 / 0.015 for shares 0.60 / 0.35 / 0.05).
TOP_MIN_SHARE, LOWER_MIN_SHARE = 0.5, 0.3


@dataclass(frozen=True)
class ControllerSettings(ControlTunables):
    """Everything one controller process needs besides the shared config (docs/controller.md).

    The control law's tunables (``target``, ``low``, ``cooldown_s``, ...) are inherited from
    :class:`ControlTunables`: declared there once, with their defaults, and checked by
    :meth:`ControlConfig.validate`; ``[controller.capacity]`` is the estimator's own
    :class:`CapacityConfig`."""

    controller_id: str = ""  # "" = <hostname>-<pid>; also the consumer name in the samples group
    pools: tuple[str, ...] = ()  # () = every configured pool
    tick_s: float = 1.0  # one control decision per pool per tick
    lease_s: float = 3.0  # leader lease; a standby takes over within lease_s + renew_s
    renew_s: float = 1.0  # how often the lease is renewed (and a standby polls for it)
    block_s: float = 1.0  # XREADGROUP BLOCK timeout
    batch: int = 500  # stream entries per read
    claim_idle_s: float = 0.0  # XAUTOCLAIM entries pending this long; 0 = lease_s
    window_max_age_s: float = 600.0  # SLO window also forgets samples older than this; 0 = never
    used_window_s: float = 1.0  # "used" = claimed work over about this long ...
    # ... or, for a class claimed fewer times than this in it, as far back as it takes to
    # count them, at most used_max_window_s (a second's few claims are Poisson noise, and
    # the law sizes its cuts from "used"); 0 = used_window_s alone
    used_min_claims: int = 20
    used_max_window_s: float = 10.0
    cost_samples: int = 200  # recent samples per class behind the mean cost of a request
    metrics_port: int = 0  # 0 = no metrics server
    metrics_host: str = "0.0.0.0"
    burst_s: float = 0.0  # 0 = each class's burst_s; > 0 overrides them all
    # The law's rate floors (ControlConfig.min_shares), share of capacity per class; () = derived.
    # Not the classes' starvation ``floor`` (served work at claim).
    floors: tuple[float, ...] = ()
    capacity: CapacityConfig = field(default_factory=CapacityConfig)

    # --- derived ----------------------------------------------------------------------
    @property
    def claim_idle_ms(self) -> int:
        return int(1000 * (self.claim_idle_s or self.lease_s))

    def control_config(self, cfg: QosConfig) -> ControlConfig:
        """The law's parameters: shares, ceilings and bursts from the classes,
        the rest from here. The rates the controller writes keep the bursts the operator
        configured: ``[controller] burst_s`` replaces them only when set (> 0)."""
        shares = tuple(c.share for c in cfg.classes)
        if self.burst_s > 0:
            burst_s, class_bursts = self.burst_s, ()
        else:
            burst_s, class_bursts = ControlConfig.burst_s, tuple(c.burst_s for c in cfg.classes)
        min_shares = self.floors or tuple(
            s * (TOP_MIN_SHARE if i == 0 else LOWER_MIN_SHARE) for i, s in enumerate(shares))
        tunables = {f.name: getattr(self, f.name) for f in dataclasses.fields(ControlTunables)}
        return ControlConfig(
            **tunables, classes=tuple(cfg.class_names()), shares=shares, min_shares=min_shares,
            ceilings=tuple(c.ceil_share for c in cfg.classes), burst_s=burst_s, class_bursts=class_bursts,
        )

    def capacity_estimator(self, cfg: QosConfig, initial: float) -> CapacityEstimator:
        """The pool's estimator, starting at ``initial``; a class's work weighs what admission charges."""
        weights = {k.name: (k.weight, k.out_weight) for k in cfg.classes}
        return CapacityEstimator(self.capacity, initial, weights)

    @staticmethod
    def slos(cfg: QosConfig) -> dict[str, ClassSLO]:
        """Per-class targets from ``[[classes]]``; a class without any (P2) has no compliance."""
        return {c.name: ClassSLO.of(c) for c in cfg.classes}

    def pool_configs(self, cfg: QosConfig) -> list[PoolConfig]:
        return [cfg.pool(p) for p in self.pools] if self.pools else list(cfg.pools)

    # --- validation -------------------------------------------------------------------
    def resolved(self, cfg: QosConfig) -> ControllerSettings:
        """Fill the host-dependent default id (and a worker_ttl_s left to its default: at least
        three of the configured worker beats), then validate against ``cfg``."""
        s = self if self.controller_id else replace(self, controller_id=default_controller_id())
        beat_s = cfg.worker.get("heartbeat_s", WORKER_HEARTBEAT_S)
        own = cfg.controller.get("capacity", {})
        if "worker_ttl_s" not in own and not isinstance(beat_s, bool) and isinstance(beat_s, int | float):
            ttl_s = max(s.capacity.worker_ttl_s, HEARTBEATS_PER_TTL * beat_s)
            s = replace(s, capacity=replace(s.capacity, worker_ttl_s=ttl_s))
        s.validate(cfg)
        return s

    def validate(self, cfg: QosConfig) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ConfigError(f"controller.{name}", f"{message}, got {getattr(self, name)!r}")

        check(bool(NAME_RE.fullmatch(self.controller_id)), "controller_id", f"must match {NAME_RE.pattern}")
        known = [p.name for p in cfg.pools]
        for i, p in enumerate(self.pools):
            if p not in known:
                raise ConfigError(f"controller.pools[{i}]", f"unknown pool {p!r}; configured: {known}")
        check(0.05 <= self.tick_s <= 60, "tick_s", "must be in [0.05, 60]")
        check(0.1 <= self.lease_s <= 600, "lease_s", "must be in [0.1, 600] (acquire_leader's ttl range)")
        check(0.01 <= self.renew_s <= self.lease_s / 2, "renew_s", "must be in [0.01, lease_s / 2]")
        check(0.01 <= self.block_s <= 60, "block_s", "must be in [0.01, 60]")
        check(1 <= self.batch <= 100_000, "batch", "must be in [1, 100000]")
        check(self.claim_idle_s == 0 or 0.01 <= self.claim_idle_s <= 3600, "claim_idle_s",
              "must be 0 (= lease_s) or in [0.01, 3600]")
        check(self.window_max_age_s == 0 or 1 <= self.window_max_age_s <= 86_400, "window_max_age_s",
              "must be 0 (no limit) or in [1, 86400]")
        check(0.05 <= self.used_window_s <= 60, "used_window_s", "must be in [0.05, 60]")
        # bounded: every tick tests each class's count over up to (used_max_window_s /
        # used_window_s) windows, each test a sum of up to used_min_claims terms
        check(0 <= self.used_min_claims <= 200, "used_min_claims", "must be in [0, 200]")
        check(0.05 <= self.used_max_window_s <= 60, "used_max_window_s",
              "must be in [0.05, 60] (below used_window_s it is used_window_s; past 100 x "
              "used_window_s it is that)")
        check(1 <= self.cost_samples <= 100_000, "cost_samples", "must be in [1, 100000]")
        check(0 <= self.metrics_port <= 65535, "metrics_port", "must be in [0, 65535]")
        for name in ("tick_s", "lease_s", "renew_s", "block_s", "used_window_s", "used_max_window_s"):
            check(math.isfinite(getattr(self, name)), name, "must be finite")
        check(all(math.isfinite(f) for f in self.floors), "floors", "must be finite")
        check(math.isfinite(self.burst_s) and 0 <= self.burst_s <= 3600, "burst_s",
              "must be 0 (the classes' own burst_s) or in (0, 3600]")
        try:
            self.control_config(cfg).validate("controller")  # names controller.<field>, e.g. controller.low
        except ConfigError as exc:
            if exc.path in ("controller.classes", "controller.shares", "controller.ceilings"):
                # derived from [[classes]], not from [controller]: name where to fix it
                raise ConfigError("classes", "the controller needs shares in (0, 1] and ceil_share >= "
                                  f"share: {exc.message}") from exc
            if exc.path == "controller.min_shares":
                raise ConfigError("controller.floors", exc.message) from exc  # the key they came from
            raise
        self.capacity.validate("controller.capacity")
        # A live worker must not look dead between two of its beats: each leave and return is a
        # capacity change the law applies at once. (The worker's own flags and environment are
        # per process, out of sight here: this checks what the shared file says.)
        beat_s = cfg.worker.get("heartbeat_s", WORKER_HEARTBEAT_S)
        if isinstance(beat_s, bool) or not isinstance(beat_s, int | float):
            return  # the worker's own settings say what is wrong with it
        if not self.capacity.worker_ttl_s >= HEARTBEATS_PER_TTL * beat_s:
            raise ConfigError("controller.capacity.worker_ttl_s",
                              f"must be >= {HEARTBEATS_PER_TTL} x [worker] heartbeat_s ({beat_s:g} s): a "
                              "live worker would drop out of the capacity between its beats, got "
                              f"{self.capacity.worker_ttl_s!r}")


# The worker's default heartbeat_s (worker/settings.py; the worker package is not imported
# here) and how many beats a live worker may take within the controller's worker_ttl_s.
WORKER_HEARTBEAT_S = 1.0
HEARTBEATS_PER_TTL = 3


def default_controller_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"


def load_settings(cfg: QosConfig, overrides: Mapping[str, Any] | None = None) -> ControllerSettings:
    """``[controller]`` from the config, then non-None ``overrides`` (CLI flags) on top."""
    base = build_section("controller", ControllerSettings, cfg.controller)
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    names = {f.name for f in dataclasses.fields(ControllerSettings)}
    for key in flags:
        if key not in names:
            raise ConfigError(f"controller.{key}", "unknown field")
    if "pools" in flags:
        flags["pools"] = tuple(flags["pools"])
    s = replace(base, **flags)
    if "renew_s" not in flags and "renew_s" not in cfg.controller and isinstance(s.lease_s, float):
        # Left unset, the renewal follows a short lease: `--lease 1` was refused naming renew_s,
        # a setting the operator never gave.
        s = replace(s, renew_s=min(s.renew_s, s.lease_s / 3))
    return s.resolved(cfg)
