"""Runs one gateway process: gRPC server (control + front door), managed engines, HTTP door; stops them in order."""

from __future__ import annotations

import asyncio
import gc
import signal
from dataclasses import dataclass

import grpc
import structlog
import uvicorn

from gateway.config import ClusterConfig
from gateway.grpc_door import add_front_door
from gateway.heartbeat_service import ControlService
from gateway.http_app import create_app
from gateway.runtime import Runtime, build_runtime
from gateway.scrapers import run_scrapers
from gateway.supervisor import Supervisor
from heterogate.wire import control_pb2_grpc

log = structlog.get_logger("gateway")


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50061
    policy: str | None = None
    log_level: str = "info"
    engine_log_level: str = "warning"


async def start_control(runtime: Runtime, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    # The gRPC door's request cap is the HTTP door's body cap (gRPC's own default is 4 MiB).
    max_bytes = runtime.limits.max_body_bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_bytes)])
    service = ControlService(runtime.table, on_heartbeat=runtime.clients.ensure)
    control_pb2_grpc.add_ControlServicer_to_server(service, server)
    await add_front_door(server, runtime)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the control gRPC port {host}:{port}")
    await server.start()
    return server, bound


async def wait_for_engines(runtime: Runtime, supervisor: Supervisor, timeout_s: float) -> None:
    """Log when every managed engine has sent its first heartbeat (or which have not, at the timeout)."""
    ids = [c.spec.id for c in supervisor.children]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        missing = [i for i in ids if (e := runtime.table.get(i)) is None or e.last_heartbeat is None]
        if not missing:
            log.info("engines_ready", count=len(ids))
            return
        if asyncio.get_running_loop().time() > deadline:
            log.error("engines_not_ready", missing=missing, timeout_s=timeout_s)
            return
        await asyncio.sleep(0.05)


async def serve(config: ClusterConfig, options: ServeOptions) -> None:
    runtime = build_runtime(config, options.policy)
    control, grpc_port = await start_control(runtime, options.grpc_host, options.grpc_port)
    supervisor = Supervisor(config, f"{options.grpc_host}:{grpc_port}", log_level=options.engine_log_level)
    supervisor.start()
    app = create_app(runtime)
    # Start-up objects live for the whole run: keep them out of every collection (GC was ~8% of CPU).
    gc.freeze()
    server = uvicorn.Server(uvicorn.Config(
        app, host=options.host, port=options.port, log_level="warning", access_log=False,
        lifespan="off", timeout_graceful_shutdown=int(config.settings.drain_timeout_s),
        timeout_keep_alive=int(config.settings.keep_alive.client_idle_s),
    ))
    server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("gateway_starting", http=f"{options.host}:{options.port}", control=f"{options.grpc_host}:{grpc_port}",
             policy=runtime.pipeline.policy.name, backends=len(config.raw.backends), model=config.served_model_name)
    http = asyncio.create_task(server.serve())
    scrapers = asyncio.create_task(run_scrapers(config, f"{options.grpc_host}:{grpc_port}", stop))
    ready = asyncio.create_task(wait_for_engines(runtime, supervisor, config.settings.engine_start_timeout_s))
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({http, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        log.info("gateway_stopping")
        ready.cancel()
        stop.set()
        server.should_exit = True
        await http
        await scrapers
        await supervisor.stop()
        await control.stop(grace=1.0)
        await runtime.close()
        stopper.cancel()
        log.info("gateway_stopped")
