"""Per-sequence token queues between an executor's step loop and the Generate calls that wait on them.

Shared by the simulated and the torch executors: `stream()` admits a sequence to the batcher and yields
what the step loop `publish`es for it; a caller that stops reading cancels the sequence, which leaves the
batch (and frees its KV) at the next step. Completions update the counters and T̄_service.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from backends.batcher import ContinuousBatcher, Sequence
from backends.executors import LoadReport, Token
from common.service_time import prior_service_s, updated_mean_service


class TokenStreams:
    """`time_scale`: the seconds the engine runs for one second of the batcher's model (a simulated
    engine's `launch.time_scale`; 1 for a real one). T̄_service is reported in the engine's seconds, as
    the gateway measures everything else it routes on (first tokens, decode steps): a simulated engine
    slowed 4x reporting model seconds made the gateway's wait for KV 4x short."""

    def __init__(self, batcher: ContinuousBatcher, on_change: Callable[[], None], time_scale: float = 1.0) -> None:
        self.batcher = batcher
        self._on_change = on_change
        self._queues: dict[int, asyncio.Queue[Token]] = {}
        self.time_scale = time_scale
        self.measured_service_s = prior_service_s(batcher.model, batcher.gpu) * time_scale   # the prior at first
        self.tokens_generated = 0
        self.requests_completed = 0

    async def stream(self, seq: Sequence) -> AsyncIterator[Token]:
        """Yield the sequence's tokens; closing the iterator early cancels the sequence."""
        self.batcher.submit(seq)   # raises SequenceTooLarge before anything is queued
        queue: asyncio.Queue[Token] = asyncio.Queue()
        self._queues[id(seq)] = queue
        self._on_change()
        finished = False
        try:
            while True:
                token = await queue.get()
                finished = token.finish_reason is not None
                yield token
                if finished:
                    return
        finally:
            self._queues.pop(id(seq), None)
            if not finished:
                self.batcher.cancel(seq)
                self._on_change()

    def publish(self, seq: Sequence, token: Token) -> None:
        self.tokens_generated += 1
        queue = self._queues.get(id(seq))
        if queue is not None:
            queue.put_nowait(token)

    def completed(self, service_s: float) -> None:
        """A sequence finished after `service_s` of the batcher's model time (admission to last token)."""
        self.requests_completed += 1
        self.measured_service_s = updated_mean_service(self.measured_service_s, service_s * self.time_scale)

    def load(self, max_model_len: int) -> LoadReport:
        b = self.batcher
        queries, hits = b.prefix_counters
        return LoadReport(
            waiting=len(b.waiting), running=len(b.running), kv_free_bytes=b.kv_free_bytes,
            kv_total_bytes=b.kv_capacity_bytes, mean_service_s=self.measured_service_s, max_model_len=max_model_len,
            tokens_generated=self.tokens_generated, requests_completed=self.requests_completed,
            prefix_cache_queries=queries, prefix_cache_hits=hits,
            kv_block_tokens=b.prefix_cache.block_tokens if b.prefix_cache is not None else 0,
        )
