"""``GET /dashboard``: the KV cache seen live in a browser, served by the server itself.

The page (``static/index.html`` and ``dashboard.js``, charts by uPlot, shipped in
``static/vendor`` — nothing from a CDN: the server runs offline) polls ``GET /dashboard/data``
once a second: the pool's occupancy, hit ratio in tokens, prefill tokens saved, evictions and
preemptions per second, queue and batch, per-domain hit ratio and TTFT p50/p99, the most shared
prefixes as a tree of digests, and the last admissions' first-miss position and reason
(`state.CacheView`). Reading it needs what ``/metrics`` needs: with a tenants file, an admin
tenant's key or ``--metrics-key``, as ``Authorization: Bearer`` or through the page's sign-in,
which sets an HttpOnly session cookie (the key itself is never stored in the browser). Anyone
else gets 401 and no data; the static files hold no data.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixcache.server.dashboard.state import CacheView, dashboard_data
from prefixcache.server.errors import ApiError

if TYPE_CHECKING:
    from prefixcache.server.async_engine import AsyncEngine
    from prefixcache.server.metrics import ServerMetrics

__all__ = ["CacheView", "install_dashboard"]

COOKIE = "prefixcache_dashboard"
SESSION_S = 12 * 3600.0
MAX_SESSIONS = 1024
_STATIC = {  # name -> media type: the only files served
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}


class Sessions:
    """Signed-in browsers: random tokens with an expiry (the oldest dropped past the cap)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._expiry: dict[str, float] = {}

    def new(self) -> str:
        token = secrets.token_urlsafe(32)
        now = self.clock()
        self._expiry = {t: e for t, e in self._expiry.items() if e > now}
        while len(self._expiry) >= MAX_SESSIONS:
            del self._expiry[next(iter(self._expiry))]
        self._expiry[token] = now + SESSION_S
        return token

    def valid(self, token: str | None) -> bool:
        return token is not None and self._expiry.get(token, 0.0) > self.clock()

    def end(self, token: str | None) -> None:
        self._expiry.pop(token or "", None)


def _file(name: str) -> bytes:
    root = resources.files("prefixcache.server.dashboard") / "static"
    path = root / "vendor" / name if name.startswith("uPlot") else root / name
    return path.read_bytes()


def install_dashboard(
    app: FastAPI, engine: AsyncEngine, metrics: ServerMetrics, view: CacheView, model: str,
    check_key: Callable[[str | None], None], key_of: Callable[[Request], str | None],
    tiers: Callable[[], dict[str, Any] | None] | None,
) -> None:
    """The dashboard's routes on ``app`` (``check_key`` raises `ApiError` for a key that may
    not read the metrics; ``key_of`` reads a request's key)."""
    sessions = Sessions()
    app.state.dashboard_sessions = sessions

    def authorized(request: Request) -> bool:
        if sessions.valid(request.cookies.get(COOKIE)):
            return True
        try:
            check_key(key_of(request))
        except ApiError:
            return False
        return True

    @app.get("/dashboard", include_in_schema=False)
    async def page(request: Request) -> Response:
        if not authorized(request):
            return Response(_file("login.html"), status_code=401, media_type="text/html")
        return Response(_file("index.html"), media_type="text/html",
                        headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in _STATIC:
            raise ApiError(404, f"no dashboard file {name!r}")
        return Response(_file(name), media_type=_STATIC[name],
                        headers={"Cache-Control": "max-age=3600"})

    @app.post("/dashboard/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        key = body.get("key") if isinstance(body, dict) else None
        if not isinstance(key, str) or not key:
            raise ApiError(400, "send {\"key\": \"<admin or metrics API key>\"}", param="key")
        check_key(key)  # 401 / 403 in OpenAI's error shape
        response = Response(status_code=204)
        response.set_cookie(COOKIE, sessions.new(), max_age=int(SESSION_S), httponly=True,
                            samesite="strict", path="/dashboard")
        return response

    @app.post("/dashboard/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        sessions.end(request.cookies.get(COOKIE))
        response = Response(status_code=204)
        response.delete_cookie(COOKIE, path="/dashboard")
        return response

    @app.get("/dashboard/data", include_in_schema=False)
    async def data(request: Request) -> Response:
        if not authorized(request):
            raise ApiError(401, "the dashboard needs an admin or metrics API key",
                           code="invalid_api_key")
        body = dashboard_data(engine.snapshot, view, metrics, model, engine.limits.block_size,
                              tiers() if tiers is not None else None, engine.num_pending)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})
