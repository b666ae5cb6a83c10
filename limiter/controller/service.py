"""The controller process: one :class:`PoolController` per pool, metrics, clean shutdown.

Every controller process runs the same code; which one is *active* for a pool is decided
by the pool's lease alone, so any number of standbys can run from the start (docs/controller.md).
A clean shutdown (SIGTERM/SIGINT) stops the loops first -- no write after giving up -- then
releases every lease it holds, so a standby takes over at its next poll instead of waiting
for the lease to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

from aiohttp import web

from limiter import lifecycle
from limiter.config import QosConfig
from limiter.controller.loop import STEP_TIMEOUT_S, PoolController
from limiter.controller.metrics import ControllerMetrics
from limiter.controller.settings import ControllerSettings
from limiter.errors import ConfigError, RedisUnavailable
from limiter.metrics_server import start_metrics_server
from limiter.redis_conn import eviction_risk, map_redis_errors, open_redis
from limiter.scripts import Scripts
from limiter.tasks import stop_tasks

log = logging.getLogger("qos.controller")


class Controller:
    def __init__(self, settings: ControllerSettings, cfg: QosConfig, client: Any = None) -> None:
        self.settings, self.cfg = settings, cfg
        pools = settings.pool_configs(cfg)
        self._own_client = client is None
        # per pool: one connection blocked in XREADGROUP, one for the lease, one for the tick
        if client is None:
            client = open_redis(cfg.redis, max_connections=2 + 3 * len(pools), blocking_s=settings.block_s)
        self.client = client
        self.scripts = Scripts(self.client)
        self.metrics = ControllerMetrics(settings.controller_id)
        self.pools = {p.name: PoolController(cfg=cfg, pool=p, settings=settings, client=self.client,
                                             scripts=self.scripts, metrics=self.metrics) for p in pools}
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        # a loop that met a configuration error (a Redis Cluster node named without
        # redis.cluster, found once Redis answered): the process ends with it (serve)
        self.failed: asyncio.Future[None] | None = None

    async def start(self) -> None:
        # The port first: a port that is taken is a clear error before any loop runs (the loops
        # used to start first, and a failed bind left them running: a process that neither
        # exited nor answered SIGTERM, and kept taking the lease).
        s = self.settings
        if s.metrics_port:
            try:
                self._runner = await start_metrics_server(self.metrics.registry, self.health, s.metrics_host,
                                                          s.metrics_port)
            except OSError as exc:
                raise ConfigError("controller.metrics_port",
                                  f"cannot listen on {s.metrics_host}:{s.metrics_port}: {exc}") from exc
        await self._check_redis_mode()
        self.failed = asyncio.get_running_loop().create_future()
        for pc in self.pools.values():
            self._tasks += [asyncio.create_task(coro) for coro in pc.loops()]
        for task in self._tasks:
            task.add_done_callback(self._loop_ended)
        log.info("controller %s started for pools %s (lease %.1f s, tick %.1f s)", s.controller_id,
                 list(self.pools), s.lease_s, s.tick_s)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self.failed is None or self.failed.done():
            return
        if isinstance(exc := task.exception(), ConfigError):
            self.failed.set_exception(exc)

    async def _check_redis_mode(self) -> None:
        """A read of each pool's key: a node of a Redis Cluster named with ``redis.cluster``
        false redirects it, a configuration error to stop at (the loops, which go on through
        every error, logged a traceback a second for ever). Redis out of reach now is left
        to the loops, which wait for it. A shard that may evict keys is logged as the risk it
        is (:data:`limiter.redis_conn.EVICTION_RISK`): nothing else would tell."""
        for pc in self.pools.values():
            try:
                async with asyncio.timeout(STEP_TIMEOUT_S):
                    with map_redis_errors():
                        await self.client.exists(pc.keys.policy)
                        risk = await eviction_risk(self.client, pc.keys)
            except (RedisUnavailable, TimeoutError):
                return
            if risk:
                log.warning("pool %s: %s", pc.pool.name, risk)

    async def stop(self, release: bool = True) -> None:
        """Stop the loops, then (``release``) give up every lease held. ``release=False``
        imitates a crash for tests: the lease is left to expire."""
        await stop_tasks(self._tasks, f"controller {self.settings.controller_id}")
        self._tasks = []
        for pc in self.pools.values():
            pc.end_term("shutting down")
            if release:
                try:
                    async with asyncio.timeout(2.0):
                        await pc.lease.release()
                except Exception as exc:  # Redis down: the lease expires on its own
                    log.warning("%s: could not release the lease (%s); it expires in %.1f s", pc.pool.name,
                                exc, self.settings.lease_s)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._own_client:
            with contextlib.suppress(Exception):
                await self.client.aclose()

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok", "controller": self.settings.controller_id,
            "pools": {name: {"leader": pc.term is not None, "fence": pc.lease.fence or None,
                             "holder": pc.lease.holder or None, "redis_ok": pc.redis_ok,
                             "samples": pc.term.consumed if pc.term else 0}
                      for name, pc in self.pools.items()},
        }


async def serve(settings: ControllerSettings, cfg: QosConfig) -> int:
    """Run until SIGTERM/SIGINT/SIGHUP, then shut down cleanly (leases released)."""
    controller = Controller(settings, cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    hup = () if lifecycle.hangup_ignored() else (signal.SIGHUP,)  # nohup: SIGHUP stays ignored
    for sig in (signal.SIGTERM, signal.SIGINT, *hup):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await controller.start()
        assert controller.failed is not None
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({stopped, controller.failed}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if controller.failed.done():
            controller.failed.result()  # raises the configuration error: exit 2, naming it
        log.info("shutting down: releasing leadership")
    finally:
        await controller.stop()
    return 0
