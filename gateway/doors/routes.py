"""The HTTP front door: the completions routes on the door's own server (`completions_door`), the rest on FastAPI.

Every error leaves through `error_response`, so clients always get an OpenAI-shaped body, never a
stack trace.
"""

from __future__ import annotations

import ssl
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.control.fleet import Fleet
from gateway.doors.completions import CompletionsDoor, error_headers
from gateway.doors.dashboard import add_dashboard
from gateway.doors.fleet_routes import add_fleet_routes
from gateway.doors.http_server import HttpServer
from gateway.doors.jobs import JobBuilder
from gateway.doors.request_ids import new_request_id
from gateway.requests.errors import RequestError, http_error, openai_error_body
from gateway.runtime import Runtime


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def error_response(err: RequestError, request_id: str) -> Response:
    headers = {k.decode(): v.decode() for k, v in error_headers(err, request_id)}
    return json_response(openai_error_body(err), err.status, headers)


def request_id_of(request: Request) -> str:
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        rid = new_request_id(request.headers.get("x-request-id"))
        request.state.request_id = rid
    return str(rid)


def create_app(runtime: Runtime, fleet: Fleet | None = None) -> FastAPI:
    app = FastAPI(title="HeteroGate", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.runtime = runtime
    jobs = JobBuilder(runtime)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> Response:
        return error_response(exc, request_id_of(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(http_error(exc.status_code, str(exc.detail)), request_id_of(request))

    def authorize(request: Request, *, admin: bool = False) -> None:
        runtime.keys.check(request.headers.get("authorization"), admin=admin)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        return json_response({"object": "list", "data": runtime.model_cards()})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        authorize(request)
        return json_response(runtime.model_card(jobs.check_model(model_id).name))

    # Probes and load balancers may ask with HEAD: the same status, no body (the server drops it).
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready() -> Response:
        state = runtime.readiness()
        return json_response(state, 200 if state["ready"] else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        authorize(request, admin=True)
        return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/admin/backends")
    async def admin_backends(request: Request) -> Response:
        authorize(request, admin=True)
        return json_response({"object": "list", "data": runtime.describe_backends()})

    if fleet is not None:
        add_fleet_routes(app, runtime, fleet, authorize, json_response)

    @app.get("/admin/usage")
    async def admin_usage(request: Request) -> Response:
        """Per tenant: policy, current windows (every replica's, with Redis), this process's counters."""
        authorize(request, admin=True)
        return json_response({"object": "list", "data": await runtime.pipeline.tenants.usage()})

    add_dashboard(app)
    return app


def create_server(runtime: Runtime, idle_s: float, ssl_context: ssl.SSLContext | None = None,
                  fleet: Fleet | None = None) -> HttpServer:
    """The front door: the completions routes natively, the FastAPI app for the rest (with `fleet`, the
    admin routes that change the fleet at runtime)."""
    return HttpServer(CompletionsDoor(runtime).routes(), create_app(runtime, fleet),  # type: ignore[arg-type]
                      max_body_bytes=runtime.limits.max_body_bytes, idle_s=idle_s,
                      body_timeout_s=runtime.limits.body_timeout_s, ssl_context=ssl_context)
