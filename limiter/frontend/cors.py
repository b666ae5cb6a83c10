"""Cross-origin requests (CORS) for browser clients: chat UIs, the JS SDK with
``dangerouslyAllowBrowser``. Off unless ``[frontend] cors_origins`` lists origins ("*": any,
as vLLM's default ``--allowed-origins``).

A browser sends a preflight ``OPTIONS`` before a request with an ``Authorization`` header:
answered here, before any route or key check (the preflight carries no key). Every other
answer to an allowed origin gets ``Access-Control-Allow-Origin`` when its headers are
prepared, so a streamed (SSE) answer, whose headers go out before the handler returns, and
an error answer have it too: without it the page cannot read the error either.

The API key is a bearer token, which the page sets itself, not a cookie: no
``Access-Control-Allow-Credentials``.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from limiter.errors import ConfigError

ANY = "*"
# What a page may read of an answer beyond the CORS-safelisted headers: the request id, and
# the waits an SDK retries by.
EXPOSED = ", ".join(("X-QoS-Request-Id", "x-request-id", "Retry-After", "retry-after-ms", "x-should-retry"))
PREFLIGHT_MAX_AGE_S = 600
# A preflight's Access-Control-Request-Headers is echoed back: header names and commas only,
# bounded (a browser lists the few it will send).
_HEADER_LIST = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*")
_MAX_HEADER_LIST = 2048

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def check_origins(origins: tuple[str, ...], path: str) -> None:
    """Each entry ``*`` or an origin (``scheme://host[:port]``, no path), as a browser sends it."""
    for i, origin in enumerate(origins):
        if origin == ANY:
            continue
        parts = urllib.parse.urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query \
                or parts.fragment or "@" in parts.netloc or origin != origin.strip():
            raise ConfigError(f"{path}[{i}]", f"{origin[:100]!r} is not an origin: expected \"*\" or "
                              "scheme://host[:port], as a browser's Origin header reads (no path)")


class Cors:
    """The policy of one app: which origins, and the two hooks that apply it."""

    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any = ANY in origins
        self.origins = frozenset(o.lower() for o in origins if o != ANY)

    def allowed(self, origin: str | None) -> bool:
        return origin is not None and (self.any or origin.lower() in self.origins)

    def _allow_origin(self, headers: web.CIMultiDict[str] | dict[str, str], origin: str) -> None:
        headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = ANY if self.any else origin
        self._vary(headers)

    def _vary(self, headers: web.CIMultiDict[str] | dict[str, str]) -> None:
        """With a list of origins every answer depends on the Origin (a listed one gets the
        header, any other none): a shared cache must keep one per origin, whatever this one's."""
        if not self.any and "Origin" not in headers.get(hdrs.VARY, ""):
            vary = headers.get(hdrs.VARY)
            headers[hdrs.VARY] = f"{vary}, Origin" if vary else "Origin"

    @web.middleware
    async def preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get(hdrs.ORIGIN)
        if request.method != hdrs.METH_OPTIONS or hdrs.ACCESS_CONTROL_REQUEST_METHOD not in request.headers \
                or not self.allowed(origin):
            return await handler(request)  # not a preflight we answer: the route's 405 as before
        headers = {hdrs.ACCESS_CONTROL_ALLOW_METHODS: "GET, POST, OPTIONS",
                   hdrs.ACCESS_CONTROL_MAX_AGE: str(PREFLIGHT_MAX_AGE_S)}
        asked = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS, "").strip()
        if asked and len(asked) <= _MAX_HEADER_LIST and _HEADER_LIST.fullmatch(asked):
            headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = asked
        assert origin is not None
        self._allow_origin(headers, origin)
        return web.Response(status=204, headers=headers)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get(hdrs.ORIGIN)
        if self.allowed(origin) and request.method != hdrs.METH_OPTIONS:
            assert origin is not None
            self._allow_origin(response.headers, origin)
            response.headers[hdrs.ACCESS_CONTROL_EXPOSE_HEADERS] = EXPOSED
        else:
            self._vary(response.headers)


def install(app: web.Application, origins: tuple[str, ...]) -> None:
    """Apply ``origins``' policy to ``app`` (nothing when empty). The preflight middleware
    goes outside the error middleware (a preflight is no API request) but inside the first,
    which writes a returned answer under a time bound: first, a client that pipelined
    preflights and read none held its connection for ever."""
    if not origins:
        return
    cors = Cors(origins)
    app.middlewares.insert(1, cors.preflight)
    app.on_response_prepare.append(cors.on_prepare)
