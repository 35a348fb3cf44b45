"""Simulated language model: continuous batching in real time, timed by the performance model.

Each `ContinuousBatcher.step()` says how long the step takes on this GPU; `run_step` sleeps for that
duration × time_scale and then hands every sequence its token. The GPU scheduler decides when a
step runs (vision work first on a shared GPU). Output lengths stand in for EOS: a
request stops at a length drawn from its request id (stable across retries) unless max_tokens
comes first. Its text is made-up words, so a stop string can occur in it: as a real engine does, the
request then ends with the token that completes the first one, its text cut before it, `finish_reason`
"stop" (the words are known in advance, so the cut is found at submission, `stop_cut`).
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
from backends.executors import GenerateInput, LoadReport, Token
from backends.token_streams import TokenStreams
from common.catalog import GpuProfile, ModelProfile
from common.prefix_blocks import EnginePrefixCache, prompt_blocks, salt_seed

# Natural completion lengths when max_tokens does not cut them: uniform in [MIN, MAX].
NATURAL_MIN_TOKENS, NATURAL_MAX_TOKENS = 16, 256
_WORDS = ("the", "model", "answers", "with", "simulated", "tokens", "from", "a", "heterogeneous", "cluster")


_CYCLE = sum(len(w) + 1 for w in _WORDS)   # characters of one round of the words, a space after each
_STARTS = [sum(len(w) + 1 for w in _WORDS[:k]) for k in range(len(_WORDS))]


def natural_length(request_id: str) -> int:
    span = NATURAL_MAX_TOKENS - NATURAL_MIN_TOKENS + 1
    return NATURAL_MIN_TOKENS + zlib.crc32(request_id.encode()) % span


def word(index: int) -> str:
    """The text of the token at `index`."""
    return _WORDS[index % len(_WORDS)] + " "


def word_start(index: int) -> int:
    """Where the token at `index` starts in the text."""
    return (index // len(_WORDS)) * _CYCLE + _STARTS[index % len(_WORDS)]


def stop_cut(tokens: int, stop: tuple[str, ...]) -> tuple[int, int] | None:
    """(tokens generated, characters returned) when a stop string occurs in the first `tokens` words: the
    generation ends with the token that completes the first to occur, and its text before the earliest of
    the stop strings then in it (what `backends.detokenizer.IncrementalText` does token by token). None: none
    occurs."""
    text = "".join(word(k) for k in range(tokens))
    found = [(i + len(s), s) for s in stop if s and (i := text.find(s)) >= 0]
    if not found:
        return None
    completed = min(end for end, _ in found)
    last = next(k for k in range(tokens) if word_start(k) + len(word(k)) >= completed)
    so_far = text[:word_start(last) + len(word(last))]
    return last + 1, min(i for s in stop if s and (i := so_far.find(s)) >= 0)


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

    def generate(self, request: GenerateInput) -> AsyncIterator[Token]:
        """Yield the request's tokens; closing the iterator early cancels the sequence."""
        target = min(request.max_tokens, natural_length(request.request_id))
        cut = stop_cut(target, request.sampling.stop) if request.sampling.stop else None
        prompt_tokens = max(1, request.prompt_tokens)
        seq = Sequence(request.request_id, prompt_tokens, request.max_tokens, cut[0] if cut else target,
                       arrival_s=time.monotonic(), text_end=cut[1] if cut else -1)
        cache = self.batcher.prefix_cache
        if cache is not None:
            seq.blocks = prompt_blocks(request.prompt, request.token_ids, prompt_tokens, request.images,
                                       block_tokens=cache.block_tokens, salt=salt_seed(request.cache_salt))
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
            text = word(index)
            if seq.text_end >= 0:   # cut by a stop string: only what comes before it
                start = word_start(index)
                text = text[:max(0, seq.text_end - start)]
            finish = None
            if seq.done:
                finish = "length" if seq.generated >= seq.max_tokens and seq.text_end < 0 else "stop"
            self._streams.publish(seq, Token(text, index, finish))
