"""Simulated language model: continuous batching in real time, timed by the performance model.

Each `ContinuousBatcher.step()` says how long the step takes on this GPU; `run_step` sleeps for that
duration × time_scale and then hands every sequence its token. The GPU scheduler decides when a
step runs (vision work first on a shared GPU). Output lengths stand in for EOS: a
request stops at a length drawn from its request id (stable across retries) unless max_tokens
comes first.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator, Callable

from backends.batcher import ContinuousBatcher, Sequence
from backends.executors import GenerateInput, LoadReport, Token
from backends.token_streams import TokenStreams
from common.catalog import GpuProfile, ModelProfile

# Natural completion lengths when max_tokens does not cut them: uniform in [MIN, MAX].
NATURAL_MIN_TOKENS, NATURAL_MAX_TOKENS = 16, 256
_WORDS = ("the", "model", "answers", "with", "simulated", "tokens", "from", "a", "heterogeneous", "cluster")


def natural_length(request_id: str) -> int:
    span = NATURAL_MAX_TOKENS - NATURAL_MIN_TOKENS + 1
    return NATURAL_MIN_TOKENS + zlib.crc32(request_id.encode()) % span


class SimulatedExecutor:
    def __init__(
        self,
        model: ModelProfile,
        gpu: GpuProfile,
        kv_capacity_bytes: int,
        *,
        time_scale: float = 1.0,
        max_batch: int = 256,
        max_prefill_tokens: int | None = None,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.batcher = ContinuousBatcher(model, gpu, kv_capacity_bytes, max_batch, max_prefill_tokens)
        self.time_scale = time_scale
        self._streams = TokenStreams(self.batcher, on_change)
        self._on_change = on_change

    def generate(self, request: GenerateInput) -> AsyncIterator[Token]:
        """Yield the request's tokens; closing the iterator early cancels the sequence."""
        target = min(request.max_tokens, natural_length(request.request_id))
        seq = Sequence(request.request_id, max(1, request.prompt_tokens), request.max_tokens, target,
                       arrival_s=time.monotonic())
        return self._streams.stream(seq)

    @property
    def has_work(self) -> bool:
        return not self.batcher.idle

    def load(self) -> LoadReport:
        return self._streams.load(self.batcher.model.max_context)

    async def run_step(self) -> int:
        """Run one batch step; returns the number of tokens it produced."""
        step = self.batcher.step()
        if step.duration_s > 0:
            await asyncio.sleep(step.duration_s * self.time_scale)
        self._publish(step.prefilled)
        self._publish(step.decoded)
        if step.prefilled or step.finished:
            for seq in step.finished:
                self._streams.completed(self.batcher.service_s(seq))
            self._on_change()
        return len(step.prefilled) + len(step.decoded)

    def _publish(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            index = seq.generated - 1
            finish = None
            if seq.done:
                finish = "length" if seq.generated >= seq.max_tokens else "stop"
            self._streams.publish(seq, Token(_WORDS[index % len(_WORDS)] + " ", index, finish))
