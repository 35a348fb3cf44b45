"""CPU throughput of the torch engines on the tiny random-weight LLaVA-1.5, against Hugging Face generate().

    python benchmarks/torch_engine_cpu.py [--new-tokens 64] [--prompt-tokens 48] [--rounds 3]

Language: B requests (B = 1, 8, 32) of --prompt-tokens text tokens each, greedy, --new-tokens each (the
random model never says EOS), submitted at once to the torch language executor in this process (the
engine's own scheduler loop over slot KV; no gRPC). Against: `generate()` of the same model request by
request, and `generate()` on the whole batch at once (equal prompt lengths, so no padding). Reported:
generated tokens per second of wall time, best of --rounds.
Vision: the torch encoder's preprocessing + tower + projector on B images of 640x480 (random pixels)
per call, images per second, best of --rounds.
Writes benchmarks/results/torch_engine_cpu.json. Threads: torch's default (all cores).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from backends.engine_config import EngineConfig
from backends.executor_factory import build_executors
from backends.executors import GenerateInput, Sampling
from backends.gpu_scheduler import GpuScheduler
from backends.torch_executor import TorchLanguageExecutor
from backends.torch_models import load_model
from backends.torch_vision import TorchEncoder
from common.catalog import load_catalog
from common.wire import engine_pb2

RESULTS = Path(__file__).resolve().parent / "results" / "torch_engine_cpu.json"
BATCHES = (1, 8, 32)
MODEL = "llava-1.5-tiny"


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(37, 131) for _ in range(length - 1)] for _ in range(n)]   # BOS + ASCII bytes


async def engine_tokens_per_s(batch: list[list[int]], new_tokens: int) -> float:
    catalog = load_catalog()
    config = EngineConfig(backend_id="bench", gpu="H100", model=MODEL, gateway="", executor="torch",
                          random_weights=True, max_batch=max(BATCHES), max_model_len=256)
    scheduler: GpuScheduler | None = None
    language, _ = build_executors(config, catalog.model(MODEL), catalog.gpu("H100"), _no_delivery,
                                  lambda: scheduler.wake() if scheduler else None)
    assert isinstance(language, TorchLanguageExecutor)
    scheduler = GpuScheduler(language, None, stealing=False)
    task = asyncio.create_task(scheduler.run())

    async def one(i: int, ids: list[int]) -> int:
        req = GenerateInput(f"r{i}", len(ids), new_tokens, token_ids=ids, sampling=Sampling(temperature=0.0))
        return len([t async for t in language.generate(req)])

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(batch)))
    elapsed = time.perf_counter() - start
    task.cancel()
    assert all(c == new_tokens for c in counts)
    return sum(counts) / elapsed


async def _no_delivery(address: str, emb: engine_pb2.Embedding) -> None:
    raise AssertionError("language only")


def hf_tokens_per_s(model: Any, batch: list[list[int]], new_tokens: int, *, batched: bool) -> float:
    groups = [batch] if batched else [[ids] for ids in batch]
    start = time.perf_counter()
    with torch.inference_mode():
        for group in groups:
            out = model.generate(torch.tensor(group), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False)
            assert out.shape[1] == len(group[0]) + new_tokens
    return len(batch) * new_tokens / (time.perf_counter() - start)


def encode_images_per_s(encoder: TorchEncoder, n: int) -> float:
    rng = random.Random(n)
    images = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.frombytes("RGB", (640, 480), rng.randbytes(640 * 480 * 3)).save(buf, "PNG")
        images.append(engine_pb2.Image(data=buf.getvalue(), width=640, height=480, tokens=16))
    start = time.perf_counter()
    encoded, _ = encoder.encode_now(images)
    assert len(encoded) == n
    return n / (time.perf_counter() - start)


def best(rounds: int, fn: Any) -> float:
    return max(fn() for _ in range(rounds))


def measure(b: int, args: argparse.Namespace, full: Any, encoder: TorchEncoder) -> dict[str, float]:
    batch = prompts(b, args.prompt_tokens, seed=b)
    return {
        "batch": b,
        "engine_tok_s": best(args.rounds, lambda: asyncio.run(engine_tokens_per_s(batch, args.new_tokens))),
        "hf_serial_tok_s": best(args.rounds, lambda: hf_tokens_per_s(full.model, batch, args.new_tokens,
                                                                     batched=False)),
        "hf_batched_tok_s": best(args.rounds, lambda: hf_tokens_per_s(full.model, batch, args.new_tokens,
                                                                      batched=True)),
        "encode_img_s": best(args.rounds, lambda: encode_images_per_s(encoder, b)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    profile = load_catalog().model(MODEL)
    full = load_model(profile, model_path=None, seed=0, dtype="auto", device="cpu", keep="both")
    encoder = TorchEncoder(full, profile)
    rows = []
    for b in BATCHES:
        rows.append(measure(b, args, full, encoder))
        r = rows[-1]
        print(f"| {b} | {r['engine_tok_s']:.0f} | {r['hf_serial_tok_s']:.0f} | {r['hf_batched_tok_s']:.0f} "
              f"| {r['encode_img_s']:.1f} |", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "model": MODEL, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "rows": rows,
    }, indent=2))


if __name__ == "__main__":
    main()
