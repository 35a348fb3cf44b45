"""Simulated GPUs in virtual time: the paper's serial engine and the shared continuous batcher.

An engine is driven by two calls: `submit(i, now)` queues request i and, if the GPU was idle, starts
work and returns the time of its next event; `on_event(now)` completes that event and returns the
requests that finished plus the time of the following event (None when the GPU goes idle). Each
engine owns what an engine reports (queue, batch, free KV, an EWMA of completed service times) and
reports it to the gateway's own state core (`gateway.routing.state_table.StateTable`, one per run,
on the virtual clock), which keeps what the gateway learns from its requests (leases, prefill
backlog, reserved KV, learned speed, inter-token slacks) and builds the router's `BackendSnapshot`s:
the simulator routes on the live table's snapshots, not on a copy of them.

With `EngineSpec.prefix_caching` a continuous-batching engine keeps the simulated engines' prefix
cache (`common.prefix_blocks.EnginePrefixCache` in `backends.batcher`: running sequences' blocks
pinned, the others cached in the free KV and evicted least recently used first, prefill charged for
the uncached tokens only) on the trace's block hashes (`Lengths.blocks`), and reports vLLM's
query / hit counters in its heartbeats, as the managed simulated engines do.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from backends.batcher import ContinuousBatcher, Sequence, SequenceTooLarge
from common import perf_model
from common.catalog import GpuProfile, ModelProfile
from common.prefix_blocks import EnginePrefixCache
from common.service_time import updated_mean_service
from gateway.routing.backend_entry import Lease, Reported
from gateway.routing.policies.contracts import BackendSnapshot, Role
from gateway.routing.state_table import StateTable
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
    external: bool = False          # an engine the gateway scrapes (kind: openai): it reports no T̄_service
    prefix_caching: bool = False    # continuous batching: a prefix cache on the trace's blocks


class GatewayState:
    """The live gateway's state core on the simulator's virtual clock: one `StateTable` for a run's
    engines, with its leases, learned speed and inter-token slacks, and the snapshots it builds.

    Engines report their own figures (queue, batch, free KV, T̄_service, vision backlog) to it as
    heartbeats, by default exact and fresh: each engine reports before any decision that follows a
    change of its state (`refresh`), so the router never sees stale signals; `report_interval_s`
    spaces the reports as heartbeats or scrapes are spaced.
    """

    def __init__(self, model: ModelProfile, report_interval_s: float = 0.0) -> None:
        self.now = 0.0
        self.table = StateTable(model, float("inf"), clock=self._clock)
        self.engines: list[Engine] = []
        self.report_interval_s = report_interval_s

    def _clock(self) -> float:
        return self.now

    def at(self, now: float) -> StateTable:
        """The table, its clock set to `now` (every lease event happens at its own time)."""
        self.now = now
        return self.table

    def refresh(self, now: float) -> StateTable:
        """Every engine whose state changed reports (at most once per report interval: with an interval,
        what the router reads is up to that old, as a heartbeat's or a scrape's is); returns the table at
        `now`, ready for a decision."""
        interval = self.report_interval_s
        for e in self.engines:
            if e.changed and now - e.reported_s >= interval:
                e.report(now)
        return self.at(now)


class Engine:
    """One simulated GPU, registered in the run's `GatewayState` (a table of its own when none is given)."""

    def __init__(self, spec: EngineSpec, rec: Recorder, gateway: GatewayState | None = None) -> None:
        model, gpu = spec.model, spec.gpu
        self.id, self.model, self.gpu, self.rec, self.role = spec.backend_id, model, gpu, rec, spec.role
        self.kv_capacity = spec.kv_capacity
        self.prior_service_s = spec.prior_service_s
        self.measured_service_s = spec.prior_service_s   # as the engines measure it (common.service_time)
        self.gateway = gateway or GatewayState(model)
        self.entry = self.gateway.table.register(spec.backend_id, spec.role, gpu, address=spec.backend_id,
                                                 managed=False, steal=spec.steal, external=spec.external)
        self.gateway.engines.append(self)
        self._leases: dict[int, Lease] = {}
        self._seq = 0
        self.changed = True
        self.reported_s = float("-inf")

    def submit(self, i: int, now: float, cached: int = 0) -> float | None:
        """`cached`: prompt tokens the router predicts cached here (its lease counts the rest as prefill)."""
        raise NotImplementedError

    def on_event(self, now: float) -> tuple[list[int], float | None]:
        raise NotImplementedError

    def load(self) -> tuple[int, int]:
        """(waiting, running), as an engine's heartbeat reports them."""
        raise NotImplementedError

    def queue_depth(self) -> int:
        return sum(self.load())

    def kv_free_bytes(self) -> int:
        raise NotImplementedError

    def vision_backlog(self) -> int:
        return 0

    def prefix_counters(self) -> tuple[int, int]:
        """The prefix cache's (queries, hits) in tokens, cumulative; (0, 0): no cache."""
        return 0, 0

    def report(self, now: float) -> None:
        """A heartbeat with the engine's figures now."""
        self._seq += 1
        waiting, running = self.load()
        queries, hits = self.prefix_counters()
        self.gateway.at(now).apply_heartbeat(self.id, self._seq, self.id, Reported(
            seq=self._seq, waiting=waiting, running=running, kv_free_bytes=self.kv_free_bytes(),
            kv_total_bytes=self.kv_capacity, vision_backlog=self.vision_backlog(),
            mean_service_s=0.0 if self.entry.external else self.measured_service_s, kv_source="engine",
            prefix_cache_queries=queries, prefix_cache_hits=hits))
        self.changed = False
        self.reported_s = now

    def snapshot(self) -> BackendSnapshot:
        """The state table's snapshot of this backend, after a report if the engine's state changed."""
        if self.changed:
            self.report(self.gateway.now)
        return self.gateway.table.snapshot(self.entry)

    def _lease(self, i: int, now: float, cached: int = 0) -> None:
        """The router counts request i here from its dispatch: the state table's lease, as the gateway takes it."""
        lengths = self.rec.lengths
        prompt = int(lengths.input_tokens[i])
        self._leases[i] = self.gateway.at(now).acquire(self.id, prompt, int(lengths.max_output_tokens[i]), cached)

    def _first_token(self, i: int, now: float) -> None:
        self.rec.first_token[i] = now
        lease = self._leases.get(i)
        if lease is not None:
            self.gateway.at(now).first_token(lease)

    def _finished(self, i: int, now: float) -> None:
        """Record a completion and feed its service time (admission → last token) into T̄_service."""
        self.rec.finish[i] = now
        self.measured_service_s = updated_mean_service(self.measured_service_s, now - self.rec.admitted[i])
        self.changed = True
        lease = self._leases.pop(i, None)
        if lease is not None:
            self.gateway.at(now).release(lease, int(self.rec.lengths.output_tokens[i]))


class SerialEngine(Engine):
    """The capability-weighted paper's GPU: one request at a time, prefill 2·P·L/F then 2·P/B per token."""

    def __init__(self, spec: EngineSpec, rec: Recorder, gateway: GatewayState | None = None) -> None:
        super().__init__(spec, rec, gateway)
        self.queue: deque[int] = deque()
        self.current = -1
        self.prefill_per_token = perf_model.prefill_seconds_per_token(self.model, self.gpu)
        self.decode_per_token = perf_model.serial_decode_seconds_per_token(self.model, self.gpu)
        # When the GPU will have finished everything it holds: FIFO and work-conserving, so this is
        # exact (and bit-identical to the event times the engine later reports).
        self.backlog_end_s = 0.0

    def load(self) -> tuple[int, int]:
        return len(self.queue), int(self.current >= 0)

    def kv_free_bytes(self) -> int:
        if self.current < 0:
            return self.kv_capacity
        lengths = self.rec.lengths
        tokens = int(lengths.input_tokens[self.current] + lengths.max_output_tokens[self.current])
        return self.kv_capacity - perf_model.kv_bytes(self.model, tokens)

    def submit(self, i: int, now: float, cached: int = 0) -> float | None:
        self._lease(i, now, cached)
        self.queue.append(i)
        self.backlog_end_s = self.finish_s(max(self.backlog_end_s, now), i)
        self.changed = True
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
        self.changed = True
        return [done], (self._start(now) if self.queue else None)

    def _start(self, now: float) -> float:
        i = self.current = self.queue.popleft()
        self.rec.admitted[i] = now
        self._first_token(i, now + int(self.rec.lengths.input_tokens[i]) * self.prefill_per_token)
        return self.finish_s(now, i)


class BatchEngine(Engine):
    """Continuous batching with the shared `ContinuousBatcher`; virtual time advances by `step()`'s duration."""

    def __init__(self, spec: EngineSpec, rec: Recorder, gateway: GatewayState | None = None) -> None:
        super().__init__(spec, rec, gateway)
        self.batcher = ContinuousBatcher(
            self.model, self.gpu, self.kv_capacity, max_batch=spec.max_batch,
            max_prefill_tokens=spec.max_prefill_tokens,
            prefix_cache=EnginePrefixCache() if spec.prefix_caching else None,
        )
        self.stepping = False
        self._step_start = 0.0
        self.step_end_s = 0.0          # end of the running step, whose effects the batcher already holds
        self._result_prefilled: list[Sequence] = []
        self._result_finished: list[Sequence] = []

    def load(self) -> tuple[int, int]:
        return len(self.batcher.waiting), len(self.batcher.running)

    def kv_free_bytes(self) -> int:
        return self.batcher.kv_free_bytes

    def prefix_counters(self) -> tuple[int, int]:
        cache = self.batcher.prefix_cache
        return (cache.queries, cache.hits) if cache is not None else (0, 0)

    def submit(self, i: int, now: float, cached: int = 0) -> float | None:
        if not self._enqueue(i, now):
            return None
        self._lease(i, now, cached)
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
        if (cache := self.batcher.prefix_cache) is not None:
            seq.blocks = lengths.blocks(i, cache.block_tokens)
        try:
            self.batcher.submit(seq)
        except SequenceTooLarge:
            self.rec.rejected[i] = True
            return False
        self.changed = True
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
        self.changed = True
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
        self.changed = True
        return done
