"""`gateway plan`: which GPUs, in which roles, for a workload, SLOs and a budget or an inventory.

    gateway plan --rate 40 --image-share 0.5 --budget 30 --out backends.yaml

prints the best plans the search found (predicted goodput, SLO attainment, tokens/s, tokens per dollar),
what the search cost, and with `--out` writes the best plan as a backends.yaml of managed simulated
engines that `gateway --backends` runs as it is. docs/PLANNING.md describes the method and how its
predictions compare with the live gateway.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from common.catalog import CONFIG_DIR, ModelProfile, load_catalog
from common.errors import ConfigError
from common.one_line_parser import OneLineParser
from gateway.routing.policies import build_policy
from loadtest.planner.evaluate import Policies
from loadtest.planner.options import (
    MAX_WORKERS,
    at_least,
    count,
    inventory,
    names,
    non_negative,
    positive,
    rate,
    seed,
    share,
    some_share,
    unwritable,
    workers,
)
from loadtest.planner.pool import stopped_in_one_line
from loadtest.planner.search import GROUPINGS, Evaluated, Problem, SearchResult, search
from loadtest.planner.space import SPLITS, Limits, Plan, Slo, Split, decoder_fits, trace_rate
from loadtest.planner.workload import (
    MAX_RATE_RPS,
    MAX_TRACE_REQUESTS,
    Description,
    WorkloadError,
    clipped_prompt_mean,
    described_trace,
    log_trace,
    named_trace,
)
from loadtest.sim.workloads import Trace

PROG = "gateway plan"
DEFAULT_MODEL = "llava-1.5-7b"          # the demo cluster's model
MIN_REQUESTS = 200                      # a trace shorter than this says too little of a plan's attainment
CLIP_NOTICE = 0.99                      # say so when the context clip takes the mean prompt below this share
DESCRIPTION = ("image_share", "prompt_tokens", "output_tokens", "images_per_request")
# what a simulator workload or a request log brings of its own: the options that describe it would be ignored
IGNORED_WITH = {"workload": DESCRIPTION, "trace": (*DESCRIPTION, "arrivals", "duration", "seed")}
ID_STEM_CHARS = 48                      # a written id's GPU part; the config's ids are 64 characters at most


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0] if __doc__ else None)
    w = p.add_argument_group("workload (a description, a simulator workload, or a gateway request log)")
    w.add_argument("--rate", type=rate, help=f"arrival rate, requests/s, at most {MAX_RATE_RPS:,.0f} (a request "
                   "log's own rate if omitted)")
    w.add_argument("--image-share", type=share, default=0.0, help="share of requests with images (default 0)")
    w.add_argument("--prompt-tokens", type=positive, default=512.0, help="mean prompt tokens of a text request")
    w.add_argument("--output-tokens", type=positive, default=128.0, help="mean output tokens")
    w.add_argument("--images-per-request", type=count, default=1, help="images of an image request (default 1)")
    w.add_argument("--arrivals", choices=("poisson", "bursty"), default="poisson")
    w.add_argument("--workload", help="a workload of loadtest/sim/workloads.py instead of the description")
    w.add_argument("--trace", type=Path, help="the gateway's JSON request log (its `\"event\": \"request\"` lines)")
    w.add_argument("--duration", type=positive, default=30.0,
                   help="seconds of arrivals each plan is simulated for (default 30)")
    w.add_argument("--requests", type=at_least(MIN_REQUESTS, MAX_TRACE_REQUESTS),
                   help=f"simulate this many requests instead of --duration's (at least {MIN_REQUESTS}, at most "
                        f"{MAX_TRACE_REQUESTS:,}: the trace's bound, which --rate times --duration must keep too)")
    w.add_argument("--seed", type=seed, default=0)
    s = p.add_argument_group("service level")
    s.add_argument("--ttft-slo", type=positive, default=2.0, help="time to first token, seconds (default 2)")
    s.add_argument("--itl-slo", type=positive, default=0.1, help="mean inter-token time, seconds (default 0.1)")
    s.add_argument("--attainment", type=some_share, default=0.9,
                   help="share of requests that must meet both SLOs (default 0.9)")
    c = p.add_argument_group("GPUs")
    c.add_argument("--model", default=DEFAULT_MODEL, help=f"catalog model (default {DEFAULT_MODEL})")
    c.add_argument("--catalog", type=Path, default=CONFIG_DIR,
                   help="folder with gpus.yaml (prices) and models.yaml (default: the gateway's catalog)")
    c.add_argument("--gpus", type=names, help="GPU types to consider, comma-separated (default: all in the catalog)")
    money = c.add_mutually_exclusive_group(required=True)
    money.add_argument("--budget", type=positive, help="$/hour the plan may cost")
    money.add_argument("--inventory", type=inventory, help="GPUs on hand, e.g. H100=4,L40S=8")
    c.add_argument("--max-gpus", type=count, default=16, help="GPUs in a plan at most (default 16)")
    c.add_argument("--max-types", type=count, default=3, help="GPU types in the language pool at most (default 3)")
    c.add_argument("--max-vision", type=count, default=2, help="GPUs in a split plan's vision pool at most")
    c.add_argument("--splits", type=names, default=SPLITS, help=f"stage splits to consider ({', '.join(SPLITS)})")
    c.add_argument("--no-steal", action="store_true", help="a split plan's vision GPUs take no language work")
    r = p.add_argument_group("search and output")
    r.add_argument("--policy", default=Policies.language, help="language routing policy (default the gateway's)")
    r.add_argument("--vision-policy", default=Policies.vision, help="vision routing policy")
    r.add_argument("--no-overload", action="store_true",
                   help="plan for a gateway whose overload queue is off (gateway.overload.enabled: false)")
    r.add_argument("--compare", choices=GROUPINGS, default="none",
                   help="also find the best plan of each stage split, of one-type and mixed fleets, or both")
    r.add_argument("--max-simulations", type=count, default=200)
    r.add_argument("--time-limit", type=positive, default=240.0, help="seconds before the search stops")
    r.add_argument("--workers", type=workers, default=min(2, os.cpu_count() or 1),
                   help=f"simulation processes (at most {MAX_WORKERS}: four per core)")
    r.add_argument("--top", type=count, default=8, help="plans to print")
    r.add_argument("--out", type=Path, help="write the best plan here as a backends.yaml")
    r.add_argument("--time-scale", type=non_negative, default=1.0, help="launch.time_scale of the written engines")
    r.add_argument("--json", type=Path, help="write the search's results here as JSON")
    args = p.parse_args(argv)
    if args.trace is None and args.rate is None:
        p.error("give the arrival rate (--rate), or a request log (--trace) whose rate is used")
    if args.trace is not None and args.workload is not None:
        p.error("give a request log (--trace) or a simulator workload (--workload), not both")
    if args.trace is None and args.requests is None and args.rate * args.duration > MAX_TRACE_REQUESTS:
        p.error(f"--rate {args.rate:g} for --duration {args.duration:g} s makes {args.rate * args.duration:,.0f} "
                f"requests; a simulated trace holds at most {MAX_TRACE_REQUESTS:,}: shorten --duration or give "
                "--requests")
    bad = [s for s in args.splits if s not in SPLITS]
    if bad:
        p.error(f"--splits: {', '.join(bad)}; choose from {', '.join(SPLITS)}")
    if args.gpus and args.inventory and not set(args.gpus) & {g for g, _ in args.inventory}:
        p.error(f"--gpus {','.join(args.gpus)} and --inventory {','.join(g for g, _ in args.inventory)} have no GPU "
                "type in common: a plan takes only the GPUs of both")
    if why := target_error(args.ttft_slo, args.itl_slo, args.time_scale, not args.no_overload):
        p.error(why)
    for source, options in IGNORED_WITH.items():
        given = [o for o in options if getattr(args, source) is not None and getattr(args, o) != p.get_default(o)]
        if given:
            p.error(f"--{source} brings its own traffic, so {', '.join(_flag(o) for o in given)} would be ignored: "
                    "give one or the other")
    return args


def target_error(ttft_s: float, itl_s: float, time_scale: float, overload: bool) -> str | None:
    """Why the gateway would refuse a target the plan is simulated or written with (None: it takes them all; the
    overload queue's count only where it is on). Each option is finite alone, but a product may not be
    (`--itl-slo 1e306` is 1e309 ms), and half of a subnormal TTFT SLO (the overload queue's hold bound and
    wait) is 0 s: one line naming the options, not a file that check-config refuses or pydantic's lines."""
    scale = time_scale or 1.0
    itl, ttft = f"--itl-slo {itl_s:g}", f"--ttft-slo {ttft_s:g}"
    targets = [(itl, "gateway.routing.itl_target_ms", itl_target_ms(itl_s, scale))]
    if overload:
        targets += [(ttft, "gateway.overload.ttft_slo_s", ttft_s * scale),
                    (ttft, "the simulated overload queue's hold_above_s and max_wait_s (TTFT SLO / 2)", ttft_s / 2),
                    (ttft, "gateway.overload.hold_above_s and max_wait_s", ttft_s / 2 * scale)]
    for option, target, value in targets:
        if not (math.isfinite(value) and value > 0):
            return (f"{option} with --time-scale {time_scale:g} makes {target} {value:g}; the gateway takes a "
                    "finite positive number")
    return None


def itl_target_ms(itl_s: float, scale: float) -> float:
    """The written inter-token target: six significant digits, not decimals, so that a float's noise goes and a
    target under a microsecond (a tight SLO on fast engines) does not become 0 ms, which the gateway refuses."""
    return float(f"{itl_s * 1000 * scale:.6g}")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def build_trace(args: argparse.Namespace, model: ModelProfile) -> Trace:
    if args.trace is not None:
        logged = log_trace(args.trace, model, args.rate, args.requests)
        if logged.n > MAX_TRACE_REQUESTS:
            raise WorkloadError(f"--trace {args.trace}: {logged.n:,} requests, more than the {MAX_TRACE_REQUESTS:,} "
                                "a simulated trace holds: give --requests to take the first ones")
        if args.requests and logged.n < args.requests:
            raise WorkloadError(f"--requests {args.requests:,}: the request log {args.trace} holds {logged.n:,} served "
                                "requests (--requests takes the first ones of a log, it makes no more)")
        if args.rate is not None and logged.n < MIN_REQUESTS:
            # squeezed into a moment, a few requests load no plan: every plan "sustains" the rate
            span = float(logged.arrival_s[-1] - logged.arrival_s[0])
            raise WorkloadError(f"--trace {args.trace}: {logged.n:,} served requests at --rate {args.rate:g} span "
                                f"{span:.3g} s, too few to load a plan (at least {MIN_REQUESTS}, as a described "
                                "workload has): replay the log at its own rate (no --rate) or give a longer one")
        return logged
    n = args.requests or max(MIN_REQUESTS, round(args.rate * args.duration))
    if args.workload is not None:
        trace, clipped = named_trace(args.workload, model, args.rate, n, args.seed, args.arrivals)
        if clipped:
            print(f"{PROG}: note: --workload {args.workload}: {clipped:,} of {n:,} prompts are clipped to what model "
                  f"{model.name}'s context of {model.max_context} tokens leaves beside their images and output",
                  file=sys.stderr)
        return trace
    desc = Description(args.rate, args.image_share, args.prompt_tokens, args.output_tokens,
                       args.images_per_request, args.arrivals)
    trace = described_trace(desc, model, n, args.seed)
    kept = clipped_prompt_mean(desc, model)
    if desc.image_share < 1 and kept < CLIP_NOTICE * desc.prompt_tokens:
        print(f"{PROG}: note: --prompt-tokens {desc.prompt_tokens:g}: text prompts are clipped to what model "
              f"{model.name}'s context leaves beside the output, a mean of about {kept:.0f} tokens", file=sys.stderr)
    return trace


def build_problem(args: argparse.Namespace) -> Problem:
    catalog = load_catalog(args.catalog)
    model = catalog.model(args.model)
    gpus = args.gpus or tuple(catalog.gpus)
    for g in gpus:
        catalog.gpu(g)
    for g, _ in args.inventory or ():
        catalog.gpu(g)
    if args.inventory is not None:
        gpus = tuple(g for g in gpus if dict(args.inventory).get(g, 0) > 0)
    if gpus and not any(decoder_fits(model, catalog.gpu(g), "language") for g in gpus):
        # no budget or inventory of these types serves it: "raise the budget" would be the wrong advice
        raise WorkloadError(f"model {args.model}'s weights ({model.weight_bytes / 1e9:.1f} GB) leave no room for a KV "
                            f"cache on any GPU allowed ({', '.join(gpus)}): allow a larger one (--gpus, --inventory)")
    for policy in (args.policy, args.vision_policy):
        build_policy(policy)
    splits: tuple[Split, ...] = tuple(s for s in SPLITS if s in args.splits)
    limits = Limits(args.budget, args.inventory, args.max_gpus, args.max_types, args.max_vision)
    problem = Problem(catalog, model, build_trace(args, model), Slo(args.ttft_slo, args.itl_slo), limits, gpus,
                      args.attainment, splits, not args.no_steal,
                      Policies(args.policy, args.vision_policy, not args.no_overload),
                      args.compare)
    if not problem.images and "monolithic" not in splits:
        raise WorkloadError("--splits E+PD: a split plan's vision pool encodes images, and no request of this "
                            "workload carries one; only monolithic plans serve it")
    return problem


def backends_config(plan: Plan, problem: Problem, time_scale: float, catalog: Path | None = None) -> dict[str, Any]:
    """The plan as backends.yaml content: one managed simulated engine per GPU (configs/backends.yaml's form),
    naming `catalog` (a folder) where the plan was made with a catalog other than the built-in one.
    Engines slowed by `time_scale` take that many seconds for one of the model's, so the gateway's
    targets in seconds (the inter-token target, the overload queue's TTFT, hold bound and wait) are
    scaled by it too: the SLO the plan was sought for, in the time the gateway measures (time_scale 0,
    engines that take no time: unscaled)."""
    scale = time_scale or 1.0
    backends: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for gpu, role, steal in plan.members():
        stem = f"{id_stem(gpu)}-vision" if role == "vision" else id_stem(gpu)
        k = seen[stem] = seen.get(stem, -1) + 1
        entry: dict[str, Any] = {"id": f"{stem}-{k}", "role": role, "gpu": gpu}
        if steal:
            entry["steal"] = True
        entry["launch"] = {"time_scale": time_scale}
        backends.append(entry)
    routing = {"policy": problem.policies.language, "vision_policy": problem.policies.vision,
               "itl_target_ms": itl_target_ms(problem.slo.itl_s, scale)}
    queue = problem.slo.overload()
    overload = ({"ttft_slo_s": queue.ttft_slo_s * scale, "hold_above_s": queue.hold_above_s * scale,
                 "max_wait_s": queue.max_wait_s * scale}
                if problem.policies.overload else {"enabled": False})
    named = {"catalog": str(catalog)} if catalog is not None else {}
    return {**named, "model": problem.model.name, "gateway": {"routing": routing, "overload": overload},
            "backends": backends}


def shell_word(arg: str) -> str:
    """`arg` as a shell (bash) reads it back: shlex's quoting, or $'...' with escapes where it holds a character
    a YAML comment cannot (a newline ends the written file's header comment; a control character makes the
    file no YAML), so that the header's command is one line that runs again as it was given."""
    if arg.isprintable():
        return shlex.quote(arg)
    return "$'" + "".join(_ansi_c(c) for c in arg) + "'"


def _ansi_c(char: str) -> str:
    """One character inside $'...': itself where printable, else bash's escape for it."""
    if char in "\\'":
        return "\\" + char
    if char.isprintable():
        return char
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:         # a byte of the command line that is no UTF-8, as Python holds it
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x80 else f"\\U{code:08x}"


def id_stem(gpu: str) -> str:
    """A catalog GPU name as the start of a backend id, which the config allows letters, digits, `.`, `_`
    and `-` in (`A100/40GB` → `a100-40gb`): lower case, every run of other characters one `-`, at most
    ID_STEM_CHARS. Two names may share a stem; the counter after it keeps the ids apart."""
    stem = re.sub(r"[^a-z0-9._-]+", "-", gpu.lower()).strip("-")[:ID_STEM_CHARS]
    return stem or "gpu"


def write_backends(path: Path, plan: Evaluated, problem: Problem, time_scale: float, command: str,
                   catalog: Path | None = None) -> None:
    """The plan as a backends.yaml, its header saying how it was made and what it predicts."""
    o = plan.outcome
    header = [
        f"Written by `{command}`.",
        f"Plan: {plan.plan.label()} ({plan.plan.split}), ${plan.candidate.cost_per_hour:.2f}/hour.",
        f"Predicted at {problem.trace.n} requests, {trace_rate(problem.trace):.1f} req/s: "
        f"goodput {o.goodput_rps:.1f} req/s, "
        f"SLO attainment {o.attainment:.1%} (TTFT <= {problem.slo.ttft_s:g} s, inter-token <= "
        f"{problem.slo.itl_s * 1000:g} ms), {o.tokens_per_s:,.0f} tokens/s.",
        "Managed simulated engines; give each its real engine (launch or address) to run it on GPUs.",
    ]
    body = yaml.safe_dump(backends_config(plan.plan, problem, time_scale, catalog), sort_keys=False, width=120)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"# {line}\n" for line in header) + body)


def render(result: SearchResult, problem: Problem, top: int) -> str:
    t, slo, lim = problem.trace, problem.slo, problem.limits
    images = float((t.lengths.image_tokens > 0).mean())
    span = float(t.arrival_s[-1] - t.arrival_s[0])
    money = (f"budget ${lim.budget_per_hour:.2f}/hour" if lim.budget_per_hour is not None
             else "inventory " + ", ".join(f"{n}×{g}" for g, n in lim.inventory or ()))
    lines = [
        f"workload: {problem.model.name}, {result.rate_rps:.1f} req/s ({t.n} requests over {span:.0f} s), "
        f"{images:.0%} with images, mean prompt {t.lengths.input_tokens.mean():.0f} / output "
        f"{t.lengths.output_tokens.mean():.0f} tokens",
        f"SLO: TTFT <= {slo.ttft_s:g} s and mean inter-token <= {slo.itl_s * 1000:g} ms for {problem.target:.0%} "
        f"of requests; {money}, at most {lim.max_gpus} GPUs, GPU types: {', '.join(problem.gpus)}",
        f"search: {result.considered:,} plans considered, {result.ruled_out:,} ruled out by the capacity bound, "
        f"{result.ruled_out_subplan:,} as sub-plans of failed plans, {result.simulated} simulated, "
        f"{result.left:,} left unresolved; {result.seconds:.1f} s "
        f"(enumerate {result.timings['enumerate_s']:.1f} s, bound {result.timings['bound_s']:.1f} s, "
        f"simulate {result.timings['simulate_s']:.1f} s; {result.cpu_s:.1f} CPU-s of simulation)",
    ]
    if result.left:
        lines.append(f"  stopped by --max-simulations or --time-limit: {result.left:,} plans no rule had ruled out "
                     "were not simulated; the best below is the best found, not proven the best")
    lines.append("")
    if result.ranked:   # none fits the limits: no table, the line below says so
        lines += ["best plans (simulated; sustains = the attainment target is met over the whole trace and its "
                  "last third)", _table(result.ranked[:top], result.target)]
    if len(result.best_by_group) > 1:
        lines += ["", f"best of each group ({problem.grouping})",
                  _table(list(result.best_by_group.values()), result.target, result.best_by_group)]
    best = result.best
    if best is None and result.left:
        lines.append(f"the time limit ended the search before any plan was simulated ({result.left:,} plans were "
                     "left): give a longer --time-limit")
    elif best is None:
        lines.append("no plan fits the limits: raise the budget or the inventory, or allow more GPU types")
    elif not best.outcome.sustains(result.target):
        lines.append(f"no plan within the limits sustains {result.target:.0%} attainment; the best serves "
                     f"{best.outcome.goodput_rps:.1f} of {result.rate_rps:.1f} req/s within the SLO")
    elif best.candidate.bound_rps < result.rate_rps:
        span = float(problem.trace.arrival_s[-1] - problem.trace.arrival_s[0])
        lines.append(f"note: the best plan's capacity bound ({best.candidate.bound_rps:.1f} req/s) is below the rate "
                     f"({result.rate_rps:.1f}): it may sustain this {span:.0f} s trace only because the trace ends "
                     f"before its backlog passes the TTFT SLO; check it on a longer trace (--duration)")
    return "\n".join(lines)


def _table(rows: list[Evaluated], target: float, groups: dict[str, Evaluated] | None = None) -> str:
    head = ["#", "plan", "split", "GPUs", "$/hour", "bound req/s", "goodput req/s", "attainment", "last third",
            "sustains", "tokens/s", "tokens/$", "TTFT p95 s", "ITL p95 ms"]
    names = list(groups) if groups else None
    body = []
    for k, e in enumerate(rows):
        o = e.outcome
        body.append([names[k] if names else str(k + 1), e.plan.label(), e.plan.split, str(e.plan.gpus),
                     f"{e.candidate.cost_per_hour:.2f}", f"{e.candidate.bound_rps:.1f}", f"{o.goodput_rps:.1f}",
                     f"{o.attainment:.1%}", f"{o.late_attainment:.1%}", "yes" if o.sustains(target) else "no",
                     f"{o.tokens_per_s:,.0f}", f"{o.tokens_per_dollar:,.0f}", f"{o.ttft_p95_s:.2f}",
                     f"{o.itl_p95_s * 1000:.0f}"])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                                 strict=True)))
                     for r in [head, *body])


def as_json(result: SearchResult, problem: Problem) -> dict[str, Any]:
    def row(e: Evaluated) -> dict[str, Any]:
        return {"plan": e.plan.label(), "split": e.plan.split, "pools": [list(p) for p in e.plan.pools],
                "steal": e.plan.steal, "gpus": e.plan.gpus, "cost_per_hour": e.candidate.cost_per_hour,
                "bound_rps": e.candidate.bound_rps, **e.outcome.as_dict(),
                "sustains": e.outcome.sustains(result.target)}

    return {"model": problem.model.name, "rate_rps": result.rate_rps, "requests": problem.trace.n,
            "slo": {"ttft_s": problem.slo.ttft_s, "itl_s": problem.slo.itl_s, "attainment": result.target},
            "search": {"considered": result.considered, "ruled_out": result.ruled_out,
                       "ruled_out_subplan": result.ruled_out_subplan, "simulated": result.simulated,
                       "left": result.left, "seconds": result.seconds,
                       "cpu_s": result.cpu_s, **result.timings},
            "ranked": [row(e) for e in result.ranked],
            "best_by_group": {g: row(e) for g, e in result.best_by_group.items()}}


def finite_or_null(value: Any) -> Any:
    """`value` with every float that is not finite as None: JSON has no Infinity or NaN (Python writes them, and
    strict readers refuse the file), and a plan's tokens/$ at $0/hour or a p95 of nothing completed is one."""
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_null(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    for option, path in (("--out", args.out), ("--json", args.json)):
        if path is not None and (why := unwritable(path)):
            print(f"{PROG}: {option}: {why}", file=sys.stderr)
            return 2
    return stopped_in_one_line(PROG, "the search and its simulations are stopped",
                               lambda: _plan(args, " ".join([PROG, *map(shell_word, argv)])))


def _plan(args: argparse.Namespace, command: str) -> int:
    try:
        problem = build_problem(args)
        result = search(problem, max_simulations=args.max_simulations, time_limit_s=args.time_limit,
                        workers=args.workers)
    except (ConfigError, WorkloadError, ValueError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    print(render(result, problem, args.top))
    sustained = result.best is not None and result.best.outcome.sustains(result.target)
    try:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(finite_or_null(as_json(result, problem)), indent=2, allow_nan=False) + "\n")
        if args.out is not None and result.best is not None:
            own = args.catalog.resolve()
            write_backends(args.out, result.best, problem, args.time_scale, command,
                           None if own == CONFIG_DIR.resolve() else own)
            gpus = result.best.plan.gpus
            advice = f"run it with `gateway --backends {args.out}`" if sustained else \
                "it does not sustain the target (above)"
            print(f"\nwrote {args.out}: {result.best.plan.label()}, {gpus} backend{'s' if gpus != 1 else ''}; {advice}")
    except OSError as exc:
        print(f"{PROG}: cannot write {exc.filename or 'the output'}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    # 1 where no plan sustains the target either: the best one is written, but a script must not take it
    return 0 if sustained else 1
