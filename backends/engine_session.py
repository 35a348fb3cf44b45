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
        self._stopping = False  # the engine stops: the session ends what it runs and returns

    async def serve(self, context: grpc.aio.ServicerContext, stopping: asyncio.Event | None = None) -> None:
        """Until the gateway closes its side (then the requests in flight finish) or the call ends; or
        until the engine is `stopping`: then each request in flight ends with UNAVAILABLE (the gateway
        retries one that has sent no token elsewhere) and the session returns, before the gRPC server's
        grace runs out (cancelled by the server, a session is logged as an error with a traceback)."""
        this = asyncio.current_task()
        assert this is not None
        writer = asyncio.create_task(self._write(context))
        watcher = asyncio.create_task(self._stop_on(stopping, this)) if stopping is not None else None
        try:
            try:
                await self._serve(context)
            except asyncio.CancelledError:
                if not self._stopping or this.uncancel() > 0:   # the call ended, or the gateway's loop went
                    raise
                await self._end_all(grpc.StatusCode.UNAVAILABLE, "the engine is stopping")
            if watcher is not None:   # from here the session only writes what is left
                watcher.cancel()
            self._closing = True
            self._ready.set()
            await writer   # writes what is left, then returns
        finally:
            writer.cancel()
            if watcher is not None:
                watcher.cancel()
            for task in self._tasks.values():
                task.cancel()

    async def _serve(self, context: grpc.aio.ServicerContext) -> None:
        while (message := await context.read()) is not grpc.aio.EOF:
            for request in message.start:
                self._tasks[request.tag] = asyncio.create_task(self._run(request))
            for tag in message.cancel:
                task = self._tasks.pop(tag, None)
                if task is not None:
                    task.cancel()
        while self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _stop_on(self, stopping: asyncio.Event, session: asyncio.Task[Any]) -> None:
        await stopping.wait()
        self._stopping = True
        session.cancel()

    async def _end_all(self, code: grpc.StatusCode, detail: str) -> None:
        """End every request in flight with this status (their sequences cancelled in the executor)."""
        tasks = dict(self._tasks)
        for tag, task in tasks.items():
            task.cancel()
            self._end(tag, code, detail)
        await asyncio.gather(*tasks.values(), return_exceptions=True)

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
