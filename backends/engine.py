"""Engine process: serves the Engine gRPC service for one GPU and heartbeats the gateway.

    heterogate-engine --backend-id h100-0 --role language --gpu H100 --model llava-1.5-7b \
        --gateway 127.0.0.1:50061 [--port 0] [--time-scale 1.0] [--executor torch ...]

The executors (simulated or torch, see backends/executor_factory.py) come from an `EngineConfig`.
With --port 0 the engine binds an ephemeral port and reports its address in every heartbeat, so
the gateway never has to guess free ports for the engines it launches.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import structlog

from backends.batcher import SequenceTooLarge
from backends.embedding_store import EmbeddingStore, EmbeddingTimeout
from backends.engine_config import EngineConfig, parse_args
from backends.engine_session import EngineSession, RequestFailed, generate_call
from backends.engine_tracing import EngineTracing
from backends.executor_factory import build_executors
from backends.executors import GenerateInput, InvalidInput, Sampling
from backends.gpu_scheduler import GpuScheduler
from backends.vision_executor import TokenCountMismatch
from common.catalog import GpuProfile, ModelProfile, load_catalog
from common.control_credentials import ControlCredentials
from common.errors import ConfigError
from common.event_loop import run
from common.grpc_keepalive import keepalive
from common.heartbeat_sender import HeartbeatSender, gpu_message
from common.logs import configure_logging
from common.wire import control_pb2, engine_pb2, engine_pb2_grpc

log = structlog.get_logger("engine")

ROLES = {"language": control_pb2.ROLE_LANGUAGE, "vision": control_pb2.ROLE_VISION, "both": control_pb2.ROLE_BOTH}


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateChunk]:
        async for chunk in generate_call(self._engine.generate, request, context):
            yield chunk

    async def Session(
        self, request_iterator: AsyncIterator[engine_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await EngineSession(self._engine.generate).serve(context, self._engine.stopping)

    async def Encode(
        self, request: engine_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EncodeReply:
        vision = self._engine.vision
        if vision is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this engine holds no vision encoder")
            raise AssertionError("abort raises")
        if not request.images:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Encode needs images")
        tracing = self._engine.tracing
        try:
            if tracing is not None and request.traceparent:
                return await tracing.encode(request, vision.encode)
            return await vision.encode(request)
        except grpc.aio.AioRpcError as exc:
            detail = f"delivery to {request.deliver_to} failed: {exc.details()}"
            await context.abort(grpc.StatusCode.UNAVAILABLE, detail)
        except TokenCountMismatch as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except OSError as exc:   # Pillow could not decode an image the gateway let through
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"image could not be decoded: {exc}")
        except InvalidInput as exc:   # the model's preprocessing refused an image the gateway let through
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
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


def generate_input(
    request: engine_pb2.GenerateRequest, prompt_tokens: int, embeddings: list[engine_pb2.Embedding]
) -> GenerateInput:
    sampling = Sampling(
        temperature=request.temperature, top_p=request.top_p or 1.0,
        seed=request.seed if request.HasField("seed") else None, stop=tuple(request.stop),
    )
    return GenerateInput(
        request_id=request.request_id, prompt_tokens=max(1, prompt_tokens), max_tokens=request.max_tokens,
        prompt=request.prompt, token_ids=list(request.token_ids),
        image_spans=[(s.start, s.length) for s in request.image_spans], embeddings=embeddings, sampling=sampling,
        image_grids=[(g[0], g[1], g[2]) for g in (s.grid_thw for s in request.image_spans) if len(g) == 3],
        images=[(k.digest, k.tokens, k.place) for k in request.image_keys], cache_salt=request.cache_salt,
    )


class Engine:
    def __init__(self, config: EngineConfig, model: ModelProfile, gpu: GpuProfile) -> None:
        self.keepalive = keepalive()   # read first: a bad value fails before any weights are loaded
        self.config = config
        self.model, self.gpu = model, gpu
        self.embeddings = EmbeddingStore()
        self.sender = EmbeddingSender()
        self.stopping = asyncio.Event()   # set when it stops serving: its sessions end
        self.language, self.vision = build_executors(config, model, gpu, self.sender.deliver, self._changed)
        self.scheduler = GpuScheduler(self.language, self.vision, stealing=config.role == "vision")
        self.address = ""
        self.tracing = EngineTracing.from_env(config.backend_id)   # None: tracing is off (OTEL_* variables)
        # Cluster token, the identity the launching gateway gave this engine, TLS: from the environment.
        self.heartbeats = HeartbeatSender(config.gateway, self.state, interval_s=config.heartbeat_ms / 1000,
                                          credentials=ControlCredentials.from_env())

    def generate(self, request: engine_pb2.GenerateRequest) -> AsyncGenerator[engine_pb2.GenerateChunk, None]:
        """One request's chunks (a Generate call, or a request on a Session): one per token, or with
        `whole` the first token and then the rest as one. Fails with `RequestFailed`. Inside a span
        joined to the gateway's trace when both trace it."""
        if self.tracing is not None and request.traceparent:
            return self.tracing.generate(request, self._generate(request))
        return self._generate(request)

    async def _generate(self, request: engine_pb2.GenerateRequest) -> AsyncGenerator[engine_pb2.GenerateChunk, None]:
        executor = self.language
        if executor is None:
            raise RequestFailed(grpc.StatusCode.FAILED_PRECONDITION, "this engine holds no language model")
        if request.max_tokens == 0:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1")
        wait_s = 0.0
        embeddings: list[engine_pb2.Embedding] = []
        if request.embedding_count:
            t0 = time.monotonic()
            timeout_s = (request.embedding_timeout_ms or 10_000) / 1000
            try:
                key = request.handoff_key or request.request_id
                embeddings = await self.embeddings.wait(key, request.embedding_count, timeout_s)
            except EmbeddingTimeout as exc:
                raise RequestFailed(grpc.StatusCode.ABORTED, str(exc)) from None
            wait_s = time.monotonic() - t0
        prompt_tokens = len(request.token_ids) or request.prompt_tokens + request.image_tokens
        try:
            count, texts = 0, []
            async for token in executor.generate(generate_input(request, prompt_tokens, embeddings)):
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
                    if token.cached_tokens is not None:
                        chunk.usage.cached_tokens = token.cached_tokens
                yield chunk
        except SequenceTooLarge as exc:
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except InvalidInput as exc:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    def _changed(self) -> None:
        self.scheduler.wake()
        self.heartbeats.poke()

    def state(self) -> control_pb2.BackendState:
        msg = control_pb2.BackendState(
            backend_id=self.config.backend_id,
            role=ROLES[self.config.role],
            address=self.address,
            model=self.model.name,
            gpu=gpu_message(self.gpu),
            steal=self.config.steal,
            pid=os.getpid(),
            steal_episodes=self.scheduler.steal_episodes,
            tokens_stolen=self.scheduler.tokens_stolen,
        )
        if self.language is not None:
            load = self.language.load()
            msg.queue_depth, msg.running = load.waiting, load.running
            msg.kv_free_bytes, msg.kv_total_bytes = load.kv_free_bytes, load.kv_total_bytes
            msg.kv_capacity_source = control_pb2.KV_CAPACITY_SOURCE_ENGINE   # its own KV pool, not a guess
            msg.max_model_len = load.max_model_len
            msg.mean_service_s = load.mean_service_s or 0.0   # the engine's T̄_service (the prior at first)
            msg.tokens_generated = load.tokens_generated
            msg.requests_completed = load.requests_completed
            msg.prefix_cache_queries, msg.prefix_cache_hits = load.prefix_cache_queries, load.prefix_cache_hits
            msg.kv_block_tokens = load.kv_block_tokens
        if self.vision is not None:
            msg.vision_backlog = self.vision.backlog_tokens
            msg.images_encoded = self.vision.images_encoded
            msg.embedding_cache_hits = self.vision.embedding_cache_hits
            msg.embedding_cache_images = self.vision.cache_images
            msg.embedding_bytes_sent = self.vision.embedding_bytes_sent
        return msg

    async def serve(self) -> None:
        # The gateway pings its Session stream even when idle: accept its pings (common/grpc_keepalive.py).
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 << 20),
                                          ("grpc.max_send_message_length", 256 << 20),
                                          *self.keepalive.server_options()])
        engine_pb2_grpc.add_EngineServicer_to_server(EngineService(self), server)
        port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        self.address = f"{self.config.host}:{port}"
        await server.start()
        log.info("engine_started", backend=self.config.backend_id, executor=self.config.executor,
                 address=self.address, gpu=self.gpu.name)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        watches = [_watch_parent(stop)]
        if self.config.orphan_timeout_s is not None:
            watches.append(_exit_when_unheard(stop, self.heartbeats.connected, self.config.orphan_timeout_s))
        tasks = [asyncio.create_task(c) for c in (self.scheduler.run(), self.heartbeats.run(), *watches)]
        await stop.wait()
        for t in tasks[1:]:
            t.cancel()
        self.stopping.set()   # the sessions end what they run and return (the scheduler still steps meanwhile)
        await server.stop(grace=1.0)
        tasks[0].cancel()
        await self.sender.close()


async def _watch_parent(stop: asyncio.Event) -> None:
    """Exit when the launching gateway is gone (killed with SIGKILL it cannot stop us)."""
    parent = os.getppid()
    while os.getppid() == parent:  # noqa: ASYNC110 - polling the parent pid is the point
        await asyncio.sleep(0.2)   # short: a new leader replica waits for orphans to go before relaunching
    stop.set()


async def _exit_when_unheard(stop: asyncio.Event, heard: asyncio.Event, timeout_s: float) -> None:
    """An engine that outlives the gateway replica that launched it (gateway/control/adoption.py) keeps
    serving while some replica takes its heartbeats (`heard`: set while a stream is acknowledged), and
    exits once none has for `timeout_s`: no engine is left holding a GPU after every replica is gone."""
    loop = asyncio.get_running_loop()
    last_heard = loop.time()
    while True:
        if heard.is_set():
            last_heard = loop.time()
        elif loop.time() - last_heard >= timeout_s:
            log.warning("engine_unheard_exiting", unheard_s=round(loop.time() - last_heard, 3))
            stop.set()
            return
        await asyncio.sleep(min(0.2, timeout_s / 4))


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    configure_logging(config.log_level)
    try:
        catalog = load_catalog(config.catalog)
        engine = Engine(config, catalog.model(config.model), catalog.gpu(config.gpu))
    except ConfigError as exc:   # a bad model path or catalog entry: one clear line, no traceback
        raise SystemExit(f"heterogate-engine {config.backend_id}: {exc}") from None
    run(engine.serve())


if __name__ == "__main__":
    main()
