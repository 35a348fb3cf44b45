"""A simulated GPU of a vision-language deployment: vision encoder, language decoder, or both.

The loop runs the engine's own rules (`backends.scheduling`, which backends/gpu_scheduler.py and
backends/vision_executor.py run): vision first, i.e. an encode batch that is ready runs before the
next language step; otherwise a language step runs; otherwise the GPU sleeps until the pending
encode batch times out or new work arrives. An encode batch is ready at the engine's default
`vision_batch` images or when its oldest image has waited `vision_batch_timeout_ms` (the modality
paper's aligned batch, §5.2). A stealing vision GPU carries a language batcher of half the batch cap
whose per-step prefill is bounded by the episode bound (`steal_episode_ms`; `stealing_limits`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from backends.engine_config import EngineConfig
from backends.scheduling import next_activity, ready_in, take_batch
from common import perf_model
from loadtest.sim.engines import BatchEngine, EngineSpec, GatewayState, Recorder

ENGINE_DEFAULTS = EngineConfig(backend_id="", gpu="", model="", gateway="")   # the engine's own defaults
VISION_BATCH = ENGINE_DEFAULTS.vision_batch                           # images per encode batch
VISION_TIMEOUT_S = ENGINE_DEFAULTS.vision_batch_timeout_ms / 1000     # an under-filled batch's longest wait
STEAL_EPISODE_S = ENGINE_DEFAULTS.steal_episode_ms / 1000             # bound on one stealing step


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

    def __init__(self, spec: EngineSpec, rec: Recorder, index: int, gateway: GatewayState | None = None) -> None:
        super().__init__(spec, rec, gateway)
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

    def holds_work(self) -> bool:
        """Whether anything is still to be done here: an activity running, images to encode, language
        work queued or running, or a request leased to it whose embeddings are still to come (a draining
        engine may stop only once this is False)."""
        return self.busy or bool(self.encode_queue or self._encoding or self._leases) or not self.batcher.idle

    def acquire(self, i: int, now: float) -> None:
        """The gateway's lease on request i from its dispatch, before its embeddings come. Taken without
        the request's tokens (no prefill backlog, no KV reservation, no slack): the modality tables of
        docs/BENCHMARKS.md were made so. The gateway's full lease (prompt + image tokens) leaves
        `heteroserve` unchanged and moves `batch_aware` on the split deployments (its P99 E2E at
        moderate load from 2.2 s to 3.3 s; the other cells within their spread over seeds)."""
        self._leases[i] = self.gateway.at(now).acquire(self.id)

    def submit(self, i: int, now: float) -> float | None:
        if not self._enqueue(i, now):
            self.gateway.at(now).release(self._leases.pop(i))
            return None
        return self._poke(now)

    def encode(self, job: EncodeJob, now: float) -> float | None:
        self.encode_queue.append(job)
        self.backlog_tokens += job.tokens
        self.changed = True
        return self._poke(now)

    def on_event_deliveries(self, now: float) -> tuple[list[Delivery], list[int], float | None]:
        """Finish the current activity (or a wake-up) and pick the next; returns the embeddings produced,
        the requests finished and the next event's time."""
        out: list[Delivery] = []
        done: list[int] = []
        if self._encoding:
            out = [Delivery(j.request, j.target, self.index) for j in self._encoding]
            self.backlog_tokens -= sum(j.tokens for j in self._encoding)
            self._encoding = []
        elif self.stepping:
            done = self._end_step(now)
        self.busy = False
        self.changed = True
        return out, done, self._next(now)

    def _poke(self, now: float) -> float | None:
        return None if self.busy else self._next(now)

    def _next(self, now: float) -> float | None:
        """Vision first; then a language step; else sleep until the encode batch times out."""
        self.version += 1
        wait_s = ready_in(self.encode_queue, now, VISION_BATCH, VISION_TIMEOUT_S)
        activity = next_activity(wait_s, not self.batcher.idle)
        if activity == "encode":
            return self._start_encode(now)
        if activity == "language":
            t = self._start_step(now)
            if t is not None:
                self.busy = True
                return t
        return None if wait_s == float("inf") else now + wait_s

    def _start_encode(self, now: float) -> float:
        batch = take_batch(self.encode_queue, VISION_BATCH)
        duration = perf_model.encode_seconds(self.model, self.gpu, sum(j.tokens for j in batch))
        self._encoding = batch
        self.encode_busy_s += duration
        self.busy = True
        return now + duration



class GatewayLeaseEngine(VlmEngine):
    """A vision-language engine whose lease is the live gateway's whole one: prompt + max_tokens are
    reserved from the dispatch, and the prompt's tokens (image tokens included) join the prefill backlog
    and the inter-token slack once its embeddings are here from another engine (at once for a text
    request or a `both` engine's own images), as the live pipeline's `StateTable.inputs_delivered`. The
    planner's predictions need it: the live gateway's policy and overload queue read them."""

    def acquire(self, i: int, now: float) -> None:
        lengths = self.rec.lengths
        self._leases[i] = self.gateway.at(now).acquire(self.id, int(lengths.input_tokens[i]),
                                                       int(lengths.max_output_tokens[i]),
                                                       awaiting_inputs=self.awaits_embeddings(i))

    def awaits_embeddings(self, i: int) -> bool:
        """Request i's images are encoded elsewhere (a `both` engine encodes its own: GPU time ahead of a
        prompt's prefill, counted from the dispatch, as live)."""
        return bool(self.rec.lengths.image_tokens[i]) and self.role != "both"

    def submit(self, i: int, now: float) -> float | None:
        lease = self._leases.get(i)
        if lease is not None:
            self.gateway.at(now).inputs_delivered(lease)
        return super().submit(i, now)
