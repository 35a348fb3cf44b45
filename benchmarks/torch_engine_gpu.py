"""Monolithic against split torch engines through the gateway: generated tokens per second and time to first token.

    python benchmarks/torch_engine_gpu.py                        # LLaVA-1.5-7B, random weights, bf16, cuda
    python benchmarks/torch_engine_gpu.py --model llava-1.5-tiny --device cpu --dtype auto --concurrency 1,4

Two clusters, each a real gateway process launching real engine processes from a backends.yaml:
    monolithic  one `role: both` engine: it encodes the images and decodes, on one device;
    split       one `role: vision` engine (tower + projector only) on --vision-device and one
                `role: language` engine (decoder only) on --language-device; the embeddings travel over
                the engines' gRPC service.
Both build the same random weights (seed 0) from the catalog's Hugging Face config. For each concurrency C,
C clients each send --requests-per-client streamed chat requests one after another (closed loop), every
request with its own --image-size noise JPEG and the same short text, greedy, --max-tokens (a random model
never says EOS, so every answer has exactly that many tokens). Reported per setup and concurrency: generated
tokens per second of wall time, TTFT (first content chunk) p50/p90, request latency p50; and split against
monolithic. With --rounds > 1 the setups alternate round by round and the medians are shown.
Writes benchmarks/results/torch_engine_gpu_<model>_<device>.json (or --out).

On one GPU the split's two processes share it: the language engine sizes its KV from --memory-utilization
of the device less what is in use when it starts (the vision engine's weights, if already loaded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from testkit.harness import Gateway, data_url, image_bytes, image_part, run_gateway, text_part, write_config  # noqa: E402

SETUPS = ("monolithic", "split")
PROMPT = "Describe this picture in detail."


@dataclass(frozen=True)
class Request:
    ttft_s: float
    latency_s: float
    tokens: int


def launch(args: argparse.Namespace, device: str) -> dict[str, Any]:
    return {"executor": "torch", "random_weights": True, "seed": 0, "device": device, "dtype": args.dtype,
            "max_batch": max(args.concurrency), "max_model_len": args.max_model_len,
            "memory_utilization": args.memory_utilization, "vision_batch_timeout_ms": args.vision_batch_timeout_ms}


def cluster(args: argparse.Namespace, setup: str) -> dict[str, Any]:
    """backends.yaml of one setup; `gpu` is the profile the router plans with, the engines run on `device`."""
    if setup == "monolithic":
        backends = [{"id": "both-0", "role": "both", "gpu": "H100", "launch": launch(args, args.device)}]
    else:
        backends = [
            {"id": "vision-0", "role": "vision", "gpu": "H100", "launch": launch(args, args.vision_device)},
            {"id": "lang-0", "role": "language", "gpu": "H100", "launch": launch(args, args.language_device)},
        ]
    return {"model": args.model, "gateway": {"stealing": {"enabled": False}}, "backends": backends}


async def one_request(http: httpx.AsyncClient, model: str, image: bytes, max_tokens: int) -> Request:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [image_part(data_url(image, "image/jpeg")), text_part(PROMPT)]}]}
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    if ttft is None:
        raise RuntimeError("a streamed answer without content")
    return Request(ttft, time.perf_counter() - start, tokens)


async def level(gw: Gateway, args: argparse.Namespace, concurrency: int, images: list[bytes]) -> dict[str, Any]:
    """C closed-loop clients; returns the row of this concurrency."""
    timeout = httpx.Timeout(args.request_timeout_s, connect=10)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=gw.url, timeout=timeout, limits=limits) as http:
        async def client(c: int) -> list[Request]:
            return [await one_request(http, args.model, images[(c * args.requests_per_client + i) % len(images)],
                                      args.max_tokens) for i in range(args.requests_per_client)]

        start = time.perf_counter()
        done = [r for rs in await asyncio.gather(*(client(c) for c in range(concurrency))) for r in rs]
        wall = time.perf_counter() - start
    ttfts = sorted(r.ttft_s for r in done)
    return {
        "concurrency": concurrency, "requests": len(done), "tokens": sum(r.tokens for r in done),
        "tok_s": sum(r.tokens for r in done) / wall,
        "ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p90_ms": 1000 * ttfts[math.ceil(0.9 * len(ttfts)) - 1],
        "latency_p50_s": statistics.median(r.latency_s for r in done),
    }


def run_setup(args: argparse.Namespace, setup: str, images: list[bytes], tmp: Path) -> list[dict[str, Any]]:
    config = write_config(tmp, cluster(args, setup))
    with run_gateway(config, timeout=args.startup_timeout_s) as gw:
        asyncio.run(level(gw, args, 1, images[:1]))   # warm-up: first-call allocations, kernel selection
        return [asyncio.run(level(gw, args, c, images)) for c in args.concurrency]


def median_rows(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per concurrency, the median of each figure over the rounds (the concurrency itself as given)."""
    return [{**{k: statistics.median(r[i][k] for r in rounds) for k in rounds[0][i]},
             "concurrency": rounds[0][i]["concurrency"]} for i in range(len(rounds[0]))]


def print_table(summary: dict[str, list[dict[str, Any]]]) -> None:
    print("| concurrency | setup | tok/s | TTFT p50 ms | TTFT p90 ms | latency p50 s |")
    print("|---|---|---|---|---|---|")
    for i, c in enumerate(r["concurrency"] for r in summary["monolithic"]):
        for setup in SETUPS:
            r = summary[setup][i]
            print(f"| {c} | {setup} | {r['tok_s']:,.1f} | {r['ttft_p50_ms']:,.0f} | {r['ttft_p90_ms']:,.0f} | "
                  f"{r['latency_p50_s']:.2f} |")
        mono, split = summary["monolithic"][i], summary["split"][i]
        print(f"| {c} | split / monolithic | {split['tok_s'] / mono['tok_s']:.2f}x | "
              f"{split['ttft_p50_ms'] / mono['ttft_p50_ms']:.2f}x | | |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default="llava-1.5-7b")
    p.add_argument("--device", default="cuda", help="the monolithic engine's device, and the split's by default")
    p.add_argument("--vision-device", default=None)
    p.add_argument("--language-device", default=None)
    p.add_argument("--dtype", default="bfloat16", help="auto: the catalog model's dtype")
    p.add_argument("--concurrency", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024, help="KV tokens per sequence slot")
    p.add_argument("--image-size", default="640x480", type=lambda s: tuple(int(x) for x in s.split("x")))
    p.add_argument("--memory-utilization", type=float, default=0.85)
    p.add_argument("--vision-batch-timeout-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.vision_device = args.vision_device or args.device
    args.language_device = args.language_device or args.device
    return args


def write_results(args: argparse.Namespace, runs: dict[str, list[list[dict[str, Any]]]]) -> Path:
    """The medians of the rounds run so far and every round's rows, as JSON: written after each round, so a
    run cut short keeps what it measured."""
    import torch

    name = f"torch_engine_gpu_{args.model}_{args.device.split(':')[0]}.json"
    out: Path = args.out or ROOT / "benchmarks" / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    done = min(len(r) for r in runs.values())
    out.write_text(json.dumps({
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "out"},
        "torch": torch.__version__, "host": platform.node(), "cpu": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available() else None,
        "rounds_done": done, "summary": {s: median_rows(runs[s][:done]) for s in SETUPS}, "rounds": runs,
    }, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n_images = max(args.concurrency) * args.requests_per_client
    images = [image_bytes("JPEG", args.image_size, noise=True, seed=i) for i in range(n_images)]
    runs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in SETUPS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for setup in SETUPS:
                where = Path(tmp) / f"{setup}-{r}"
                where.mkdir()
                start = time.perf_counter()
                runs[setup].append(run_setup(args, setup, images, where))
                print(f"round {r + 1}/{args.rounds}: {setup} done in {time.perf_counter() - start:.0f} s", flush=True)
            out = write_results(args, runs)
            print(f"{args.model}, {args.dtype}, monolithic on {args.device}, split: vision on {args.vision_device}, "
                  f"language on {args.language_device}; {args.max_tokens} tokens per answer, one "
                  f"{args.image_size[0]}x{args.image_size[1]} image per request; medians of {r + 1} round(s)")
            print_table({s: median_rows(runs[s]) for s in SETUPS})
            sys.stdout.flush()
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
