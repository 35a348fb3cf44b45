"""Two gateways that share nothing in front of the same engines: how often a conversation's next turn finds
its prefix cached, with and without the engines' KV cache events.

    python -m benchmarks kv-events-gateways [--conversations 40] [--turns 5] [--upstreams 4] [--rounds 3]

Four demo upstreams (gateway/demo_upstream.py) cache prompts of token ids in blocks of 16 tokens and
publish their KV events as vLLM does (`--kv-events-endpoint`); two gateway processes, no Redis, route to
all four, either without `kv_events:` (each knows only what it routed itself) or with it (both follow
what every engine stores). Conversations of token ids (a 512-token system prompt of their own, 64 tokens
a user message, 64 an answer: each turn resends the whole history) send their turns to the gateways in
turn, so each turn reaches the gateway that did not route the one before, as behind a round-robin
balancer. Every conversation sends its turn at once (each reply streams 16 tokens, 5 ms apart), so the
gateways spread them over the engines by load, and where each turn goes is the cost model's choice between
the prefix an engine holds and its load. Per mode, medians over rounds (fresh engines each round):
the prompt tokens the engines found cached over the prompt tokens of turns 2 and later, and the share of
those turns routed to the engine that served the turn before. Prints a table and writes
benchmarks/results/kv_events_gateways.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from testkit.harness import Gateway, free_port, run_gateway, write_config  # noqa: E402

MODEL = "llava-1.5-7b"
REPLY_TOKENS = 16


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 30000) for _ in range(n)]


def complete(http: httpx.Client, url: str, prompt: list[int], max_tokens: int = 1) -> httpx.Response:
    resp = http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
    resp.raise_for_status()
    return resp


def subscribed(http: httpx.Client, gateways: list[Gateway], upstreams: dict[str, str], rng: random.Random) -> None:
    """Until every gateway hears every engine's events (a subscription joins a moment after it connects)."""
    deadline = time.monotonic() + 30
    for bid, url in upstreams.items():
        while not all((g.backend(bid)["prefix_cache"]["events"] or {}).get("stored_blocks") for g in gateways):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateways never heard {bid}'s KV events")
            complete(http, url, ids(rng, 64))
            time.sleep(0.05)


def one_round(args: argparse.Namespace, events: bool, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp, httpx.Client(timeout=30) as http:
        upstreams: dict[str, str] = {}
        endpoints: dict[str, str] = {}
        for k in range(args.upstreams):
            port, bid = free_port(), f"up-{k}"
            endpoints[bid] = f"tcp://127.0.0.1:{free_port()}"
            proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "demo-upstream", "--port", str(port),
                                     "--token-delay-ms", "5", "--kv-events-endpoint", endpoints[bid]],
                                    cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(proc.kill)
            upstreams[bid] = f"http://127.0.0.1:{port}"
        backends = [{"id": bid, "kind": "openai", "gpu": "H100", "address": url, "scrape": {"engine": "vllm"},
                     **({"kv_events": {"endpoint": endpoints[bid]}} if events else {})}
                    for bid, url in upstreams.items()]
        gateways = []
        for g in range(2):
            where = Path(tmp) / f"gateway-{g}"
            where.mkdir()
            config = write_config(where, {"model": MODEL, "gateway": {"heartbeat_interval_ms": 200},
                                          "backends": backends})
            gateways.append(stack.enter_context(run_gateway(config, healthy=args.upstreams, timeout=90)))
        if events:
            subscribed(http, gateways, upstreams, rng)
        conversations = [ids(rng, 512) for _ in range(args.conversations)]
        last: list[str | None] = [None] * args.conversations
        prompt_tokens = cached_tokens = followed = later = 0
        for turn in range(args.turns):
            for c in range(args.conversations):
                conversations[c] += ids(rng, 64)   # the user's message
            with ThreadPoolExecutor(args.conversations) as pool:   # every conversation's turn at once
                replies = list(pool.map(lambda c, t=turn: complete(http, gateways[(c + t) % 2].url, conversations[c],
                                                                   REPLY_TOKENS), range(args.conversations)))
            for c, resp in enumerate(replies):
                backend = resp.headers["x-heterogate-backend"]
                if turn:
                    usage = resp.json()["usage"]
                    prompt_tokens += usage["prompt_tokens"]
                    cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                    followed += backend == last[c]
                    later += 1
                last[c] = backend
                conversations[c] += ids(rng, 64)   # the answer, resent with the next turn
            time.sleep(args.gap_s)   # the engines' events reach the gateways (as a think time would)
        return {"hit_rate": cached_tokens / prompt_tokens, "same_engine_share": followed / later,
                "turns_scored": later}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--upstreams", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gap-s", type=float, default=0.2, help="pause between turns (events reach the gateways)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_events_gateways.json")
    args = p.parse_args()
    result: dict[str, Any] = {"conversations": args.conversations, "turns": args.turns, "upstreams": args.upstreams,
                              "rounds": args.rounds, "modes": {}}
    print("| gateways' view | hit rate of turns 2+, per round (median) | same engine as the turn before (median) |")
    print("|---|---|---|")
    for events in (False, True):
        rounds = [one_round(args, events, seed) for seed in range(args.rounds)]
        name = "KV events (kv_events:)" if events else "own routing only"
        hits = [r["hit_rate"] for r in rounds]
        same = [r["same_engine_share"] for r in rounds]
        result["modes"][name] = rounds
        print(f"| {name} | {', '.join(f'{100 * h:.1f}%' for h in hits)} ({100 * statistics.median(hits):.1f}%) | "
              f"{100 * statistics.median(same):.1f}% |", flush=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
