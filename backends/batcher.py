"""Continuous batching as a pure state machine, timed by the performance model.

The simulated engine calls `step()` and sleeps for the returned duration; the discrete-event
simulator advances virtual time by it. Neither sleeps here, so both share one scheduler.

The batcher keeps its own clock, `busy_s`: the performance-model seconds of the steps it has run.
A sequence's service time (admission → last token) on that clock is what T̄_service averages, in
the same unit whether the engine sleeps in real time, time-scaled, or in virtual time.

Per step: admit waiting sequences in FIFO order while the batch has room and their KV reservation
(prompt + max new tokens) fits; newly admitted sequences run prefill and emit their first token,
running ones decode one token each. Step time = prefill(new prompt tokens) + decode step(old batch).
KV is reserved whole at admission, so the cache is never over capacity and admission simply waits.
With a prefix cache (`common.prefix_blocks.EnginePrefixCache`, the simulated engine's) a sequence's
prefill is charged for its uncached tokens only: its leading blocks that a running sequence holds or
that stay cached in the free part of the KV are not computed again; its blocks are pinned while it
runs; cached blocks beyond the free KV are evicted least recently used first. The reservation stays
prompt + max new tokens (shared blocks are not credited: the cache holds less than a real engine's).
Prefix-cache counters (vLLM's queries / hits, tokens) are kept either way: without a cache every
prompt token is a query and none a hit.
With `slot_tokens` (a slot-KV engine: one preallocated slot of that many tokens per sequence) every
sequence reserves one whole slot, which is what it really holds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common import perf_model
from common.catalog import GpuProfile, ModelProfile
from common.prefix_blocks import BLOCK_TOKENS, EnginePrefixCache


@dataclass(slots=True, eq=False)
class Sequence:
    id: str
    prompt_tokens: int           # text + image tokens
    max_tokens: int              # KV is reserved for this many new tokens
    target_tokens: int           # tokens it will actually produce (≤ max_tokens; EOS in a real engine)
    arrival_s: float = 0.0
    admitted_s: float = 0.0      # the batcher's busy clock when the sequence was admitted
    generated: int = 0
    kv_reserved: int = 0
    cancelled: bool = False
    blocks: list[int] = field(default_factory=list)   # its prompt's block hashes, for the prefix cache
    cached_tokens: int = 0       # prompt tokens the prefix cache held at admission (not prefilled)

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def done(self) -> bool:
        return self.generated >= self.target_tokens


@dataclass(slots=True)
class StepResult:
    duration_s: float
    prefilled: list[Sequence] = field(default_factory=list)   # emitted their first token this step
    decoded: list[Sequence] = field(default_factory=list)     # emitted one more token this step
    finished: list[Sequence] = field(default_factory=list)    # left the batch this step (KV freed)


class SequenceTooLarge(ValueError):
    """A sequence whose reservation exceeds the whole KV cache: it could never be admitted."""


class ContinuousBatcher:
    def __init__(
        self,
        model: ModelProfile,
        gpu: GpuProfile,
        kv_capacity_bytes: int,
        max_batch: int = 256,
        max_prefill_tokens: int | None = None,
        slot_tokens: int | None = None,
        prefix_cache: EnginePrefixCache | None = None,
    ) -> None:
        self.model, self.gpu = model, gpu
        self.prefix_cache = prefix_cache
        self._block_bytes = perf_model.kv_bytes(model, prefix_cache.block_tokens if prefix_cache else BLOCK_TOKENS)
        self.prompt_tokens_admitted = 0
        self.slot_tokens = slot_tokens
        self.kv_capacity_bytes = kv_capacity_bytes
        self.max_batch = max_batch
        # Bounds one step's prefill (work stealing keeps steps short); one sequence is always admitted.
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_used_bytes = 0
        self.busy_s = 0.0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def kv_free_bytes(self) -> int:
        return self.kv_capacity_bytes - self.kv_used_bytes

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def prefix_counters(self) -> tuple[int, int]:
        """(queries, hits): prompt tokens admitted and, of them, found cached (vLLM's counters)."""
        cache = self.prefix_cache
        return (cache.queries, cache.hits) if cache is not None else (self.prompt_tokens_admitted, 0)

    def reservation(self, seq: Sequence) -> int:
        return perf_model.kv_bytes(self.model, self.slot_tokens or seq.prompt_tokens + seq.max_tokens)

    def submit(self, seq: Sequence) -> None:
        if self.slot_tokens is not None and seq.prompt_tokens + seq.max_tokens > self.slot_tokens:
            raise SequenceTooLarge(
                f"{seq.prompt_tokens} prompt tokens + max_tokens {seq.max_tokens} exceed the engine's "
                f"{self.slot_tokens} tokens per sequence (max_model_len)"
            )
        if self.reservation(seq) > self.kv_capacity_bytes:
            raise SequenceTooLarge(
                f"{seq.prompt_tokens + seq.max_tokens} tokens need {self.reservation(seq)} KV bytes; "
                f"this GPU has {self.kv_capacity_bytes}"
            )
        self.waiting.append(seq)

    def service_s(self, seq: Sequence) -> float:
        """Model seconds from admission to now: for a finished sequence, its service time."""
        return self.busy_s - seq.admitted_s

    def cancel(self, seq: Sequence) -> None:
        """Mark for removal; it leaves (and frees its KV) at the next step."""
        seq.cancelled = True

    def step(self) -> StepResult:
        self._drop_cancelled()
        old = list(self.running)
        new = self._admit()
        result = StepResult(duration_s=0.0, prefilled=new, decoded=old)
        if new:
            computed = sum(s.prompt_tokens - s.cached_tokens for s in new)
            result.duration_s += perf_model.prefill_seconds(self.model, self.gpu, computed)
        if old:
            ctx = sum(s.context_tokens for s in old)
            result.duration_s += perf_model.decode_step_seconds(self.model, self.gpu, len(old), ctx)
        for s in new:
            s.admitted_s = self.busy_s
        self.busy_s += result.duration_s
        for s in self.running:
            s.generated += 1
        still: list[Sequence] = []
        for s in self.running:
            if s.done:
                self._free(s)
                result.finished.append(s)
            else:
                still.append(s)
        self.running = still
        return result

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        prefill = 0
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            need = self.reservation(seq)
            if need > self.kv_free_bytes:
                break
            cache = self.prefix_cache
            prefill += seq.prompt_tokens - (cache.match(seq.blocks, seq.prompt_tokens) if cache else 0)
            if admitted and self.max_prefill_tokens is not None and prefill > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            seq.kv_reserved = need
            self.kv_used_bytes += need
            self.prompt_tokens_admitted += seq.prompt_tokens
            if cache is not None:
                seq.cached_tokens = cache.admit(seq.blocks, seq.prompt_tokens)
                cache.fit(self.kv_free_bytes // self._block_bytes)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _drop_cancelled(self) -> None:
        if any(s.cancelled for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
        for s in [s for s in self.running if s.cancelled]:
            self._free(s)
            self.running.remove(s)

    def _free(self, seq: Sequence) -> None:
        self.kv_used_bytes -= seq.kv_reserved
        seq.kv_reserved = 0
        if self.prefix_cache is not None:
            self.prefix_cache.release(seq.blocks, self.kv_free_bytes // self._block_bytes)
