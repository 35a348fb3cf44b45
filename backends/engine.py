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
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from backends.batcher import SequenceTooLarge
from backends.embedding_store import EmbeddingStore, EmbeddingTimeout
from backends.gpu_scheduler import GpuScheduler
from backends.sim_executor import SimulatedExecutor
from backends.vision_executor import VisionExecutor
from heterogate import perf_model
from heterogate.catalog import GpuProfile, ModelProfile, load_catalog
from heterogate.event_loop import run
from heterogate.heartbeat_sender import HeartbeatSender, gpu_message
from heterogate.logs import configure_logging
from heterogate.wire import control_pb2, engine_pb2, engine_pb2_grpc

log = structlog.get_logger("engine")

ROLES = {"language": control_pb2.ROLE_LANGUAGE, "vision": control_pb2.ROLE_VISION, "both": control_pb2.ROLE_BOTH}


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateChunk]:
        executor = self._engine.language
        if executor is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this engine holds no language model")
            return
        if request.max_tokens == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1")
        wait_s = 0.0
        if request.embedding_count:
            t0 = time.monotonic()
            timeout_s = (request.embedding_timeout_ms or 10_000) / 1000
            try:
                key = request.handoff_key or request.request_id
                await self._engine.embeddings.wait(key, request.embedding_count, timeout_s)
            except EmbeddingTimeout as exc:
                await context.abort(grpc.StatusCode.ABORTED, str(exc))
            wait_s = time.monotonic() - t0
        prompt_tokens = request.prompt_tokens + request.image_tokens
        try:
            count, texts = 0, []
            async for token in executor.generate(request.request_id, max(1, prompt_tokens), request.max_tokens):
                count += 1
                # whole: the first token (it proves the engine alive), then the rest in one message
                if request.whole and count > 1:
                    texts.append(token.text)
                    if token.finish_reason is None:
                        continue
                chunk = engine_pb2.GenerateChunk(text="".join(texts) if texts else token.text, index=token.index)
                if count == 1:
                    chunk.embedding_wait_s = wait_s
                if token.finish_reason is not None:
                    chunk.finish_reason = token.finish_reason
                    chunk.usage.prompt_tokens = prompt_tokens
                    chunk.usage.completion_tokens = count
                yield chunk
        except SequenceTooLarge as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    async def Encode(
        self, request: engine_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EncodeReply:
        vision = self._engine.vision
        if vision is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this engine holds no vision encoder")
            raise AssertionError("abort raises")
        if not request.images:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Encode needs images")
        try:
            return await vision.encode(request)
        except grpc.aio.AioRpcError as exc:
            detail = f"delivery to {request.deliver_to} failed: {exc.details()}"
            await context.abort(grpc.StatusCode.UNAVAILABLE, detail)
        raise AssertionError("unreachable")

    async def DeliverEmbedding(
        self, request: engine_pb2.Embedding, context: grpc.aio.ServicerContext
    ) -> engine_pb2.DeliverReply:
        if self._engine.language is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this engine holds no language model")
        self._engine.embeddings.put(request)
        return engine_pb2.DeliverReply(accepted=True)


class EmbeddingSender:
    """Vision side of the hand-off: one pooled channel per language engine address."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self._stubs: dict[str, engine_pb2_grpc.EngineStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._timeout_s = timeout_s

    async def deliver(self, address: str, embedding: engine_pb2.Embedding) -> None:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 256 << 20)])
            self._channels.append(channel)
            stub = self._stubs[address] = engine_pb2_grpc.EngineStub(channel)
        await stub.DeliverEmbedding(embedding, timeout=self._timeout_s)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels))


class Engine:
    def __init__(self, args: argparse.Namespace, model: ModelProfile, gpu: GpuProfile) -> None:
        self.args = args
        self.model, self.gpu = model, gpu
        role, steal = args.role, args.steal
        self.embeddings = EmbeddingStore()
        self.sender = EmbeddingSender()
        self.language: SimulatedExecutor | None = None
        self.vision: VisionExecutor | None = None
        if role in ("vision", "both"):
            self.vision = VisionExecutor(
                model, gpu, self.sender.deliver, time_scale=args.time_scale, max_images=args.vision_batch,
                batch_timeout_s=args.vision_batch_timeout_ms / 1000, on_change=self._changed,
            )
        if role in ("language", "both") or steal:
            kv = perf_model.kv_capacity_bytes(
                model, gpu, memory_utilization=args.memory_utilization, encoder_loaded=self.vision is not None
            )
            max_batch, prefill_budget = args.max_batch, None
            if role == "vision":   # stealing: half batch, each step's prefill within the episode bound
                max_batch = max(1, args.max_batch // 2)
                prefill_budget = int(args.steal_episode_ms / 1000 / perf_model.prefill_seconds_per_token(model, gpu))
            self.language = SimulatedExecutor(
                model, gpu, kv, time_scale=args.time_scale, max_batch=max_batch,
                max_prefill_tokens=prefill_budget, on_change=self._changed,
            )
        self.scheduler = GpuScheduler(self.language, self.vision, stealing=role == "vision")
        self.address = ""
        self.heartbeats = HeartbeatSender(args.gateway, self.state, interval_s=args.heartbeat_ms / 1000)

    def _changed(self) -> None:
        self.scheduler.wake()
        self.heartbeats.poke()

    def state(self) -> control_pb2.BackendState:
        msg = control_pb2.BackendState(
            backend_id=self.args.backend_id,
            role=ROLES[self.args.role],
            address=self.address,
            model=self.model.name,
            gpu=gpu_message(self.gpu),
            steal=self.args.steal,
            pid=os.getpid(),
            steal_episodes=self.scheduler.steal_episodes,
            tokens_stolen=self.scheduler.tokens_stolen,
        )
        if self.language is not None:
            b = self.language.batcher
            msg.queue_depth, msg.running = len(b.waiting), len(b.running)
            msg.kv_free_bytes, msg.kv_total_bytes = b.kv_free_bytes, b.kv_capacity_bytes
            msg.kv_capacity_source = control_pb2.KV_CAPACITY_SOURCE_ENGINE   # its own block pool, not a guess
            msg.max_model_len = self.model.max_context
            msg.mean_service_s = self.language.measured_service_s or 0.0   # 0: no sample yet
            msg.tokens_generated = self.language.tokens_generated
            msg.requests_completed = self.language.requests_completed
        if self.vision is not None:
            msg.vision_backlog = self.vision.backlog_tokens
            msg.images_encoded = self.vision.images_encoded
            msg.embedding_bytes_sent = self.vision.embedding_bytes_sent
        return msg

    async def serve(self) -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 << 20),
                                          ("grpc.max_send_message_length", 256 << 20)])
        engine_pb2_grpc.add_EngineServicer_to_server(EngineService(self), server)
        port = server.add_insecure_port(f"{self.args.host}:{self.args.port}")
        self.address = f"{self.args.host}:{port}"
        await server.start()
        log.info("engine_started", backend=self.args.backend_id, address=self.address, gpu=self.gpu.name)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        tasks = [asyncio.create_task(c) for c in (self.scheduler.run(), self.heartbeats.run(), _watch_parent(stop))]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await server.stop(grace=1.0)
        await self.sender.close()


async def _watch_parent(stop: asyncio.Event) -> None:
    """Exit when the launching gateway is gone (killed with SIGKILL it cannot stop us)."""
    parent = os.getppid()
    while os.getppid() == parent:  # noqa: ASYNC110 - polling the parent pid is the point
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
    p.add_argument("--steal", action="store_true", help="vision engine: load the decoder and steal language work")
    p.add_argument("--steal-episode-ms", type=float, default=100.0, help="bound on one stealing step")
    p.add_argument("--vision-batch", type=int, default=32, help="aligned encode batch: images")
    p.add_argument("--vision-batch-timeout-ms", type=float, default=50.0, help="aligned encode batch: wait")
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
