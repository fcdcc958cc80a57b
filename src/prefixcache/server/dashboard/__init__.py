"""``GET /dashboard``: the KV cache seen live in a browser, served by the server itself.

The page (``static/index.html`` and ``dashboard.js``, charts by uPlot, shipped in
``static/vendor`` — nothing from a CDN: the server runs offline) polls ``GET /dashboard/data``
once a second: the pool's occupancy, hit ratio in tokens, prefill tokens saved, evictions and
preemptions per second, queue and batch, per-domain hit ratio and TTFT p50/p99, the most shared
prefixes as a tree of digests, and the last admissions' first-miss position and reason
(`state.CacheView`). Reading it needs what ``/metrics`` needs: with a tenants file, an admin
tenant's key or ``--metrics-key``, as ``Authorization: Bearer`` or through the page's sign-in,
which sets an HttpOnly session cookie signed with a key derived from the server secret (the API
key itself is never stored in the browser; every replica of a cluster accepts it). Anyone
else gets 401 and no data; the static files hold no data.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixcache.server.dashboard.state import CacheView, dashboard_data
from prefixcache.server.errors import ApiError
from prefixcache.server.protocol import JSONObject

if TYPE_CHECKING:
    from prefixcache.server.async_engine import AsyncEngine
    from prefixcache.server.metrics import ServerMetrics

__all__ = ["SESSION_S", "CacheView", "DashboardSources", "Sessions", "install_dashboard"]

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
    """Signed-in browsers: ``EXPIRY.SIGNATURE`` tokens signed with a key derived from the server
    secret, so every replica of a cluster (one secret) accepts a session another one issued.
    Signing out forgets the token here and clears the cookie; it expires after `SESSION_S`."""

    def __init__(self, key: bytes, clock: Callable[[], float] = time.time) -> None:
        self.key = key
        self.clock = clock
        self._ended: dict[str, float] = {}

    def _sign(self, expiry: str) -> str:
        return hmac.new(self.key, expiry.encode(), hashlib.sha256).hexdigest()

    def new(self) -> str:
        expiry = str(int(self.clock() + SESSION_S))
        return f"{expiry}.{self._sign(expiry)}"

    def valid(self, token: str | None) -> bool:
        if not token or token in self._ended:
            return False
        expiry, _, signature = token.partition(".")
        if not expiry.isdigit() or not hmac.compare_digest(signature, self._sign(expiry)):
            return False
        return int(expiry) > self.clock()

    def end(self, token: str | None) -> None:
        if token and self.valid(token):
            now = self.clock()
            self._ended = {t: e for t, e in self._ended.items() if e > now}
            if len(self._ended) < MAX_SESSIONS:
                self._ended[token] = float(token.partition(".")[0])


def _file(name: str) -> bytes:
    root = resources.files("prefixcache.server.dashboard") / "static"
    path = root / "vendor" / name if name.startswith("uPlot") else root / name
    return path.read_bytes()


@dataclass(frozen=True, slots=True)
class DashboardSources:
    """What the data document is read from: the engine's snapshot and queue, the metrics, the
    cache view and, where the engine has lower tiers, their counters."""

    engine: AsyncEngine
    metrics: ServerMetrics
    view: CacheView
    model: str
    tiers: Callable[[], JSONObject | None] | None = None

    def data(self) -> JSONObject:
        engine = self.engine
        data = dashboard_data(engine.snapshot, self.view, self.metrics, self.model,
                              engine.limits.block_size,
                              self.tiers() if self.tiers is not None else None,
                              engine.num_pending)
        kv_cache = engine.limits.precision.get("kv_cache", {})  # the KV layout (its name)
        data["kv_cache_dtype"] = str(kv_cache.get("dtype", ""))
        return data


def install_dashboard(
    app: FastAPI, sources: DashboardSources, check_key: Callable[[str | None], None],
    key_of: Callable[[Request], str | None], session_key: bytes,
) -> None:
    """The dashboard's routes on ``app`` (``check_key`` raises `ApiError` for a key that may
    not read the metrics; ``key_of`` reads a request's key; ``session_key`` signs sessions)."""
    sessions = Sessions(session_key)
    app.state.dashboard_sessions = sessions

    def authorized(request: Request) -> bool:
        if sessions.valid(request.cookies.get(COOKIE)):
            return True
        try:
            check_key(key_of(request))
        except ApiError:
            return False
        return True

    _add_page_routes(app, authorized)
    _add_session_routes(app, sessions, check_key)

    @app.get("/dashboard/data", include_in_schema=False)
    async def data(request: Request) -> Response:
        if not authorized(request):
            raise ApiError(401, "the dashboard needs an admin or metrics API key",
                           code="invalid_api_key")
        return JSONResponse(sources.data(), headers={"Cache-Control": "no-store"})


def _add_page_routes(app: FastAPI, authorized: Callable[[Request], bool]) -> None:
    """The page (the sign-in page for a browser not signed in) and its static files."""

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


def _add_session_routes(
    app: FastAPI, sessions: Sessions, check_key: Callable[[str | None], None]
) -> None:
    """Sign-in with a key that may read the metrics (a session cookie), and sign-out."""

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
