"""Simulated vision encoder: aligned batches of images, timed by the performance model.

Images queue until a batch is ready: `max_images` images, or the oldest has waited
`batch_timeout_s` (the modality paper's aligned batch, §5.2). Encoding a batch takes
encode(Σ image tokens) on this GPU; each image then becomes a real embedding of
tokens × hidden × dtype bytes, which is delivered straight to the language engine the gateway
chose before the Encode call returns, or, when the request names no engine, returned in the reply.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from heterogate import perf_model
from heterogate.catalog import GpuProfile, ModelProfile
from heterogate.wire import engine_pb2

Deliver = Callable[[str, engine_pb2.Embedding], Awaitable[None]]


@dataclass(eq=False)
class EncodeJob:
    request: engine_pb2.EncodeRequest
    arrival: float
    done: asyncio.Future[engine_pb2.EncodeReply]
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = sum(img.tokens for img in self.request.images)


class VisionExecutor:
    def __init__(
        self,
        model: ModelProfile,
        gpu: GpuProfile,
        deliver: Deliver,
        *,
        time_scale: float = 1.0,
        max_images: int = 32,
        batch_timeout_s: float = 0.05,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        if model.vision is None:
            raise ValueError(f"model {model.name} has no vision encoder")
        self.model, self.gpu = model, gpu
        self._deliver = deliver
        self.time_scale = time_scale
        self.max_images = max_images
        self.batch_timeout_s = batch_timeout_s
        self._on_change = on_change
        self._queue: deque[EncodeJob] = deque()
        self._rng = np.random.default_rng(0)
        self._delivering: set[asyncio.Task[None]] = set()
        self.backlog_tokens = 0
        self.images_encoded = 0
        self.embedding_bytes_sent = 0

    async def encode(self, request: engine_pb2.EncodeRequest) -> engine_pb2.EncodeReply:
        job = EncodeJob(request, time.monotonic(), asyncio.get_running_loop().create_future())
        self._queue.append(job)
        self.backlog_tokens += job.tokens
        self._on_change()
        try:
            return await job.done
        finally:
            if not job.done.done():   # the caller went away: drop the job if it has not started
                job.done.cancel()

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def ready_in(self, now: float) -> float:
        """Seconds until the next batch is ready (0 = ready now); inf when nothing is queued."""
        self._drop_cancelled()
        if not self._queue:
            return float("inf")
        if sum(len(j.request.images) for j in self._queue) >= self.max_images:
            return 0.0
        return max(0.0, self._queue[0].arrival + self.batch_timeout_s * self.time_scale - now)

    async def run_batch(self) -> None:
        batch: list[EncodeJob] = []
        images = 0
        while self._queue and (not batch or images + len(self._queue[0].request.images) <= self.max_images):
            job = self._queue.popleft()
            if job.done.done():
                self.backlog_tokens -= job.tokens
                continue
            batch.append(job)
            images += len(job.request.images)
        if not batch:
            return
        tokens = sum(j.tokens for j in batch)
        start = time.monotonic()
        await asyncio.sleep(perf_model.encode_seconds(self.model, self.gpu, tokens) * self.time_scale)
        encode_s = time.monotonic() - start
        self.backlog_tokens -= tokens
        self.images_encoded += images
        self._on_change()
        for job in batch:   # hand-offs overlap the next batch, as the DMA does on a real GPU
            task = asyncio.create_task(self._finish(job, encode_s))
            self._delivering.add(task)
            task.add_done_callback(self._delivering.discard)

    async def _finish(self, job: EncodeJob, encode_s: float) -> None:
        req = job.request
        t0 = time.monotonic()
        reply = engine_pb2.EncodeReply(image_tokens=job.tokens, encode_s=encode_s)
        try:
            for i, img in enumerate(req.images):
                emb = self.embedding(req.request_id, req.image_index_offset + i, img.tokens)
                if req.deliver_to:
                    await self._deliver(req.deliver_to, emb)
                else:
                    reply.embeddings.append(emb)
                reply.embedding_bytes += len(emb.data)
        except Exception as exc:
            if not job.done.done():
                job.done.set_exception(exc)
            return
        self.embedding_bytes_sent += reply.embedding_bytes
        self._on_change()
        reply.deliver_s = time.monotonic() - t0
        if not job.done.done():
            job.done.set_result(reply)

    def embedding(self, request_id: str, index: int, tokens: int) -> engine_pb2.Embedding:
        """Random 16-bit values with the top exponent bit cleared: finite (|x| < 2) in float16 and bfloat16."""
        words = np.frombuffer(self._rng.bytes(perf_model.embedding_bytes(self.model, tokens)), dtype=np.uint16)
        return engine_pb2.Embedding(
            request_id=request_id, image_index=index, tokens=tokens, hidden=self.model.hidden,
            dtype=self.model.dtype, data=(words & 0xBFFF).tobytes(),
        )

    def _drop_cancelled(self) -> None:
        while self._queue and self._queue[0].done.done():
            self.backlog_tokens -= self._queue.popleft().tokens
