"""The HTTP front door: one server (`gateway.doors.http_server`) for every route.

    POST /v1/chat/completions, /v1/completions   the completions door (`completions.py`)
    GET  /v1/models, /v1/models/{id}              the served model, behind the API keys
    GET  /health, /ready                          liveness; readiness (503 while not ready)
    GET  /metrics, /admin/backends, /admin/usage  behind the admin keys
    POST, DELETE /admin/backends...               the fleet changed at runtime (`fleet_routes.py`)
    GET  /dashboard                               the operator's page (`dashboard.py`)

Every route but the completions is a handler of the route table (`route_table.py`), which answers
HEAD, 404, 405, `x-request-id` and errors in the OpenAI shape for all of them; the server answers CORS
(`gateway.cors`) on every route.
"""

from __future__ import annotations

import ssl

from gateway.control.fleet import Fleet
from gateway.doors.completions import CompletionsDoor
from gateway.doors.dashboard import add_dashboard
from gateway.doors.fleet_routes import add_fleet_routes
from gateway.doors.http_server import Cors, HttpServer, Request, find_header
from gateway.doors.jobs import JobBuilder
from gateway.doors.route_table import Reply, RouteTable, json_reply
from gateway.runtime import Runtime

_METRICS = b"text/plain; version=0.0.4; charset=utf-8"


class GatewayRoutes:
    """The handlers of the routes other than the completions and the fleet's, on one runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._jobs = JobBuilder(runtime)

    def add_to(self, table: RouteTable) -> None:
        table.add("GET", "/v1/models", self.models)
        table.add("GET", "/v1/models/{model_id:path}", self.model)
        table.add("GET", "/health", self.health)
        table.add("GET", "/ready", self.ready)
        table.add("GET", "/metrics", self.metrics)
        table.add("GET", "/admin/backends", self.admin_backends)
        table.add("GET", "/admin/usage", self.admin_usage)

    def authorize(self, request: Request, *, admin: bool = False) -> None:
        header = find_header(request.headers, b"authorization")
        self._runtime.keys.check(header.decode("latin-1") if header is not None else None, admin=admin)

    async def models(self, request: Request, _: str) -> Reply:
        self.authorize(request)
        return json_reply({"object": "list", "data": self._runtime.model_cards()})

    async def model(self, request: Request, model_id: str) -> Reply:
        self.authorize(request)
        return json_reply(self._runtime.model_card(self._jobs.check_model(model_id).name))

    async def health(self, request: Request, _: str) -> Reply:
        return json_reply({"status": "ok"})

    async def ready(self, request: Request, _: str) -> Reply:
        state = self._runtime.readiness()
        return json_reply(state, 200 if state["ready"] else 503)

    async def metrics(self, request: Request, _: str) -> Reply:
        self.authorize(request, admin=True)
        return Reply(200, self._runtime.metrics.render(), _METRICS)

    async def admin_backends(self, request: Request, _: str) -> Reply:
        self.authorize(request, admin=True)
        return json_reply({"object": "list", "data": self._runtime.describe_backends()})

    async def admin_usage(self, request: Request, _: str) -> Reply:
        """Per tenant: policy, current windows (every replica's, with Redis), this process's counters."""
        self.authorize(request, admin=True)
        return json_reply({"object": "list", "data": await self._runtime.pipeline.tenants.usage()})


def route_table(runtime: Runtime, fleet: Fleet | None = None) -> RouteTable:
    """Every route but the completions; with `fleet`, the admin routes that change the fleet at runtime."""
    table = RouteTable()
    routes = GatewayRoutes(runtime)
    routes.add_to(table)
    if fleet is not None:
        add_fleet_routes(table, runtime, fleet, routes.authorize)
    add_dashboard(table)
    return table


def create_server(runtime: Runtime, idle_s: float, ssl_context: ssl.SSLContext | None = None,
                  fleet: Fleet | None = None) -> HttpServer:
    """The front door: the completions door's handlers, and the route table for every other path."""
    table = route_table(runtime, fleet)
    door = CompletionsDoor(runtime)
    completions = door.routes()
    table.served_elsewhere(completions)
    cors = runtime.config.settings.cors
    return HttpServer({**table.handlers(), **completions}, table.fallback,
                      max_body_bytes=runtime.limits.max_body_bytes, idle_s=idle_s,
                      body_timeout_s=runtime.limits.body_timeout_s, ssl_context=ssl_context,
                      cors=Cors(cors.allow_origins, allow_methods=cors.allow_methods, allow_headers=cors.allow_headers,
                                expose_headers=cors.expose_headers, max_age_s=cors.max_age_s,
                                allow_credentials=cors.allow_credentials) if cors.allow_origins else None,
                      on_refused=door.refused_while_read)
