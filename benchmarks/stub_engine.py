"""A minimal language engine for overhead benchmarks: Generate answers at once, no batcher, no clock.

    python benchmarks/stub_engine.py --backend-id e0 --gateway 127.0.0.1:50061 [--port 0]

It serves the same `heterogate.engine.v1.Engine/Generate` and `Session` as `backends.engine` (max_tokens chunks,
the last one with finish_reason "length" and usage; --tokens-per-chunk groups tokens into fewer
messages) and heartbeats the gateway with the real `HeartbeatSender`, poked on every admission
and completion as the real engine does, so the gateway sees a normal, healthy language backend.
What it leaves out is the simulated GPU: no continuous batcher, no scheduler loop, no per-token
asyncio.Queue hand-off. The engine's own cost then drops to the floor of a Python grpc.aio
server, which is the cleanest baseline a Python engine can give for "gateway minus direct" and
leaves the most of a 2-core machine to the gateway under test.
Prints `address=host:port` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import sys
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from backends.engine_session import EngineSession, RequestFailed, generate_call  # noqa: E402
from common.event_loop import run  # noqa: E402
from common.heartbeat_sender import HeartbeatSender  # noqa: E402
from common.wire import control_pb2, engine_pb2, engine_pb2_grpc  # noqa: E402

_WORDS = ("the", "model", "answers", "with", "simulated", "tokens", "from", "a", "heterogeneous", "cluster")
KV_TOTAL_BYTES = 50 << 30


class StubEngine(engine_pb2_grpc.EngineServicer):
    def __init__(self, backend_id: str, tokens_per_chunk: int = 1) -> None:
        self.backend_id = backend_id
        self.tokens_per_chunk = tokens_per_chunk   # 0: the whole completion in one message
        self.address = ""
        self.running = 0
        self.completed = 0
        self.tokens = 0
        self.heartbeats: HeartbeatSender | None = None

    def _poke(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.poke()

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateChunk]:
        async for chunk in generate_call(self.generate, request, context):
            yield chunk

    async def Session(
        self, request_iterator: AsyncIterator[engine_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await EngineSession(self.generate).serve(context)

    async def generate(self, request: engine_pb2.GenerateRequest) -> AsyncGenerator[engine_pb2.GenerateChunk, None]:
        if request.max_tokens == 0:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1")
        prompt_tokens = request.prompt_tokens + request.image_tokens
        self.running += 1
        self._poke()
        try:
            n, per = request.max_tokens, self.tokens_per_chunk or request.max_tokens
            starts = [0, 1] if request.whole and n > 1 else list(range(0, n, per))   # whole: first token, rest
            for start, end in itertools.pairwise([*starts, n]):
                text = "".join(_WORDS[i % len(_WORDS)] + " " for i in range(start, end))
                chunk = engine_pb2.GenerateChunk(text=text, index=end - 1)
                if end == n:
                    chunk.finish_reason = "length"
                    chunk.usage.prompt_tokens = prompt_tokens
                    chunk.usage.completion_tokens = n
                yield chunk
            self.completed += 1
            self.tokens += request.max_tokens
        finally:
            self.running -= 1
            self._poke()

    def state(self) -> control_pb2.BackendState:
        return control_pb2.BackendState(
            backend_id=self.backend_id, role=control_pb2.ROLE_LANGUAGE, address=self.address,
            running=self.running, kv_free_bytes=KV_TOTAL_BYTES, kv_total_bytes=KV_TOTAL_BYTES,
            tokens_generated=self.tokens, requests_completed=self.completed, pid=os.getpid(),
        )


async def serve(args: argparse.Namespace) -> None:
    engine = StubEngine(args.backend_id, args.tokens_per_chunk)
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    if args.unix:
        engine.address = f"unix:{args.unix}"
        if server.add_insecure_port(engine.address) == 0:
            raise OSError(f"cannot bind {engine.address}")
    else:
        port = server.add_insecure_port(f"{args.host}:{args.port}")
        if port == 0:
            raise OSError(f"cannot bind {args.host}:{args.port}")
        engine.address = f"{args.host}:{port}"
    await server.start()
    engine.heartbeats = HeartbeatSender(args.gateway, engine.state, interval_s=args.heartbeat_ms / 1000)
    print(f"address={engine.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    beats = asyncio.create_task(engine.heartbeats.run())
    await stop.wait()
    beats.cancel()
    await server.stop(grace=0.5)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--backend-id", required=True)
    p.add_argument("--gateway", required=True, help="host:port of the gateway's control (gRPC) service")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--heartbeat-ms", type=int, default=200)
    p.add_argument("--unix", help="listen on this Unix-domain socket path instead of TCP")
    p.add_argument("--tokens-per-chunk", type=int, default=1,
                   help="tokens per GenerateChunk (1 = one message per token, as the real engine; 0 = all in one)")
    run(serve(p.parse_args(argv)))


if __name__ == "__main__":
    main()
