"""Simulated GPUs in virtual time: the paper's serial engine and the shared continuous batcher.

An engine is driven by two calls: `submit(i, now)` queues request i and, if the GPU was idle, starts
work and returns the time of its next event; `on_event(now)` completes that event and returns the
requests that finished plus the time of the following event (None when the GPU goes idle). Each
engine owns its signals (queue, in-flight, free KV, an EWMA of completed service times) and exposes
them as the router's `BackendSnapshot`, rebuilt lazily only after its state changed. What the
gateway learns from its own requests (prefill backlog, reserved KV, the learned speed of
`common.speed_estimator`) is kept here the same way, from the same first tokens and completions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from backends.batcher import ContinuousBatcher, Sequence, SequenceTooLarge
from common import perf_model
from common.catalog import GpuProfile, ModelProfile
from common.itl_slack import DEFAULT_TARGET_S, InterTokenSlack
from common.service_time import updated_mean_service
from common.speed_estimator import prior_speed
from gateway.routing.policies.contracts import BackendSnapshot, Role
from loadtest.sim.workloads import Lengths


@dataclass(slots=True)
class Recorder:
    """Per-request outcomes, indexed like the trace (NaN / -1 until they happen)."""

    lengths: Lengths
    backend: np.ndarray
    admitted: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    rejected: np.ndarray

    @classmethod
    def for_lengths(cls, lengths: Lengths) -> Recorder:
        n = len(lengths.output_tokens)
        return cls(
            lengths,
            np.full(n, -1, dtype=np.int64),
            np.full(n, np.nan),
            np.full(n, np.nan),
            np.full(n, np.nan),
            np.zeros(n, dtype=bool),
        )


@dataclass(frozen=True, slots=True)
class EngineSpec:
    backend_id: str
    model: ModelProfile
    gpu: GpuProfile
    kv_capacity: int
    prior_service_s: float          # T̄_service before any completion: the performance model's estimate
    role: Role = "language"
    max_batch: int = 256
    max_prefill_tokens: int | None = None   # per-step prefill bound (a stealing vision GPU's episode bound)
    steal: bool = False


class Engine:
    """Signals and snapshot shared by every engine kind."""

    def __init__(self, spec: EngineSpec, rec: Recorder) -> None:
        model, gpu = spec.model, spec.gpu
        self.id, self.model, self.gpu, self.rec, self.role = spec.backend_id, model, gpu, rec, spec.role
        self.kv_capacity = spec.kv_capacity
        self.prior_service_s = spec.prior_service_s
        self.measured_service_s = spec.prior_service_s   # as the engines measure it (common.service_time)
        self.in_flight = 0
        self.speed = prior_speed(model, gpu)
        self.prefilling = self.prefill_backlog = self.kv_reserved = 0
        self._leases: dict[int, tuple[float, int, float | None]] = {}   # request -> (dispatched, ahead, deadline)
        self.slack = InterTokenSlack(DEFAULT_TARGET_S)
        self._snap: BackendSnapshot | None = None
        self._static = dict(
            id=spec.backend_id,
            role=spec.role,
            gpu=gpu.name,
            tflops=gpu.tflops,
            bandwidth_gbs=gpu.bandwidth_gbs,
            price_per_hour=gpu.price_per_hour,
            kv_total_bytes=spec.kv_capacity,
            kv_bytes_per_token=model.kv_bytes_per_token,
            prefill_s_per_token=perf_model.prefill_seconds_per_token(model, gpu),
            weight_bytes=model.weight_bytes,
            encode_s_per_token=perf_model.encode_seconds(model, gpu, 1),
            steal=spec.steal,
        )

    def submit(self, i: int, now: float) -> float | None:
        raise NotImplementedError

    def on_event(self, now: float) -> tuple[list[int], float | None]:
        raise NotImplementedError

    def queue_depth(self) -> int:
        raise NotImplementedError

    def kv_free_bytes(self) -> int:
        raise NotImplementedError

    def vision_backlog(self) -> int:
        return 0

    def snapshot(self) -> BackendSnapshot:
        if self._snap is None:
            self._snap = BackendSnapshot(
                **self._static,  # type: ignore[arg-type]
                queue_depth=max(self.in_flight, self.queue_depth()),
                in_flight=self.in_flight,
                kv_free_bytes=self.kv_free_bytes(),
                vision_backlog=self.vision_backlog(),
                mean_service_s=self.measured_service_s,
                learned_prefill_s_per_token=self.speed.prefill.value,
                decode_step_s=self.speed.decode.value,
                prefilling=self.prefilling,
                prefill_backlog_tokens=self.prefill_backlog,
                kv_reserved_tokens=self.kv_reserved,
                itl_slack_s=self.slack.slacks(),
            )
        return self._snap

    def _lease(self, i: int, now: float) -> None:
        """The router counts request i here from its dispatch (as the gateway's state table does)."""
        lengths = self.rec.lengths
        prompt = int(lengths.input_tokens[i])
        self.in_flight += 1
        self.prefilling += 1
        self.prefill_backlog += prompt
        max_tokens = int(lengths.max_output_tokens[i])
        self.kv_reserved += prompt + max_tokens
        deadline = self.slack.add(prompt, max_tokens, self.speed.prefill.value, self.speed.decode.value)
        self._leases[i] = (now, self.prefill_backlog, deadline)

    def _first_token(self, i: int, now: float) -> None:
        self.rec.first_token[i] = now
        lease = self._leases.get(i)
        if lease is not None:
            self.prefilling -= 1
            self.prefill_backlog -= int(self.rec.lengths.input_tokens[i])
            self.speed.first_token(now - lease[0], lease[1])

    def _finished(self, i: int, now: float) -> None:
        """Record a completion and feed its service time (admission → last token) into T̄_service."""
        self.rec.finish[i] = now
        self.measured_service_s = updated_mean_service(self.measured_service_s, now - self.rec.admitted[i])
        self.in_flight -= 1
        lease = self._leases.pop(i, None)
        if lease is not None:
            self.slack.remove(lease[2])
            lengths = self.rec.lengths
            prompt = int(lengths.input_tokens[i])
            self.kv_reserved -= prompt + int(lengths.max_output_tokens[i])
            self.speed.completed(prompt, int(lengths.output_tokens[i]), now - self.rec.first_token[i])


class SerialEngine(Engine):
    """The capability-weighted paper's GPU: one request at a time, prefill 2·P·L/F then 2·P/B per token."""

    def __init__(self, spec: EngineSpec, rec: Recorder) -> None:
        super().__init__(spec, rec)
        self.queue: deque[int] = deque()
        self.current = -1
        self.prefill_per_token = perf_model.prefill_seconds_per_token(self.model, self.gpu)
        self.decode_per_token = perf_model.serial_decode_seconds_per_token(self.model, self.gpu)
        # When the GPU will have finished everything it holds: FIFO and work-conserving, so this is
        # exact (and bit-identical to the event times the engine later reports).
        self.backlog_end_s = 0.0

    def queue_depth(self) -> int:
        return len(self.queue) + (self.current >= 0)

    def kv_free_bytes(self) -> int:
        if self.current < 0:
            return self.kv_capacity
        lengths = self.rec.lengths
        tokens = int(lengths.input_tokens[self.current] + lengths.max_output_tokens[self.current])
        return self.kv_capacity - perf_model.kv_bytes(self.model, tokens)

    def submit(self, i: int, now: float) -> float | None:
        self._lease(i, now)
        self.queue.append(i)
        self.backlog_end_s = self.finish_s(max(self.backlog_end_s, now), i)
        self._snap = None
        return self._start(now) if self.current < 0 else None

    def finish_s(self, start: float, i: int) -> float:
        """When request i ends if it starts at `start`: prefill 2·P·L/F, then 2·P/B per output token."""
        lengths = self.rec.lengths
        prefill = int(lengths.input_tokens[i]) * self.prefill_per_token
        return start + prefill + int(lengths.output_tokens[i]) * self.decode_per_token

    def on_event(self, now: float) -> tuple[list[int], float | None]:
        done = self.current
        self._finished(done, now)
        self.current = -1
        self._snap = None
        return [done], (self._start(now) if self.queue else None)

    def _start(self, now: float) -> float:
        i = self.current = self.queue.popleft()
        self.rec.admitted[i] = now
        self._first_token(i, now + int(self.rec.lengths.input_tokens[i]) * self.prefill_per_token)
        return self.finish_s(now, i)


class BatchEngine(Engine):
    """Continuous batching with the shared `ContinuousBatcher`; virtual time advances by `step()`'s duration."""

    def __init__(self, spec: EngineSpec, rec: Recorder) -> None:
        super().__init__(spec, rec)
        self.batcher = ContinuousBatcher(
            self.model, self.gpu, self.kv_capacity, max_batch=spec.max_batch, max_prefill_tokens=spec.max_prefill_tokens
        )
        self.stepping = False
        self._step_start = 0.0
        self.step_end_s = 0.0          # end of the running step, whose effects the batcher already holds
        self._result_prefilled: list[Sequence] = []
        self._result_finished: list[Sequence] = []

    def queue_depth(self) -> int:
        return len(self.batcher.waiting) + len(self.batcher.running)

    def kv_free_bytes(self) -> int:
        return self.batcher.kv_free_bytes

    def submit(self, i: int, now: float) -> float | None:
        if not self._enqueue(i, now):
            return None
        self._lease(i, now)
        return None if self.stepping else self._start_step(now)

    def on_event(self, now: float) -> tuple[list[int], float | None]:
        done = self._end_step(now)
        return done, (None if self.batcher.idle else self._start_step(now))

    def _enqueue(self, i: int, now: float) -> bool:
        """Hand request i to the batcher; False (and marked rejected) if its KV could never fit here."""
        lengths = self.rec.lengths
        seq = Sequence(
            str(i), int(lengths.input_tokens[i]), int(lengths.max_output_tokens[i]), int(lengths.output_tokens[i]), now
        )
        try:
            self.batcher.submit(seq)
        except SequenceTooLarge:
            self.rec.rejected[i] = True
            return False
        self._snap = None
        return True

    def _start_step(self, now: float) -> float | None:
        result = self.batcher.step()
        if result.duration_s <= 0.0:
            if not self.batcher.idle:
                raise RuntimeError(f"{self.id}: a step made no progress with work queued")
            return None                    # only cancelled sequences were left
        self.stepping = True
        self._step_start = now
        self.step_end_s = now + result.duration_s
        self._result_prefilled, self._result_finished = result.prefilled, result.finished
        self._snap = None
        return self.step_end_s

    def _end_step(self, now: float) -> list[int]:
        """Stamp the step's first tokens and completions at its end; returns the finished requests."""
        self.stepping = False
        for s in self._result_prefilled:
            i = int(s.id)
            self.rec.admitted[i] = self._step_start
            self._first_token(i, now)
        done = [int(s.id) for s in self._result_finished]
        for i in done:
            self._finished(i, now)
        self._snap = None
        return done
