"""Two gateways that share nothing in front of the same engines: how often a conversation's next turn finds
its prefix cached, with and without the engines' KV cache events.

    python -m benchmarks kv-events-gateways [--conversations 40] [--turns 5] [--upstreams 4] [--rounds 3]
                                            [--restart-after TURN]

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

`--restart-after TURN` stops both gateways after that turn and starts two new ones (a rolling update, a
crash), and scores the turns after it; a third mode then names the engines' replay sockets
(`replay_endpoint`, `--kv-replay-endpoint`), which the new gateways ask for what the engines cached
before they started (results: benchmarks/results/kv_events_gateways_restart.json by default).
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


def start_gateways(stack: ExitStack, where: Path, backends: list[dict[str, Any]], healthy: int) -> list[Gateway]:
    gateways = []
    for g in range(2):
        folder = where / f"gateway-{g}"
        folder.mkdir(parents=True)
        config = write_config(folder, {"model": MODEL, "gateway": {"heartbeat_interval_ms": 200}, "backends": backends})
        gateways.append(stack.enter_context(run_gateway(config, healthy=healthy, timeout=90)))
    return gateways


def one_round(args: argparse.Namespace, events: bool, seed: int, replay: bool = False) -> dict[str, Any]:
    rng = random.Random(seed)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp, httpx.Client(timeout=30) as http:
        upstreams: dict[str, str] = {}
        specs: dict[str, dict[str, str]] = {}
        for k in range(args.upstreams):
            port, bid = free_port(), f"up-{k}"
            specs[bid] = {"endpoint": f"tcp://127.0.0.1:{free_port()}"}
            if replay:
                specs[bid]["replay_endpoint"] = f"tcp://127.0.0.1:{free_port()}"
            proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "demo-upstream", "--port", str(port),
                                     "--token-delay-ms", "5", "--kv-events-endpoint", specs[bid]["endpoint"],
                                     *(("--kv-replay-endpoint", specs[bid]["replay_endpoint"]) if replay else ())],
                                    cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(proc.kill)
            upstreams[bid] = f"http://127.0.0.1:{port}"
        backends = [{"id": bid, "kind": "openai", "gpu": "H100", "address": url, "scrape": {"engine": "vllm"},
                     **({"kv_events": specs[bid]} if events else {})}
                    for bid, url in upstreams.items()]
        run = stack.enter_context(ExitStack())   # the gateways, stopped and started again at --restart-after
        gateways = start_gateways(run, Path(tmp) / "0", backends, args.upstreams)
        if events:
            subscribed(http, gateways, upstreams, rng)
        conversations = [ids(rng, 512) for _ in range(args.conversations)]
        last: list[str | None] = [None] * args.conversations
        prompt_tokens = cached_tokens = followed = later = 0
        scored_from = 1 if args.restart_after is None else args.restart_after   # (turns counted from 0 here)
        for turn in range(args.turns):
            if turn == scored_from and args.restart_after is not None:
                run.close()
                gateways = start_gateways(run, Path(tmp) / "1", backends, args.upstreams)
                if replay:   # until the new gateways have asked every engine for its buffer
                    for g in gateways:
                        g.wait_until(lambda g=g: all((g.backend(bid)["prefix_cache"]["events"] or {}).get(
                            "replayed_batches") for bid in upstreams), timeout=30)
            for c in range(args.conversations):
                conversations[c] += ids(rng, 64)   # the user's message
            with ThreadPoolExecutor(args.conversations) as pool:   # every conversation's turn at once
                replies = list(pool.map(lambda c, t=turn, gw=gateways: complete(http, gw[(c + t) % 2].url,
                                                                                conversations[c], REPLY_TOKENS),
                                        range(args.conversations)))
            for c, resp in enumerate(replies):
                backend = resp.headers["x-heterogate-backend"]
                if turn >= scored_from:
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
    p.add_argument("--restart-after", type=int, default=None, metavar="TURN",
                   help="new gateways after this many turns (1 to --turns - 1); the turns after it are scored")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.restart_after is not None and not 1 <= args.restart_after < args.turns:
        p.error(f"--restart-after is a turn from 1 to {args.turns - 1}")
    out = args.out or ROOT / "benchmarks" / "results" / (
        "kv_events_gateways.json" if args.restart_after is None else "kv_events_gateways_restart.json")
    result: dict[str, Any] = {"conversations": args.conversations, "turns": args.turns, "upstreams": args.upstreams,
                              "rounds": args.rounds, "restart_after": args.restart_after, "modes": {}}
    scored = "2+" if args.restart_after is None else f"{args.restart_after + 1}+, after the restart"
    print(f"| gateways' view | hit rate of turns {scored}, per round (median) | "
          "same engine as the turn before (median) |")
    print("|---|---|---|")
    modes = [(False, False), (True, False)] + ([(True, True)] if args.restart_after is not None else [])
    for events, replay in modes:
        rounds = [one_round(args, events, seed, replay) for seed in range(args.rounds)]
        name = ("KV events and replay (replay_endpoint:)" if replay else "KV events (kv_events:)") if events else \
            "own routing only"
        hits = [r["hit_rate"] for r in rounds]
        same = [r["same_engine_share"] for r in rounds]
        result["modes"][name] = rounds
        print(f"| {name} | {', '.join(f'{100 * h:.1f}%' for h in hits)} ({100 * statistics.median(hits):.1f}%) | "
              f"{100 * statistics.median(same):.1f}% |", flush=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
