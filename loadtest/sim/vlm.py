"""A simulated GPU of a vision-language deployment: vision encoder, language decoder, or both.

The loop mirrors the engine's `GpuScheduler` (backends/gpu_scheduler.py): vision first, i.e. an
encode batch that is ready runs before the next language step; otherwise a language step runs;
otherwise the GPU sleeps until the pending encode batch times out or new work arrives. An encode
batch is ready at `VISION_BATCH` images or when its oldest image has waited `VISION_TIMEOUT_S` (the
modality paper's aligned batch, §5.2). A stealing vision GPU carries a language batcher of half the
batch cap whose per-step prefill is bounded by the 100 ms episode bound (backends/engine.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common import perf_model
from loadtest.sim.engines import BatchEngine, EngineSpec, Recorder

VISION_BATCH = 32           # images per encode batch (modality paper §5.2 default)
VISION_TIMEOUT_S = 0.05     # an under-filled batch runs once its oldest image waited this long
STEAL_EPISODE_S = 0.1       # modality paper §5.3: bound on one stealing step


@dataclass(slots=True)
class EncodeJob:
    request: int
    images: int
    tokens: int
    target: int                 # index of the engine that runs the language stage
    queued_s: float


@dataclass(slots=True)
class Delivery:
    request: int
    target: int
    source: int


class VlmEngine(BatchEngine):
    """`submit` (language work whose embeddings are here) and `encode` (images) feed one vision-first loop."""

    def __init__(self, spec: EngineSpec, rec: Recorder, index: int) -> None:
        super().__init__(spec, rec)
        self.index = index
        self.vision = spec.role in ("vision", "both")
        self.encode_queue: deque[EncodeJob] = deque()
        self.backlog_tokens = 0
        self.busy = False
        self.version = 0                     # bumps on every new schedule; stale heap entries are skipped
        self._encoding: list[EncodeJob] = []
        self.encode_busy_s = 0.0

    def vision_backlog(self) -> int:
        return self.backlog_tokens

    def acquire(self) -> None:
        """The gateway counts a dispatched request as in flight here at once (before its embeddings)."""
        self.in_flight += 1
        self._snap = None

    def submit(self, i: int, now: float) -> float | None:
        if not self._enqueue(i, now):
            self.in_flight -= 1
            return None
        return self._poke(now)

    def encode(self, job: EncodeJob, now: float) -> float | None:
        self.encode_queue.append(job)
        self.backlog_tokens += job.tokens
        self._snap = None
        return self._poke(now)

    def on_event_deliveries(self, now: float) -> tuple[list[Delivery], float | None]:
        """Finish the current activity (or a wake-up) and pick the next; returns embeddings produced."""
        out: list[Delivery] = []
        if self._encoding:
            out = [Delivery(j.request, j.target, self.index) for j in self._encoding]
            self.backlog_tokens -= sum(j.tokens for j in self._encoding)
            self._encoding = []
        elif self.stepping:
            self._end_step(now)
        self.busy = False
        self._snap = None
        return out, self._next(now)

    def _poke(self, now: float) -> float | None:
        return None if self.busy else self._next(now)

    def _next(self, now: float) -> float | None:
        """Vision first; then a language step; else sleep until the encode batch times out."""
        self.version += 1
        ready_in = self._encode_ready_in(now)
        if ready_in == 0.0:
            return self._start_encode(now)
        if not self.batcher.idle:
            t = self._start_step(now)
            if t is not None:
                self.busy = True
                return t
        return None if ready_in == float("inf") else now + ready_in

    def _encode_ready_in(self, now: float) -> float:
        if not self.encode_queue:
            return float("inf")
        if sum(j.images for j in self.encode_queue) >= VISION_BATCH:
            return 0.0
        return max(0.0, self.encode_queue[0].queued_s + VISION_TIMEOUT_S - now)

    def _start_encode(self, now: float) -> float:
        batch, images = [], 0
        while self.encode_queue and images < VISION_BATCH:
            job = self.encode_queue.popleft()
            batch.append(job)
            images += job.images
        duration = perf_model.encode_seconds(self.model, self.gpu, sum(j.tokens for j in batch))
        self._encoding = batch
        self.encode_busy_s += duration
        self.busy = True
        return now + duration
