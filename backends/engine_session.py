"""The engine's side of a Session stream: many tagged Generate requests over one gRPC call.

The gateway keeps one Session open per engine and starts each request on it with a tag. Each request
runs as its own task (the same chunks as a Generate call); what the requests produce waits in one
outbox and leaves in as few messages as the stream takes: everything that became ready while the
previous message was being written, or in the loop turn the writer woke in (the other sequences of
one executor step), goes in the next one; each token is still its own chunk. A cancelled tag
cancels its task, which cancels the sequence in the executor (it leaves the batch and frees its KV at
the next step); a stream that breaks cancels all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc
import structlog

from common.wire import engine_pb2

log = structlog.get_logger("engine")


class RequestFailed(Exception):
    """A request ends with this gRPC status: an abort on Generate, a `SessionEnd` on a Session."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(detail)
        self.code, self.detail = code, detail


Generator = Callable[[engine_pb2.GenerateRequest], AsyncGenerator[engine_pb2.GenerateChunk, None]]


async def generate_call(
    generate: Generator, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
) -> AsyncIterator[engine_pb2.GenerateChunk]:
    """A Generate call: the request's chunks, a `RequestFailed` as the call's status."""
    try:
        async with contextlib.aclosing(generate(request)) as chunks:
            async for chunk in chunks:
                yield chunk
    except RequestFailed as exc:
        await context.abort(exc.code, exc.detail)


class EngineSession:
    """One Session call: reads starts and cancels, runs the requests, writes what they produce."""

    def __init__(self, generate: Generator) -> None:
        self._generate = generate
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._chunks: list[engine_pb2.GenerateChunk] = []   # not sent yet, in order per tag
        self._ends: list[engine_pb2.SessionEnd] = []
        self._ready = asyncio.Event()
        self._closing = False   # the gateway closed its side and every request is done

    async def serve(self, context: grpc.aio.ServicerContext, stopping: asyncio.Event | None = None) -> None:
        """Until the gateway closes its side or the engine is `stopping` (then the requests in flight
        finish), or the call ends. A stopping engine ends its sessions itself, within the gRPC server's
        grace: cancelled past it, a session would be logged as an error with a traceback."""
        writer = asyncio.create_task(self._write(context))
        try:
            while (message := await self._read(context, stopping)) is not grpc.aio.EOF:
                for request in message.start:
                    self._tasks[request.tag] = asyncio.create_task(self._run(request))
                for tag in message.cancel:
                    task = self._tasks.pop(tag, None)
                    if task is not None:
                        task.cancel()
            while self._tasks:
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            self._closing = True
            self._ready.set()
            await writer   # writes what is left, then returns
        finally:
            writer.cancel()
            for task in self._tasks.values():
                task.cancel()

    @staticmethod
    async def _read(context: grpc.aio.ServicerContext, stopping: asyncio.Event | None) -> Any:
        """The next message (a SessionRequest), or EOF at the stream's end or once the engine is stopping."""
        if stopping is None:
            return await context.read()
        reading, stopped = asyncio.ensure_future(context.read()), asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait((reading, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if reading.done():
            return reading.result()
        reading.cancel()
        return grpc.aio.EOF

    async def _run(self, request: engine_pb2.GenerateRequest) -> None:
        tag = request.tag
        stream = self._generate(request)
        try:
            async for chunk in stream:
                chunk.tag = tag
                self._chunks.append(chunk)
                self._ready.set()
        except RequestFailed as exc:
            self._end(tag, exc.code, exc.detail)
        except Exception as exc:   # a bug must fail its request, not hang it
            log.exception("session_request_failed", request_id=request.request_id)
            self._end(tag, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            await stream.aclose()   # deterministic: the executor's sequence is cancelled now
            self._tasks.pop(tag, None)

    def _end(self, tag: int, code: grpc.StatusCode, detail: str) -> None:
        self._ends.append(engine_pb2.SessionEnd(tag=tag, code=code.value[0], detail=detail))
        self._ready.set()

    def _take(self) -> engine_pb2.SessionReply:
        reply = engine_pb2.SessionReply(chunks=self._chunks, ends=self._ends)
        self._chunks, self._ends = [], []
        return reply

    async def _write(self, context: grpc.aio.ServicerContext) -> None:
        while not self._closing or self._chunks or self._ends:
            await self._ready.wait()
            await asyncio.sleep(0)   # one loop turn: the other sequences of the step add their chunks
            self._ready.clear()
            if self._chunks or self._ends:
                await context.write(self._take())
