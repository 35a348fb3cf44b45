"""The executor seam: what an engine process asks of the thing that runs (or simulates) its model.

The continuous batcher (backends/batcher.py) decides what runs: admission, KV accounting, joins and
leaves. A language executor carries out its plan, one step at a time:

    generate(request)   admit: queue a sequence and stream its tokens; closing the stream cancels it
    run_step()          step: run one batch step (prefill the newly admitted, decode the running)
    load()              load report: queue, batch and KV figures for the heartbeats

The simulated executor times each step with the performance model and sleeps; the torch executor runs
the model. The vision side splits the same way: one aligned-batch queue (backends/vision_executor.py)
hands batches of images to a `VisionEncoder`, simulated or torch, and delivers the embeddings.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.wire import engine_pb2


@dataclass(slots=True)
class Token:
    text: str
    index: int
    finish_reason: str | None = None   # "stop" | "length" on the last token
    cached_tokens: int | None = None   # on the last token: prompt tokens its prefix cache held (None: no cache)


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 1.0           # 0: greedy
    top_p: float = 1.0
    seed: int | None = None            # None: a fresh random seed per request
    stop: tuple[str, ...] = ()


@dataclass(slots=True)
class GenerateInput:
    """One Generate call as an executor sees it (embeddings already gathered from the hand-off)."""

    request_id: str
    prompt_tokens: int                 # text + image tokens, as counted by the gateway
    max_tokens: int
    prompt: str = ""
    token_ids: list[int] = field(default_factory=list)              # the gateway's tokenisation, if any
    image_spans: list[tuple[int, int]] = field(default_factory=list)  # (start, length) per image, in order
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)  # Qwen2-VL family: (t, h, w) per image
    embeddings: list[engine_pb2.Embedding] = field(default_factory=list)
    sampling: Sampling = Sampling()
    images: list[tuple[int, int, int]] = field(default_factory=list)   # (content digest, tokens, place) per image
    cache_salt: str = ""               # its KV is shared only with prompts of the same salt ("" none)


@dataclass(frozen=True, slots=True)
class LoadReport:
    waiting: int
    running: int
    kv_free_bytes: int
    kv_total_bytes: int
    mean_service_s: float | None       # T̄_service; None until a request has completed
    tokens_generated: int
    requests_completed: int
    max_model_len: int                 # the longest sequence (prompt + completion) the engine takes
    prefix_cache_queries: int = 0      # prompt tokens admitted (vLLM's prefix_cache_queries)
    prefix_cache_hits: int = 0         # of them, found in the prefix cache
    kv_block_tokens: int = 0           # tokens a block of its prefix cache holds (0: it keeps none)


class InvalidInput(ValueError):
    """The request cannot run on this model (bad token ids, spans that do not fit the embeddings, ...)."""


class LanguageExecutor(Protocol):
    def generate(self, request: GenerateInput) -> AsyncIterator[Token]: ...

    @property
    def has_work(self) -> bool: ...

    async def run_step(self) -> int: ...

    def load(self) -> LoadReport: ...


class EncodedImage(Protocol):
    tokens: int
    hidden: int
    dtype: str

    def payload(self) -> bytes: ...


class VisionEncoder(Protocol):
    """Encodes one aligned batch; returns one embedding per image, in order, and the seconds the work took
    on the model's clock (the performance model's for a simulated encoder, wall time for a real one)."""

    hidden: int

    async def encode_batch(self, images: Sequence[engine_pb2.Image]) -> tuple[list[EncodedImage], float]: ...
