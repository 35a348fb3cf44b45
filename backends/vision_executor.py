"""The vision side of an engine: aligned batches of images, an encoder, and the embedding hand-off.

Images queue until a batch is ready: `max_images` images, or the oldest has waited
`batch_timeout_s` (the modality paper's aligned batch, §5.2; the rules are `backends.scheduling`'s,
which the simulator runs too). The encoder (simulated: the performance
model's encode time and random values; torch: the real vision tower and projector) turns the batch into
one embedding per image, which is delivered straight to the language engine the gateway chose before
the Encode call returns, or, when the request names no engine, returned in the reply.

Embedding cache: the last `cache_images` images' embeddings, keyed by their content hash
(`common.prefix_blocks.content_digest`, the gateway's too) and evicted least recently used first.
An image found there is not encoded again: a batch encodes only the images it does not hold (each
distinct image once), and a request whose images it holds every one of is answered at once, without
waiting for a batch (a cached image was held for the batch window). The engine counts them
(`embedding_cache_hits`, in its heartbeats; `images_cached` in each reply), and the gateway, which
remembers which encoder got which image, prices such a hit as no encode (`encode_cost`). Memory: the
simulated encoder's embeddings hold no payload (made on delivery); a torch encoder's hold their
tensors (a 576-token LLaVA-7B image is ~4.7 MB), so `cache_images` bounds that memory.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from backends.executors import EncodedImage, InvalidInput, VisionEncoder
from backends.scheduling import ready_in, take_batch
from common.prefix_blocks import content_digest, salted_digest
from common.wire import engine_pb2

Deliver = Callable[[str, engine_pb2.Embedding], Awaitable[None]]
JobResult = tuple[list[EncodedImage], list[bool], Exception | None]   # embeddings, cache hits, or its failure
# What one request's image can make an encode fail with (and the engine answers INVALID_ARGUMENT):
# Pillow cannot decode it, or the model's image processor refuses it (backends/torch_vision.py).
INPUT_ERRORS = (OSError, InvalidInput)


@dataclass(eq=False)
class EncodeJob:
    request: engine_pb2.EncodeRequest
    queued_s: float
    done: asyncio.Future[engine_pb2.EncodeReply]
    tokens: int = field(init=False)
    images: int = field(init=False)
    keys: list[int] = field(default_factory=list)   # its images' cache keys (content digest, salted); none: no cache

    def __post_init__(self) -> None:
        self.tokens = sum(img.tokens for img in self.request.images)
        self.images = len(self.request.images)


class TokenCountMismatch(ValueError):
    """The encoder made a different number of tokens than the gateway counted for an image."""


class VisionExecutor:
    def __init__(
        self,
        encoder: VisionEncoder,
        deliver: Deliver,
        *,
        time_scale: float = 1.0,
        max_images: int = 32,
        batch_timeout_s: float = 0.05,
        on_change: Callable[[], None] = lambda: None,
        cache_images: int = 256,
    ) -> None:
        """`cache_images`: embeddings the cache keeps (0: none)."""
        self.encoder = encoder
        self._deliver = deliver
        self.time_scale = time_scale
        self.max_images = max_images
        self.batch_timeout_s = batch_timeout_s
        self._on_change = on_change
        self._queue: deque[EncodeJob] = deque()
        self._delivering: set[asyncio.Task[None]] = set()
        self.backlog_tokens = 0
        self.images_encoded = 0
        self.embedding_bytes_sent = 0
        self.cache_images = max(0, cache_images)
        self._cache: OrderedDict[int, EncodedImage] = OrderedDict()   # content digest -> embedding
        self.embedding_cache_hits = 0

    async def encode(self, request: engine_pb2.EncodeRequest) -> engine_pb2.EncodeReply:
        job = EncodeJob(request, time.monotonic(), asyncio.get_running_loop().create_future())
        self.backlog_tokens += job.tokens
        if self.cache_images:
            job.keys = [salted_digest(content_digest(img.data), request.cache_salt) for img in request.images]
        if job.keys and all(key in self._cache for key in job.keys):
            # every image cached: answered now, not after the batch window (nothing to encode)
            self._settle(job, job.queued_s, (self._cached(job.keys), [True] * job.images, None))
        else:
            self._queue.append(job)
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
        return ready_in(self._queue, now, self.max_images, self.batch_timeout_s * self.time_scale)

    async def run_batch(self) -> None:
        self._drop_cancelled()
        batch = take_batch(self._queue, self.max_images)
        if batch:
            await self._encode_jobs(batch, time.monotonic())

    async def _encode_jobs(self, jobs: list[EncodeJob], start: float) -> None:
        """Encode the jobs as one batch and hand each its embeddings, or what failed it. A batch that one
        request's image fails (`INPUT_ERRORS`: it does not decode, or the model's processor refuses it) is
        encoded again job by job, so that only the requests with the bad image fail, not the others that happened
        to share its batch; each job's result goes out as soon as it exists, not after the rest, and a job whose
        caller has left is not encoded again. Any other failure is the encoder's own (a device error) and would
        fail every job again: it fails the batch at once. A failure fails requests, never the engine."""
        images = [img for job in jobs for img in job.request.images]
        keys = [key for job in jobs for key in job.keys]
        try:
            encoded, hits = await self._encode_uncached(images, keys)
        except INPUT_ERRORS as exc:
            if len(jobs) == 1:
                self._settle(jobs[0], start, ([], [], exc))
                return
            for job in jobs:
                if job.done.done():   # its caller left while the batch ran
                    self._settle(job, start, None)
                else:
                    await self._encode_jobs([job], start)
            return
        except Exception as exc:
            for job in jobs:
                self._settle(job, start, ([], [], exc))
            return
        offset = 0
        for job in jobs:
            self._settle(job, start, (encoded[offset:offset + job.images], hits[offset:offset + job.images], None))
            offset += job.images

    def _settle(self, job: EncodeJob, start: float, result: JobResult | None) -> None:
        """The job leaves the backlog, and its result (None: its caller left, nothing to hand it) is handed to
        it in the background: hand-offs overlap the rest of the batch and the next one, as the DMA does on a
        real GPU."""
        self.backlog_tokens -= job.tokens
        if result is not None:
            encoded, hits, failure = result
            self.images_encoded += len(encoded) - sum(hits)
            self.embedding_cache_hits += sum(hits)
            task = asyncio.create_task(self._finish(job, encoded, failure, time.monotonic() - start, sum(hits)))
            self._delivering.add(task)
            task.add_done_callback(self._delivering.discard)
        self._on_change()

    def _cached(self, keys: list[int]) -> list[EncodedImage]:
        """The cached embeddings of these keys, each now the most recently used."""
        cache = self._cache
        for key in keys:
            cache.move_to_end(key)
        return [cache[key] for key in keys]

    async def _encode_uncached(self, images: list[engine_pb2.Image], keys: list[int]) -> (
        tuple[list[EncodedImage], list[bool]]
    ):
        """The batch's embeddings in order, and which the encoder did not make (found in the cache, or
        the same image as an earlier one of the batch); the encoder runs on the distinct images the
        cache does not hold (not at all when it holds every one). `keys`: the images' cache keys."""
        if not self.cache_images:
            return (await self.encoder.encode_batch(images))[0], [False] * len(images)
        cache = self._cache
        held = {key: cache[key] for key in keys if key in cache}
        missing: dict[int, engine_pb2.Image] = {}
        hits = []   # per image: not run through the encoder (cached, or the same as an earlier one of the batch)
        for key, img in zip(keys, images, strict=True):
            hits.append(key in held or key in missing)
            if not hits[-1]:
                missing[key] = img
        fresh: dict[int, EncodedImage] = {}
        if missing:
            made, _ = await self.encoder.encode_batch(list(missing.values()))
            fresh = dict(zip(missing, made, strict=True))
        out = []
        for key in keys:
            emb = fresh[key] if key in fresh else held[key]
            cache[key] = emb
            cache.move_to_end(key)
            out.append(emb)
        while len(cache) > self.cache_images:
            cache.popitem(last=False)
        return out, hits

    async def _finish(
        self, job: EncodeJob, encoded: list[EncodedImage], failure: Exception | None, encode_s: float, cached: int,
    ) -> None:
        req = job.request
        t0 = time.monotonic()
        reply = engine_pb2.EncodeReply(image_tokens=job.tokens, encode_s=encode_s, images_cached=cached)
        try:
            if failure is not None:
                raise failure
            for i, (img, enc) in enumerate(zip(req.images, encoded, strict=True)):
                if enc.tokens != img.tokens:
                    raise TokenCountMismatch(
                        f"image {req.image_index_offset + i}: the encoder made {enc.tokens} tokens but the gateway "
                        f"counted {img.tokens} (the gateway's model catalog does not match this engine's model)"
                    )
                emb = engine_pb2.Embedding(
                    request_id=req.request_id, image_index=req.image_index_offset + i, tokens=enc.tokens,
                    hidden=enc.hidden, dtype=enc.dtype, data=enc.payload(),
                )
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

    def _drop_cancelled(self) -> None:
        """Drop the jobs whose callers went away, wherever they wait in the queue."""
        if any(j.done.done() for j in self._queue):
            self.backlog_tokens -= sum(j.tokens for j in self._queue if j.done.done())
            self._queue = deque(j for j in self._queue if not j.done.done())
