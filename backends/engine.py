"""Engine process: serves the Engine gRPC service for one (simulated) GPU and heartbeats the gateway.

    heterogate-engine --backend-id h100-0 --role language --gpu H100 --model llava-1.5-7b \
        --gateway 127.0.0.1:50061 [--port 0] [--time-scale 1.0]

With --port 0 the engine binds an ephemeral port and reports its address in every heartbeat, so
the gateway never has to guess free ports for the engines it launches.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import AsyncIterator

import grpc
import structlog

from backends import perf_model
from backends.batcher import SequenceTooLarge
from backends.heartbeat_sender import HeartbeatSender
from backends.sim_executor import SimulatedExecutor
from gateway.catalog import GpuProfile, ModelProfile, load_catalog
from gateway.cli import run
from gateway.logs import configure_logging
from gateway.wire import control_pb2, engine_pb2, engine_pb2_grpc

log = structlog.get_logger("engine")

ROLES = {"language": control_pb2.ROLE_LANGUAGE, "vision": control_pb2.ROLE_VISION, "both": control_pb2.ROLE_BOTH}


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, executor: SimulatedExecutor) -> None:
        self._executor = executor

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateChunk]:
        if request.max_tokens == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1")
        prompt_tokens = request.prompt_tokens + request.image_tokens
        try:
            stream = self._executor.generate(request.request_id, max(1, prompt_tokens), request.max_tokens)
            count = 0
            async for token in stream:
                count += 1
                chunk = engine_pb2.GenerateChunk(text=token.text, index=token.index)
                if token.finish_reason is not None:
                    chunk.finish_reason = token.finish_reason
                    chunk.usage.prompt_tokens = prompt_tokens
                    chunk.usage.completion_tokens = count
                yield chunk
        except SequenceTooLarge as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))


class Engine:
    def __init__(self, args: argparse.Namespace, model: ModelProfile, gpu: GpuProfile) -> None:
        self.args = args
        self.model, self.gpu = model, gpu
        kv = perf_model.kv_capacity_bytes(model, gpu, memory_utilization=args.memory_utilization)
        self.executor = SimulatedExecutor(
            model, gpu, kv, time_scale=args.time_scale, max_batch=args.max_batch, on_change=self._changed
        )
        self.address = ""
        self.heartbeats = HeartbeatSender(args.gateway, self.state, interval_s=args.heartbeat_ms / 1000)

    def _changed(self) -> None:
        self.heartbeats.poke()

    def state(self) -> control_pb2.BackendState:
        b = self.executor.batcher
        return control_pb2.BackendState(
            backend_id=self.args.backend_id,
            role=ROLES[self.args.role],
            address=self.address,
            model=self.model.name,
            gpu=control_pb2.GpuProfile(
                name=self.gpu.name,
                tflops=self.gpu.tflops,
                bandwidth_gbs=self.gpu.bandwidth_gbs,
                hbm_gb=self.gpu.hbm_gb,
                price_per_hour=self.gpu.price_per_hour,
            ),
            queue_depth=len(b.waiting),
            running=len(b.running),
            kv_free_bytes=b.kv_free_bytes,
            kv_total_bytes=b.kv_capacity_bytes,
            mean_service_s=self.executor.mean_service_s,
            tokens_generated=self.executor.tokens_generated,
            requests_completed=self.executor.requests_completed,
            pid=os.getpid(),
        )

    async def serve(self) -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        engine_pb2_grpc.add_EngineServicer_to_server(EngineService(self.executor), server)
        port = server.add_insecure_port(f"{self.args.host}:{self.args.port}")
        self.address = f"{self.args.host}:{port}"
        await server.start()
        log.info("engine_started", backend=self.args.backend_id, address=self.address, gpu=self.gpu.name)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        tasks = [asyncio.create_task(c) for c in (self.executor.run(), self.heartbeats.run(), _watch_parent(stop))]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await server.stop(grace=1.0)


async def _watch_parent(stop: asyncio.Event) -> None:
    """Exit when the launching gateway is gone (killed with SIGKILL it cannot stop us)."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    stop.set()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="heterogate-engine", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--backend-id", required=True)
    p.add_argument("--role", choices=sorted(ROLES), default="language")
    p.add_argument("--gpu", required=True, help="GPU catalog name, e.g. H100")
    p.add_argument("--model", required=True, help="model catalog name, e.g. llava-1.5-7b")
    p.add_argument("--gateway", required=True, help="host:port of the gateway's control (gRPC) service")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every simulated step time by this")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--memory-utilization", type=float, default=perf_model.DEFAULT_MEMORY_UTILIZATION)
    p.add_argument("--heartbeat-ms", type=int, default=200)
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    catalog = load_catalog()
    engine = Engine(args, catalog.model(args.model), catalog.gpu(args.gpu))
    run(engine.serve())


if __name__ == "__main__":
    main()
