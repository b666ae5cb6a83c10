"""The small HTTP server workers and controllers expose: ``/metrics`` (Prometheus text from
the process's own registry) and ``/healthz`` (a JSON health summary)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


async def start_metrics_server(registry: CollectorRegistry, health: Callable[[], dict[str, Any]], host: str,
                               port: int) -> web.AppRunner:
    """Serve /metrics and /healthz; returns the runner (``await runner.cleanup()`` to stop)."""

    async def get_metrics(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_health(_request: web.Request) -> web.Response:
        return web.json_response(health())

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/healthz", get_health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
