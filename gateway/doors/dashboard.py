"""`/dashboard`: the live page an operator looks at, served from files in the package (no build step, no CDN).

The page itself holds no data; its script polls `/admin/backends` and `/metrics`, so it sees exactly what
those routes show and sits behind the same admin key (entered once in the page, kept in the tab's
sessionStorage, sent as `Authorization: Bearer`).
"""

from __future__ import annotations

from pathlib import Path

from gateway.doors.http_server import Request
from gateway.doors.route_table import Reply, RouteHandler, RouteTable

ASSETS = Path(__file__).with_name("dashboard")
_TYPES = {"index.html": b"text/html; charset=utf-8", "dashboard.js": b"text/javascript; charset=utf-8",
          "dashboard.css": b"text/css; charset=utf-8"}
_PATHS = {"/dashboard": "index.html", "/dashboard/dashboard.js": "dashboard.js",
          "/dashboard/dashboard.css": "dashboard.css"}
# The scripts and styles come from this origin only: a page behind an admin key loads nothing else.
_HEADERS = [(b"content-security-policy", b"default-src 'self'; img-src 'self' data:; object-src 'none'; "
                                         b"frame-ancestors 'none'"),
            (b"cache-control", b"no-cache")]


def add_dashboard(table: RouteTable) -> None:
    """Register `/dashboard` and its two assets, read once here (a few kB, shipped with the package)."""
    for path, name in _PATHS.items():
        table.add("GET", path, _asset(Reply(200, (ASSETS / name).read_bytes(), _TYPES[name], _HEADERS)))


def _asset(reply: Reply) -> RouteHandler:
    async def serve(request: Request, _: str) -> Reply:
        return reply

    return serve
