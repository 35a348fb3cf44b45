"""`/dashboard`: the live page an operator looks at, served from files in the package (no build step, no CDN).

The page itself holds no data; its script polls `/admin/backends` and `/metrics`, so it sees exactly what
those routes show and sits behind the same admin key (entered once in the page, kept in the tab's
sessionStorage, sent as `Authorization: Bearer`).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response

ASSETS = Path(__file__).with_name("dashboard")
_TYPES = {"index.html": "text/html; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8",
          "dashboard.css": "text/css; charset=utf-8"}
# The scripts and styles come from this origin only: a page behind an admin key loads nothing else.
_CSP = "default-src 'self'; img-src 'self' data:; object-src 'none'; frame-ancestors 'none'"


def add_dashboard(app: FastAPI) -> None:
    """Register `/dashboard` and its two assets on the routes' app."""

    def asset(name: str) -> Response:
        return FileResponse(ASSETS / name, media_type=_TYPES[name],
                            headers={"content-security-policy": _CSP, "cache-control": "no-cache"})

    @app.get("/dashboard", include_in_schema=False)
    async def page() -> Response:
        return asset("index.html")

    @app.get("/dashboard/dashboard.js", include_in_schema=False)
    async def script() -> Response:
        return asset("dashboard.js")

    @app.get("/dashboard/dashboard.css", include_in_schema=False)
    async def style() -> Response:
        return asset("dashboard.css")
