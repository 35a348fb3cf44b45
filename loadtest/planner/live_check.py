"""The planner's predictions against the live gateway: `python -m loadtest.planner.live_check`.

For each plan it runs one seeded trace twice:

    predicted  `loadtest.planner.evaluate.simulate`, exactly what `gateway plan` reports for the plan
    measured   the real gateway on 127.0.0.1 running the plan's backends.yaml (the one `gateway plan --out`
               writes: managed simulated engines of the same tiers and roles, launch.time_scale = s), the trace
               replayed open-loop as streamed chat completions, images as PNG data URLs; wall seconds / s
               are model seconds

and compares goodput, SLO attainment and tokens/s (the definitions of evaluate.py, applied by the same
function, `evaluate.outcome`, to both runs' per-request times). Each request is the trace's: its prompt
sized to the gateway's token estimate (4 bytes a token plus the chat message overhead; the model's tokens
per image for each image), its id chosen so that the simulated engine stops after exactly the trace's
output tokens (`loadtest.live_replay.request_id_for`), and max_tokens the trace's, so the engine reserves
the same KV.

Writes OUT/live_check.json (OUT: `--out`, by default results/planner under the current directory; the
results docs/PLANNING.md quotes are replaced only by `--out docs/results`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from common.catalog import Catalog, load_catalog
from gateway.requests.tokens import CHAT_MESSAGE_OVERHEAD
from loadtest.live_replay import START_DELAY_S, prompt_text, replay_client, request_id_for
from loadtest.planner.cli import backends_config
from loadtest.planner.evaluate import Outcome, outcome, simulate
from loadtest.planner.search import Problem
from loadtest.planner.space import Limits, Plan, Role, Slo
from loadtest.planner.workload import Description, described_trace
from loadtest.sim.engines import Recorder
from loadtest.sim.workloads import Trace
from testkit.harness import data_url, image_bytes, run_gateway, write_config

MODEL = "llava-1.5-7b"
DEFAULT_OUT = Path("results/planner")
RECORDED_OUT = Path("docs/results")
REQUEST_TIMEOUT_S = 120.0
# The plans checked by default, for the default workload (20 req/s, half with an image, outputs of 96 tokens
# on average): `gateway plan`'s best of each split on the demo tiers with $8/hour, one split plan below the
# target, a mixed pair and an overloaded pair (docs/PLANNING.md).
DEFAULT_PLANS = ("3xRTX-4090:both", "2xRTX-4090:language+1xRTX-4090:vision:steal",
                 "1xRTX-4090:language+2xRTX-4090:vision:steal", "1xA100-80GB:both+1xRTX-4090:both",
                 "2xRTX-4090:both")


@dataclass(frozen=True)
class Measured:
    outcome: Outcome             # evaluate.outcome of the live run's per-request times
    errors: int                  # requests that failed or ended without [DONE]
    wrong_token_counts: int      # completed requests whose streamed tokens are not the trace's output


def parse_plan(text: str) -> Plan:
    """`2xA100-80GB:language+1xRTX-4090:vision:steal` → a Plan (count x GPU : role, pools joined by +)."""
    pools: list[tuple[str, Role, int]] = []
    steal = False
    for part in text.split("+"):
        fields = part.split(":")
        n, sep, gpu = fields[0].partition("x")
        role = fields[1] if len(fields) > 1 else "language"
        if not sep or not n.isdigit() or role not in ("language", "vision", "both"):
            raise argparse.ArgumentTypeError(f"{part!r}: write COUNTxGPU:ROLE[:steal], e.g. 2xA100-80GB:language")
        steal = steal or fields[2:] == ["steal"]
        pools.append((gpu, role, int(n)))     # type: ignore[arg-type]  # checked against the roles above
    return Plan(tuple(sorted(pools, key=lambda p: p[1] == "vision")), steal)


def replay_body(trace: Trace, i: int, tag: str, images: list[str]) -> dict[str, Any]:
    """Request i as a streamed chat completion the gateway counts as the trace's prompt tokens: its text
    starts with `tag` (its own) and its `images` are its own, so no engine's prefix or embedding cache
    holds any of it, as the planner's workload has no sharing (the simulator's engines cache nothing)."""
    lengths = trace.lengths
    text_tokens = int(lengths.text_tokens[i])
    text = prompt_text(max(1, text_tokens - CHAT_MESSAGE_OVERHEAD), tag)
    content: str | list[dict[str, Any]] = text
    if images:
        content = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in images)]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": int(lengths.max_output_tokens[i]), "stream": True,
            "stream_options": {"include_usage": True}}


def request_images(trace: Trace, seed: int) -> list[list[str]]:
    """Each request's images as data URLs, every one its own (random pixels), made before the replay."""
    return [[data_url(image_bytes(noise=True, seed=seed * 1_000_003 + i * 64 + k)) for k in range(int(count))]
            for i, count in enumerate(trace.lengths.images)]


async def _stream_chat(client: httpx.AsyncClient, body: dict[str, Any], request_id: str) -> tuple[float, int, str]:
    """(time of the first content chunk, content chunks, error) of one streamed chat completion."""
    first, tokens, error = math.nan, 0, ""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"x-request-id": request_id}) as resp:
            if resp.status_code != 200:
                return first, 0, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            done = False
            async for line in resp.aiter_lines():
                payload = line.removeprefix("data:").strip()
                if not line.startswith("data:") or not payload:
                    continue
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    error = str(event["error"].get("message", event["error"]))
                elif any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    tokens += 1
                    if tokens == 1:
                        first = time.monotonic()
            error = error or ("" if done else "stream ended without [DONE]")
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return first, tokens, error


async def stream_trace(
    url: str, trace: Trace, time_scale: float, seed: int, origin: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """Send request i at origin + arrival_i × time_scale (open loop; origin: a time.monotonic() reading, by
    default START_DELAY_S after the client opens); per-request model-second times (sent, first token,
    finish), the tokens streamed and its error ("" for none)."""
    ids = [request_id_for(int(trace.lengths.output_tokens[i]), f"p{seed}-{i}") for i in range(trace.n)]
    images = request_images(trace, seed)
    n = trace.n
    sent, first, finish = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    tokens, errors = np.zeros(n, dtype=np.int64), [""] * n
    async with replay_client(url, n, REQUEST_TIMEOUT_S) as client:
        origin = time.monotonic() + START_DELAY_S if origin is None else origin

        async def one(i: int) -> None:
            sent[i] = time.monotonic()
            f, k, error = await _stream_chat(client, replay_body(trace, i, ids[i], images[i]), ids[i])
            first[i], tokens[i], errors[i] = f, k, error
            if not error:
                finish[i] = time.monotonic()

        tasks = []
        for i in range(n):
            delay = origin + float(trace.arrival_s[i]) * time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    sent, first, finish = ((a - origin) / time_scale for a in (sent, first, finish))
    return sent, first, finish, tokens, errors


def measure_live(plan: Plan, problem: Problem, time_scale: float, seed: int, workdir: Path) -> Measured:
    trace = problem.trace
    config = write_config(workdir, backends_config(plan, problem, time_scale))
    started, cpu = time.perf_counter(), time.process_time()
    deadline = float(trace.arrival_s[-1]) * time_scale + REQUEST_TIMEOUT_S
    with run_gateway(config) as gw:
        try:
            sent, first, finish, tokens, errors = asyncio.run(
                asyncio.wait_for(stream_trace(gw.url, trace, time_scale, seed), deadline))
        except TimeoutError:
            raise RuntimeError(f"live replay still running after {deadline:.0f} s:\n{gw.log_tail()}") from None
    n = trace.n
    rec = Recorder(trace.lengths, np.full(n, -1, dtype=np.int64), np.full(n, np.nan), first, finish,
                   np.zeros(n, dtype=bool))
    done = ~np.isnan(finish)
    wrong = int((tokens[done] != trace.lengths.output_tokens[done]).sum())
    measured = outcome(Trace(sent, trace.lengths), rec, problem.slo, plan.cost_per_hour(problem.catalog), started, cpu)
    return Measured(measured, sum(1 for e in errors if e), wrong)


def check(plan: Plan, problem: Problem, time_scale: float, seed: int) -> dict[str, Any]:
    predicted = simulate(plan, problem.trace, problem.model, problem.catalog, problem.slo, problem.policies)
    with tempfile.TemporaryDirectory(prefix="plan-check-") as tmp:
        measured = measure_live(plan, problem, time_scale, seed, Path(tmp))
    p, m = predicted, measured.outcome

    def diff(key: str) -> float:
        want, got = getattr(p, key), getattr(m, key)
        return (got - want) / want if want else math.nan

    return {"plan": plan.label(), "split": plan.split, "gpus": plan.gpus,
            "cost_per_hour": plan.cost_per_hour(problem.catalog), "predicted": p.as_dict(),
            "measured": {**m.as_dict(), "errors": measured.errors, "wrong_token_counts": measured.wrong_token_counts},
            **{f"{key}_diff": diff(key) for key in ("goodput_rps", "tokens_per_s", "throughput_tok_s")}}


def render(row: dict[str, Any]) -> str:
    p, m = row["predicted"], row["measured"]
    return (f"{row['plan']} ({row['split']}, ${row['cost_per_hour']:.2f}/h): goodput predicted "
            f"{p['goodput_rps']:.2f} measured {m['goodput_rps']:.2f} req/s ({row['goodput_rps_diff']:+.1%}); "
            f"attainment {p['attainment']:.1%} / {m['attainment']:.1%}; tokens/s {p['tokens_per_s']:,.0f} / "
            f"{m['tokens_per_s']:,.0f} ({row['tokens_per_s_diff']:+.1%}); to the last completion "
            f"{p['throughput_tok_s']:,.0f} / {m['throughput_tok_s']:,.0f} ({row['throughput_tok_s_diff']:+.1%}); "
            f"{m['completed']:.0f} completed, {m['errors']} errors, {m['wrong_token_counts']} wrong token counts, "
            f"{m['wall_s']:.0f} s wall")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.planner.live_check", description=__doc__.splitlines()[0])
    p.add_argument("--plans", type=parse_plan, nargs="+", default=[parse_plan(t) for t in DEFAULT_PLANS])
    p.add_argument("--rate", type=float, default=20.0, help="requests/s of model time")
    p.add_argument("--image-share", type=float, default=0.5)
    p.add_argument("--prompt-tokens", type=float, default=512.0)
    p.add_argument("--output-tokens", type=float, default=96.0, help="mean output (the engines emit at most 256)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of model time of arrivals")
    add_run_options(p, "live_check.json", time_scale=4.0)
    return p.parse_args(argv)


def add_run_options(p: argparse.ArgumentParser, results: str, time_scale: float) -> None:
    """The options every live check takes: the SLO, the engines' time scale, the seed and where `results` goes."""
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--itl-slo", type=float, default=0.1)
    p.add_argument("--time-scale", type=float, default=time_scale, help="launch.time_scale of every engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"where {results} goes (default {DEFAULT_OUT}/; `--out {RECORDED_OUT}` replaces the "
                        "results docs/PLANNING.md quotes)")


def problem_for(args: argparse.Namespace, catalog: Catalog) -> Problem:
    model = catalog.model(MODEL)
    desc = Description(args.rate, args.image_share, args.prompt_tokens, args.output_tokens)
    trace = described_trace(desc, model, round(args.rate * args.duration), args.seed)
    return Problem(catalog, model, trace, Slo(args.ttft_slo, args.itl_slo), Limits(budget_per_hour=1e9), ())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    catalog = load_catalog()
    problem = problem_for(args, catalog)
    rows = []
    for plan in args.plans:
        rows.append(check(plan, problem, args.time_scale, args.seed))
        print(render(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python -m loadtest.planner.live_check", *(argv if argv is not None else
                                                                             sys.argv[1:])]),
            "model": MODEL, "rate_rps": args.rate, "image_share": args.image_share, "requests": problem.trace.n,
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "slo": {"ttft_s": args.ttft_slo, "itl_s": args.itl_slo}, "time_scale": args.time_scale,
            "seed": args.seed, "units": "model seconds (live wall times divided by time_scale)"}
    (args.out / "live_check.json").write_text(json.dumps({**meta, "plans": rows}, indent=2) + "\n")
    print(f"wrote {args.out / 'live_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
