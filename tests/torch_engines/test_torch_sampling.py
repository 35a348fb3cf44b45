"""A random-weight model speaks printable ASCII only, sampled as well as greedy: the tokens outside it are
masked out of the choice (the tiny-real demo's answers are text, never stray bytes)."""

from __future__ import annotations

import asyncio
import string
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from backends.engine_config import EngineConfig
from backends.executor_factory import build_executors
from backends.gpu_scheduler import GpuScheduler
from backends.torch_executor import TorchLanguageExecutor
from common.catalog import load_catalog
from common.wire import engine_pb2
from tests.torch_engines.conftest import TINY, TINY_QWEN
from tests.torch_engines.test_torch_executor import collect, text
from tests.torch_engines.test_torch_executor import request as generate_input

PRINTABLE = set(string.printable) - set("\t\n\r\x0b\x0c")   # the 95 characters 0x20..0x7e


async def _nowhere(address: str, emb: engine_pb2.Embedding) -> None:
    raise AssertionError("a language engine delivers nothing")


@asynccontextmanager
async def language_executor(model: str, model_path: Path | None) -> AsyncIterator[TorchLanguageExecutor]:
    """A torch language executor on the CPU, from a saved model directory or (None) from random weights as
    configs/tiny-real.yaml builds them."""
    catalog = load_catalog()
    config = EngineConfig(backend_id="t", gpu="H100", model=model, gateway="", executor="torch",
                          model_path=None if model_path is None else str(model_path),
                          random_weights=model_path is None, seed=0, max_batch=8, max_model_len=128)
    scheduler: GpuScheduler | None = None
    language, _ = build_executors(config, catalog.model(model), catalog.gpu("H100"), _nowhere,
                                  lambda: scheduler.wake() if scheduler else None)
    assert isinstance(language, TorchLanguageExecutor)
    scheduler = GpuScheduler(language, None, stealing=False)
    task = asyncio.create_task(scheduler.run())
    try:
        yield language
    finally:
        task.cancel()


@pytest.mark.parametrize("source", ["random_weights", "model_path"])
@pytest.mark.parametrize("model", [TINY, TINY_QWEN])
async def test_sampled_text_is_printable_ascii(model: str, source: str, request: pytest.FixtureRequest) -> None:
    model_dir = None
    if source == "model_path":
        model_dir = request.getfixturevalue("tiny_model_dir" if model == TINY else "tiny_qwen_dir")
    async with language_executor(model, model_dir) as ex:
        runs = [(seed, temperature, top_p) for seed in range(6) for temperature, top_p in ((1.0, 1.0), (2.0, 0.95))]
        outs = await asyncio.gather(*(
            collect(ex, generate_input(f"r{i}", "tell me a story", 24, temperature=t, top_p=p, seed=seed))
            for i, (seed, t, p) in enumerate(runs)))
        greedy = await collect(ex, generate_input("g", "tell me a story", 24, temperature=0.0))
    for tokens in [*outs, greedy]:
        said = text(tokens)
        assert set(said) <= PRINTABLE, repr(said)
        assert len(tokens) == 24 and tokens[-1].finish_reason == "length"   # never EOS, never a special token
        assert all(len(t.text) == 1 for t in tokens)                         # one character a token
    assert len({text(t) for t in outs[::2]}) == 6                           # sampling really samples
