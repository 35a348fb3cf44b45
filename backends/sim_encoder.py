"""Simulated vision encoder: the performance model's encode time, and embeddings of random values.

A batch takes encode(Σ image tokens) on this GPU (× time_scale, slept); each image becomes an embedding
of the right size (tokens × hidden × dtype bytes), made only when it is delivered so that a batch of
large images does not sit in memory at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from backends.executors import EncodedImage
from common import perf_model
from common.catalog import GpuProfile, ModelProfile
from common.wire import engine_pb2


@dataclass(slots=True)
class RandomEmbedding:
    tokens: int
    hidden: int
    dtype: str
    nbytes: int
    rng: np.random.Generator

    def payload(self) -> bytes:
        """Random 16-bit values with the top exponent bit cleared: finite (|x| < 2) in float16 and bfloat16."""
        words = np.frombuffer(self.rng.bytes(self.nbytes), dtype=np.uint16)
        return (words & 0xBFFF).tobytes()


class SimulatedEncoder:
    def __init__(self, model: ModelProfile, gpu: GpuProfile, *, time_scale: float = 1.0) -> None:
        if model.vision is None:
            raise ValueError(f"model {model.name} has no vision encoder")
        self.model, self.gpu = model, gpu
        self.hidden = model.hidden
        self.time_scale = time_scale
        self._rng = np.random.default_rng(0)

    async def encode_batch(self, images: Sequence[engine_pb2.Image]) -> tuple[list[EncodedImage], float]:
        seconds = perf_model.encode_seconds(self.model, self.gpu, sum(img.tokens for img in images))
        await asyncio.sleep(seconds * self.time_scale)
        return [
            RandomEmbedding(img.tokens, self.hidden, self.model.dtype,
                            perf_model.embedding_bytes(self.model, img.tokens), self._rng)
            for img in images
        ], seconds
