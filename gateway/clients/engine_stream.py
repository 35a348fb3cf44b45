"""The gateway's side of an engine's Session: one long-lived gRPC stream carrying every request to it.

A request is a tag on the stream: `start` queues its GenerateRequest and returns an `Inbox` that the
reader fills with the chunks the engine sends under that tag. One writer task sends everything queued
while the previous write was in flight, and in the loop turn it woke in, as one message (starts and
cancels of many requests: requests parsed from one read of the sockets start in the same turn), and
one reader task hands out what every reply carries. Per request that is no call object, no metadata, no
per-call thread hops: a dictionary entry, a list append and a future.

Failure: when the stream ends or breaks, every request on it fails with the stream's status and the
next `start` opens a new stream (the channel reconnects on its own). Deadlines are timers on the
event loop: the first token's, then the whole request's; one that fires fails its request with
DEADLINE_EXCEEDED and cancels it on the engine, as a gRPC deadline did.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

import grpc
import structlog

from common.wire import engine_pb2, engine_pb2_grpc

log = structlog.get_logger("gateway")

Status = tuple[grpc.StatusCode, str]
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class Inbox:
    """One request's chunks, in order, then its end: the last chunk (finish reason) or a failure."""

    __slots__ = ("_chunks", "_waiter", "ended", "failure", "first_token_timeout", "started", "timer")

    def __init__(self) -> None:
        self._chunks: deque[engine_pb2.GenerateChunk] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.failure: Status | None = None
        self.started = False          # a chunk has been handed out: failures are no longer retryable
        self.ended = False            # the last chunk arrived: nothing to cancel on the engine
        self.first_token_timeout = False
        self.timer: asyncio.TimerHandle | None = None   # the first token's deadline, then the request's

    @property
    def waiting(self) -> bool:
        """Chunks have arrived that are not handed out yet."""
        return bool(self._chunks)

    def put(self, chunk: engine_pb2.GenerateChunk) -> None:
        self._chunks.append(chunk)
        if chunk.finish_reason:
            self.ended = True
        self._wake()

    def fail(self, status: Status) -> None:
        if self.failure is None:
            self.failure = status
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> engine_pb2.GenerateChunk:
        """The next chunk; raises `Failed` once the request failed and its chunks are handed out."""
        while not self._chunks:
            if self.failure is not None:
                raise Failed(*self.failure)
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        self.started = True
        return self._chunks.popleft()


class Failed(Exception):
    """A request on the stream ended with this status (from the engine, the stream or a deadline)."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(detail)
        self.code, self.detail = code, detail


class _Link:
    """One Session call and what waits to be written on it."""

    __slots__ = ("call", "cancels", "open", "starts", "wake")

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.wake = asyncio.Event()
        self.starts: list[engine_pb2.GenerateRequest] = []
        self.cancels: list[int] = []
        self.open = True

    def cancel(self, tag: int) -> None:
        self.cancels.append(tag)
        self.wake.set()


class EngineStream:
    """The Session of one engine address, opened on first use and again after a failure."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self._stub = stub
        self._tags = itertools.count(1)
        self._inboxes: dict[int, Inbox] = {}
        self._link: _Link | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, request: engine_pb2.GenerateRequest, first_token_s: float, timeout_s: float) -> tuple[int, Inbox]:
        """Queue a request; its chunks arrive in the returned inbox, under the returned tag."""
        link = self._link or self._open()
        tag = request.tag = next(self._tags)
        inbox = self._inboxes[tag] = Inbox()
        link.starts.append(request)
        link.wake.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if first_token_s < timeout_s:
            inbox.timer = loop.call_at(loop.time() + first_token_s, self._first_token_due, tag, deadline)
        else:
            inbox.timer = loop.call_at(deadline, self._expire, tag, "deadline exceeded")
        return tag, inbox

    def finish(self, tag: int) -> None:
        """The request's reader is done with it: if the engine may still be working on it, cancel it there."""
        inbox = self._inboxes.pop(tag, None)
        if inbox is None:
            return
        if inbox.timer is not None:
            inbox.timer.cancel()
        if not inbox.ended and inbox.failure is None and self._link is not None:
            self._link.cancel(tag)

    def _first_token_due(self, tag: int, deadline: float) -> None:
        inbox = self._inboxes.get(tag)
        if inbox is None:
            return
        if inbox.started or inbox.waiting:
            inbox.timer = asyncio.get_running_loop().call_at(deadline, self._expire, tag, "deadline exceeded")
        else:
            inbox.first_token_timeout = True
            self._expire(tag, "no first token in time")

    def _expire(self, tag: int, detail: str) -> None:
        inbox = self._inboxes.get(tag)
        if inbox is not None and not inbox.ended:
            inbox.timer = None
            inbox.fail((grpc.StatusCode.DEADLINE_EXCEEDED, detail))
            if self._link is not None:
                self._link.cancel(tag)

    def _open(self) -> _Link:
        link = self._link = _Link(self._stub.Session())
        for job in (self._write(link), self._read(link)):
            task = asyncio.create_task(job)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return link

    async def _write(self, link: _Link) -> None:
        try:
            while True:
                await link.wake.wait()
                await asyncio.sleep(0)   # one loop turn: requests started in this turn go in the same message
                link.wake.clear()
                if not link.open:
                    return
                message = engine_pb2.SessionRequest(start=link.starts, cancel=link.cancels)
                link.starts, link.cancels = [], []
                await link.call.write(message)
        except Exception as exc:   # the call ended under the write: the reader sees why, or this is it
            self._broken(link, (grpc.StatusCode.UNAVAILABLE, f"stream write failed: {exc}"))

    async def _read(self, link: _Link) -> None:
        inboxes = self._inboxes
        try:
            while (reply := await link.call.read()) is not grpc.aio.EOF:
                for chunk in reply.chunks:
                    inbox = inboxes.get(chunk.tag)
                    if inbox is not None:
                        inbox.put(chunk)
                for end in reply.ends:
                    inbox = inboxes.get(end.tag)
                    if inbox is not None:
                        inbox.fail((_CODES.get(end.code, grpc.StatusCode.UNKNOWN), end.detail))
            status: Status = (grpc.StatusCode.UNAVAILABLE, "the engine ended the stream")
        except grpc.aio.AioRpcError as exc:
            status = (exc.code(), exc.details() or "stream failed")
        except asyncio.CancelledError:
            self._broken(link, (grpc.StatusCode.CANCELLED, "stream closed"))
            raise
        self._broken(link, status)

    def _broken(self, link: _Link, status: Status) -> None:
        """Fail every request on this stream; the next start opens a new one."""
        if not link.open:
            return
        link.open = False
        link.call.cancel()
        link.wake.set()   # the writer sees the link closed and returns
        if self._link is link:
            self._link = None
        if self._inboxes and status[0] != grpc.StatusCode.CANCELLED:
            log.warning("engine_stream_failed", code=status[0].name, detail=status[1], requests=len(self._inboxes))
        for inbox in self._inboxes.values():
            inbox.fail(status)

    async def close(self) -> None:
        if self._link is not None:
            self._broken(self._link, (grpc.StatusCode.CANCELLED, "the gateway is closing the stream"))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
