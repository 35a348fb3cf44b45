"""The torch language executor in-process: sampling, stop strings, KV admission and accounting, no leaks,
prefix reuse (the same tokens as a fresh engine computes)."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch

from backends.engine_config import EngineConfig
from backends.executor_factory import build_executors
from backends.executors import GenerateInput, LanguageExecutor, Sampling, Token
from backends.gpu_scheduler import GpuScheduler
from backends.slot_prefix import Take
from backends.torch_executor import TorchLanguageExecutor
from common.catalog import load_catalog
from common.errors import ConfigError
from common.wire import engine_pb2
from tests.torch_engines.conftest import TINY, TINY_QWEN


async def _nowhere(address: str, emb: engine_pb2.Embedding) -> None:
    raise AssertionError("a language engine delivers nothing")


@asynccontextmanager
async def running_executor(model_dir: Path, max_batch: int = 8, model: str = TINY) -> (
    AsyncIterator[TorchLanguageExecutor]
):
    catalog = load_catalog()
    config = EngineConfig(backend_id="t", gpu="H100", model=model, gateway="", executor="torch",
                          model_path=str(model_dir), max_batch=max_batch, max_model_len=128)
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


@pytest.mark.parametrize("launch, message", [
    ({"max_model_len": 5000}, "max_model_len 5000 is over the model's context of 1024 tokens"),
    ({"memory_utilization": 1e-9}, "leave no slot of max_model_len 1024"),
    ({"max_batch": 0}, "max_batch 0 leave no slot"),
])
def test_a_launch_the_kv_cache_cannot_honour_is_a_config_error(
    tiny_model_dir: Path, launch: dict[str, float], message: str
) -> None:
    """The engine exits with one line naming the setting (a ConfigError), not a traceback (a ValueError, or a
    max_model_len past the model's positions allocating tens of GB) that the launching gateway restarts."""
    catalog = load_catalog()
    config = EngineConfig(backend_id="t", gpu="H100", model=TINY, gateway="", executor="torch",
                          model_path=str(tiny_model_dir), **launch)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):
        build_executors(config, catalog.model(TINY), catalog.gpu("H100"), _nowhere, lambda: None)


@pytest.mark.parametrize("model", [TINY, TINY_QWEN])
def test_the_decoder_runs_without_deprecation_warnings(model: str, request: pytest.FixtureRequest) -> None:
    """The slot cache goes to the decoder under the argument name it takes (`cache` since transformers renamed
    `past_key_values`, which warns in every engine's log and goes in 5.40)."""
    model_dir = request.getfixturevalue("tiny_model_dir" if model == TINY else "tiny_qwen_dir")
    catalog = load_catalog()
    config = EngineConfig(backend_id="t", gpu="H100", model=model, gateway="", executor="torch",
                          model_path=str(model_dir), max_batch=2, max_model_len=64)
    language, _ = build_executors(config, catalog.model(model), catalog.gpu("H100"), _nowhere, lambda: None)
    assert isinstance(language, TorchLanguageExecutor)
    runner = language.runner
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        runner.prefill(0, runner.embed_prompt([40, 41, 42], [], []))
        runner.decode([0], [3], [43])


def request(rid: str, prompt: str, max_tokens: int, **sampling: object) -> GenerateInput:
    return GenerateInput(rid, 0, max_tokens, prompt=prompt, sampling=Sampling(**sampling))  # type: ignore[arg-type]


async def collect(executor: LanguageExecutor, req: GenerateInput) -> list[Token]:
    return [t async for t in executor.generate(req)]


async def collect_from(stream: AsyncIterator[Token]) -> list[Token]:
    return [t async for t in stream]


def text(tokens: list[Token]) -> str:
    return "".join(t.text for t in tokens)


async def test_seeded_sampling_is_reproducible(tiny_model_dir: Path) -> None:
    async with running_executor(tiny_model_dir) as ex:
        a, b, c = await asyncio.gather(
            collect(ex, request("a", "tell me", 30, temperature=1.0, top_p=0.9, seed=7)),
            collect(ex, request("b", "tell me", 30, temperature=1.0, top_p=0.9, seed=7)),
            collect(ex, request("c", "tell me", 30, temperature=1.0, top_p=0.9, seed=8)),
        )
        greedy = await collect(ex, request("g", "tell me", 30, temperature=0.0))
    assert text(a) == text(b) and len(a) == 30
    assert text(a) != text(c) and text(a) != text(greedy)


async def test_stop_string_ends_the_text_before_it(tiny_model_dir: Path) -> None:
    async with running_executor(tiny_model_dir) as ex:
        full = text(await collect(ex, request("f", "say something", 40, temperature=0.0)))
        stop = full[10:13]
        cut = await collect(ex, request("s", "say something", 40, temperature=0.0, stop=("never-said", stop)))
    assert text(cut) == full[:full.index(stop)]
    assert cut[-1].finish_reason == "stop" and len(cut) < 40


async def test_admission_waits_for_a_free_slot_and_load_is_reported(tiny_model_dir: Path) -> None:
    async with running_executor(tiny_model_dir, max_batch=2) as ex:
        total = ex.load().kv_total_bytes
        assert total == ex.kv.nbytes == 2 * 128 * 2 * 2 * 2 * 16 * 4
        streams = [ex.generate(request(f"r{i}", "hello", 50, temperature=0.0)) for i in range(4)]
        firsts = await asyncio.gather(*(anext(s) for s in streams[:2]))
        load = ex.load()
        assert (load.running, load.kv_free_bytes) == (2, 0)
        waiting = asyncio.ensure_future(anext(streams[2]))
        await asyncio.sleep(0.05)
        assert not waiting.done()               # no slot until one of the first two leaves
        for s in streams[:2]:
            await s.aclose()                    # the client left: the slots come back
        assert (await waiting).index == 0
        await streams[2].aclose()
        assert all(t.index == 0 for t in firsts)
        await streams[3].aclose()


async def test_nothing_leaks_after_many_requests_with_cancellations(tiny_model_dir: Path) -> None:
    async with running_executor(tiny_model_dir) as ex:
        async def one(i: int) -> None:
            stream = ex.generate(request(f"r{i}", "x" * (i % 17 + 1), 2 + i % 5, temperature=0.0))
            if i % 3 == 0:              # leaves after its first token
                await anext(stream)
                await stream.aclose()
            elif i % 3 == 1:            # leaves before it is admitted or mid-way, whichever comes first
                task = asyncio.ensure_future(anext(stream))
                await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await stream.aclose()
            else:
                assert len([t async for t in stream]) == 2 + i % 5
        for start in range(0, 1000, 50):
            await asyncio.gather(*(one(i) for i in range(start, start + 50)))
        for _ in range(100):            # let the last cancellations leave at the next steps
            if ex.batcher.idle:
                break
            await asyncio.sleep(0.01)
        await collect(ex, request("last", "x", 1, temperature=0.0))
        load = ex.load()
    assert (load.waiting, load.running, load.kv_free_bytes) == (0, 0, load.kv_total_bytes)
    assert len(ex.prefixes) == ex.kv.slots and not ex._live


@pytest.mark.parametrize("model", [TINY, TINY_QWEN])
async def test_a_reused_prefix_gives_the_tokens_a_fresh_engine_computes(
    model: str, request: pytest.FixtureRequest
) -> None:
    """A second prompt that starts as the first did takes the first's freed slot and is prefilled only past
    their shared blocks; greedy, its tokens are those of an engine that never saw the first prompt."""
    model_dir: Path = request.getfixturevalue("tiny_model_dir" if model == TINY else "tiny_qwen_dir")
    shared = "the quick brown fox " * 3
    first, second = GenerateInput("a", 0, 8, prompt=shared + "and runs", sampling=Sampling(temperature=0.0)), \
        GenerateInput("b", 0, 8, prompt=shared + "then sleeps", sampling=Sampling(temperature=0.0))
    async with running_executor(model_dir, max_batch=2, model=model) as ex:
        await collect(ex, first)
        before = ex.load()
        reused = text(await collect(ex, second))
        after = ex.load()
    async with running_executor(model_dir, max_batch=2, model=model) as fresh:
        computed = text(await collect(fresh, second))
        cold = fresh.load()
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 32   # two blocks or more not computed again
    assert after.prefix_cache_queries - before.prefix_cache_queries == cold.prefix_cache_queries
    assert cold.prefix_cache_hits == 0
    assert reused == computed


@pytest.mark.parametrize("model", [TINY, TINY_QWEN])
async def test_sequences_running_at_once_share_a_prefix_by_copy(model: str, request: pytest.FixtureRequest) -> None:
    """A prompt admitted while another that starts the same way runs (admitted in an earlier step, or
    prefilled just before it in the same step) copies the shared blocks' KV from that one's slot: every
    answer, the running ones' too, is a fresh engine's, and the copied tokens count as hits."""
    model_dir: Path = request.getfixturevalue("tiny_model_dir" if model == TINY else "tiny_qwen_dir")
    fox, dog = "the quick brown fox " * 3, "a lazy dog sat on a mat " * 3
    prompts = {"a": (fox + "and runs", 24), "b": (fox + "then sleeps", 8),
               "c": (dog + "and barks", 8), "d": (dog + "or sleeps", 8)}
    greedy = {rid: GenerateInput(rid, 0, n, prompt=p, sampling=Sampling(temperature=0.0))
              for rid, (p, n) in prompts.items()}
    async with running_executor(model_dir, max_batch=3, model=model) as ex:
        takes: list[Take] = []
        take = ex.prefixes.take
        ex.prefixes.take = lambda blocks, tokens: takes.append(t := take(blocks, tokens)) or t  # type: ignore[method-assign]
        running = ex.generate(greedy["a"])
        head = [await anext(running)]                           # a is in its slot, decoding
        later = text(await collect(ex, greedy["b"]))             # admitted in a later step than a
        rest = [t async for t in running]
        assert len(rest) == 23                                   # a still ran while b was prefilled
        c, d = ex.generate(greedy["c"]), ex.generate(greedy["d"])
        same_step = await asyncio.gather(collect_from(c), collect_from(d))   # queued before the next step
    answers = {"a": text(head + rest), "b": later, "c": text(same_step[0]), "d": text(same_step[1])}
    for rid, answer in answers.items():
        async with running_executor(model_dir, max_batch=3, model=model) as fresh:
            assert answer == text(await collect(fresh, greedy[rid])), rid
    a, b, c_take, d_take = takes
    assert b.source == a.slot and b.reused >= 32 and c_take.source < 0   # no free slot held either prefix
    assert d_take.source == c_take.slot and d_take.reused >= 32


async def test_a_cache_salt_keeps_prefixes_apart(tiny_model_dir: Path) -> None:
    """The same prompt under another cache salt reuses nothing (its first token takes the time a fresh
    engine's does), under the same salt it reuses the freed slot's blocks."""
    prompt = "the quick brown fox " * 3 + "and runs"
    async with running_executor(tiny_model_dir, max_batch=2) as ex:
        hits = []
        for rid, salt in (("a", "tenant:a"), ("b", "tenant:b"), ("c", "tenant:a")):
            before = ex.load().prefix_cache_hits
            await collect(ex, GenerateInput(rid, 0, 4, prompt=prompt, sampling=Sampling(temperature=0.0),
                                            cache_salt=salt))
            hits.append(ex.load().prefix_cache_hits - before)
    assert hits[:2] == [0, 0] and hits[2] >= 32


async def test_a_next_turn_reuses_the_kv_of_the_answer_too(tiny_model_dir: Path) -> None:
    """The slot keeps the KV of the tokens it generated: a next turn that resends the answer finds it (the
    byte-level tokenizer of the random model gives the answer's text back as the ids generated)."""
    turn = "x" * 44                                   # 44 prompt tokens, 2 full blocks
    async with running_executor(tiny_model_dir, max_batch=1) as ex:
        answer = text(await collect(ex, request("a", turn, 8, temperature=0.0)))   # the slot holds 44 + 7 tokens
        before = ex.load().prefix_cache_hits
        second = text(await collect(ex, request("b", turn + answer + " and then?", 6, temperature=0.0)))
        reused = ex.load().prefix_cache_hits - before
    async with running_executor(tiny_model_dir, max_batch=1) as fresh:
        computed = text(await collect(fresh, request("b", turn + answer + " and then?", 6, temperature=0.0)))
    assert len(answer) == 8
    assert reused == 48                               # 3 blocks: into the answer's tokens
    assert second == computed


def image_prompt(ex: TorchLanguageExecutor, rid: str, feats: bytes, tail: list[int]) -> GenerateInput:
    """20 text ids, an image of 24 placeholder tokens with these features, then `tail`."""
    ids = [*range(40, 60), *[5] * 24, *tail]
    emb = engine_pb2.Embedding(tokens=24, hidden=ex.hidden, dtype="float32", data=feats)
    return GenerateInput(rid, 0, 6, token_ids=ids, image_spans=[(20, 24)], embeddings=[emb],
                         images=[(7, 24, 20)], sampling=Sampling(temperature=0.0))


def qwen_image_prompt(ex: TorchLanguageExecutor, rid: str, feats: bytes, tail: list[int]) -> GenerateInput:
    """Qwen2.5-VL: 24 text ids, an image of grid (1, 8, 8) (16 tokens after the 2x2 merge, the model's image
    token as placeholder) with these features, then `tail`: 3-D positions that restart after the image."""
    image_token = ex.loaded.model.config.image_token_id
    ids = [*range(40, 64), *[image_token] * 16, *tail]
    emb = engine_pb2.Embedding(tokens=16, hidden=ex.hidden, dtype="float32", data=feats)
    return GenerateInput(rid, 0, 6, token_ids=ids, image_spans=[(24, 16)], image_grids=[(1, 8, 8)],
                         embeddings=[emb], images=[(7, 16, 24)], sampling=Sampling(temperature=0.0))


async def test_an_image_is_reused_only_where_its_embedding_is_the_same(tiny_model_dir: Path) -> None:
    """The image's placeholder ids are the same for every image: its key is its content. The same image
    is reused past it; another image under the same gateway digest (a collision) only up to it."""
    gen = torch.Generator().manual_seed(3)
    cat, dog = (torch.randn(24, 64, generator=gen).numpy().tobytes() for _ in range(2))
    tail, other = [*range(70, 90)], [*range(70, 80), *range(95, 105)]
    async with running_executor(tiny_model_dir, max_batch=1) as ex:
        assert ex.hidden == 64
        await collect(ex, image_prompt(ex, "a", cat, tail))
        hits = ex.load().prefix_cache_hits
        same = text(await collect(ex, image_prompt(ex, "b", cat, other)))
        past_image = ex.load().prefix_cache_hits - hits
        hits = ex.load().prefix_cache_hits
        different = text(await collect(ex, image_prompt(ex, "c", dog, other)))
        before_image = ex.load().prefix_cache_hits - hits
    async with running_executor(tiny_model_dir, max_batch=1) as fresh:
        assert same == text(await collect(fresh, image_prompt(fresh, "b", cat, other)))
    async with running_executor(tiny_model_dir, max_batch=1) as fresh:
        assert different == text(await collect(fresh, image_prompt(fresh, "c", dog, other)))
    assert past_image == 48      # 20 + 24 + 10 shared tokens: 3 full blocks
    assert before_image == 16    # the text before the image: 1 block


async def test_a_qwen_image_is_reused_with_its_3d_positions(sharp_qwen_dir: Path) -> None:
    """Qwen2.5-VL's positions past an image are not the token's index (M-RoPE: the image takes h/2 x w/2
    positions, the text after it goes on from the largest): a prompt that reuses a slot past the same image
    is prefilled from there with its own 3-D positions and answers as a fresh engine does; another image
    under the same gateway digest is reused only up to it. Sharpened weights (the conftest): with the
    tiny model as initialised, wrong positions would give the same greedy tokens."""
    gen = torch.Generator().manual_seed(5)
    cat, dog = (torch.randn(16, 64, generator=gen).mul(3).numpy().tobytes() for _ in range(2))
    tail, other = [*range(70, 90)], [*range(70, 80), *range(95, 115)]
    answers, fresh_answers, hits = [], [], []
    async with running_executor(sharp_qwen_dir, max_batch=1, model=TINY_QWEN) as ex:
        assert ex.hidden == 64 and ex.mrope
        await collect(ex, qwen_image_prompt(ex, "a", cat, tail))
        for rid, feats in (("b", cat), ("c", dog)):
            before = ex.load().prefix_cache_hits
            answers.append(text(await collect(ex, qwen_image_prompt(ex, rid, feats, other))))
            hits.append(ex.load().prefix_cache_hits - before)
    for rid, feats in (("b", cat), ("c", dog)):
        async with running_executor(sharp_qwen_dir, max_batch=1, model=TINY_QWEN) as fresh:
            fresh_answers.append(text(await collect(fresh, qwen_image_prompt(fresh, rid, feats, other))))
    assert hits == [48, 16]     # 24 + 16 + 10 shared tokens: 3 full blocks; another image: the text before it
    assert answers == fresh_answers
    assert answers[0] != answers[1]
