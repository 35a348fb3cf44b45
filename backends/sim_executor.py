"""Simulated language model: continuous batching in real time, timed by the performance model.

Each `ContinuousBatcher.step()` says how long the step takes on this GPU; `run_step` sleeps for that
duration × time_scale and then hands every sequence its token. The GPU scheduler decides when a
step runs (vision work first on a shared GPU). Output lengths stand in for EOS: a
request stops at a length drawn from its request id (stable across retries) unless max_tokens
comes first. Its text is made-up words (token k is the k-th of `_WORDS`, round and round), detokenised as
the torch engine's are (`backends.detokenizer.IncrementalText` over `Words`), so a stop string can occur in
it: text that could still become one is held back, and the token that completes the first one ends the
request, its text cut before it, `finish_reason` "stop"; it leaves the batch (its KV freed) at the next step.
The engine caches prompt prefixes as vLLM does by default (`prefix_caching`; blocks
named by `common.prefix_blocks` from the request's images by content, then its token ids, else its
prompt text, as the gateway's prefix index names them), and charges prefill for the uncached tokens
only (backends/batcher.py).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator, Callable

from backends.batcher import ContinuousBatcher, Sequence
from backends.detokenizer import IncrementalText
from backends.executors import GenerateInput, LoadReport, Token
from backends.token_streams import TokenStreams
from common.catalog import GpuProfile, ModelProfile
from common.prefix_blocks import EnginePrefixCache, prompt_blocks, salt_seed

# Natural completion lengths when max_tokens does not cut them: uniform in [MIN, MAX].
NATURAL_MIN_TOKENS, NATURAL_MAX_TOKENS = 16, 256
_WORDS = ("the", "model", "answers", "with", "simulated", "tokens", "from", "a", "heterogeneous", "cluster")


def natural_length(request_id: str) -> int:
    span = NATURAL_MAX_TOKENS - NATURAL_MIN_TOKENS + 1
    return NATURAL_MIN_TOKENS + zlib.crc32(request_id.encode()) % span


def word(index: int) -> str:
    """The text of the token at `index`."""
    return _WORDS[index % len(_WORDS)] + " "


class Words:
    """The simulated engine's tokenizer, as `IncrementalText` reads one: token id k decodes to `word(k)`."""

    def decode(self, token_ids: list[int], /, skip_special_tokens: bool = False) -> str:
        return "".join(word(k) for k in token_ids)


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
        prefix_caching: bool = True,
    ) -> None:
        cache = EnginePrefixCache() if prefix_caching else None
        self.batcher = ContinuousBatcher(model, gpu, kv_capacity_bytes, max_batch, max_prefill_tokens,
                                         prefix_cache=cache)
        self.time_scale = time_scale
        self._streams = TokenStreams(self.batcher, on_change, time_scale)
        self._on_change = on_change
        self._words = Words()
        self._texts: dict[Sequence, IncrementalText] = {}   # the detokeniser of each sequence with stop strings
        self._stopped = False   # a stop string ended a sequence: it leaves the batch at the next step

    def generate(self, request: GenerateInput) -> AsyncIterator[Token]:
        """Yield the request's tokens; closing the iterator early cancels the sequence."""
        target = min(request.max_tokens, natural_length(request.request_id))
        prompt_tokens = max(1, request.prompt_tokens)
        seq = Sequence(request.request_id, prompt_tokens, request.max_tokens, target, arrival_s=time.monotonic())
        cache = self.batcher.prefix_cache
        if cache is not None:
            seq.blocks = prompt_blocks(request.prompt, request.token_ids, prompt_tokens, request.images,
                                       block_tokens=cache.block_tokens, salt=salt_seed(request.cache_salt))
        if not request.sampling.stop:   # the words as they come: no detokeniser between them and the stream
            return self._streams.stream(seq)
        return self._stream(seq, IncrementalText(self._words, request.sampling.stop))

    async def _stream(self, seq: Sequence, text: IncrementalText) -> AsyncIterator[Token]:
        self._texts[seq] = text
        try:
            async for token in self._streams.stream(seq):
                yield token
        finally:
            self._texts.pop(seq, None)

    @property
    def has_work(self) -> bool:
        return not self.batcher.idle

    def load(self) -> LoadReport:
        return self._streams.load(self.batcher.model.max_context)

    async def run_step(self) -> int:
        """Run one batch step; returns the number of tokens it produced."""
        left, self._stopped = self._stopped, False   # what stopped last step leaves (frees its KV) in this one
        step = self.batcher.step()
        if step.duration_s > 0:
            await asyncio.sleep(step.duration_s * self.time_scale)
        self._publish(step.prefilled)
        self._publish(step.decoded)
        for seq in step.finished:
            self._streams.completed(self.batcher.service_s(seq))
        if step.prefilled or step.finished or self._stopped or left:
            self._on_change()
        return len(step.prefilled) + len(step.decoded)

    def _publish(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            index = seq.generated - 1
            detok = self._texts.get(seq)   # None: no stop strings, or its caller went away (it leaves next step)
            text = detok.push(index) if detok is not None else word(index)
            finish = None
            if detok is not None and detok.stopped:   # as the torch engine: a stop string ends it at once
                finish = "stop"
                if not seq.done:   # (done: it left the batch this step anyway, counted in run_step)
                    self.batcher.cancel(seq)
                    self._streams.completed(self.batcher.service_s(seq))
                    self._stopped = True
            elif seq.done:   # it left the batch this step: at max_tokens, else its natural end (EOS)
                text += detok.finish() if detok is not None else ""
                finish = "length" if seq.generated >= seq.max_tokens else "stop"
            cached = seq.cached_tokens if finish is not None and self.batcher.prefix_cache is not None else None
            self._streams.publish(seq, Token(text, index, finish, cached))
