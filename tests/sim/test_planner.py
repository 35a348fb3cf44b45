"""`gateway plan`: the search keeps the best plan while the bound prunes, plans stay within the budget or the
inventory, the written backends.yaml is one the gateway loads, and the command runs end to end.

Small searches (two or three GPU types, at most four GPUs, traces of 10-15 s) keep the file near 30 s.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from common.catalog import CONFIG_DIR, load_catalog
from common.service_time import prior_service_s
from gateway.config.cluster import load_cluster
from gateway.requests.tokens import BYTES_PER_TOKEN, CHAT_MESSAGE_OVERHEAD
from loadtest.planner.cli import write_backends
from loadtest.planner.evaluate import outcome, simulate
from loadtest.planner.search import Candidate, Evaluated, Problem, better, search
from loadtest.planner.space import Limits, Plan, Slo, enumerate_space, trace_rate
from loadtest.planner.workload import Description, described_trace, log_trace
from loadtest.sim.engines import Recorder
from loadtest.sim.modality import VlmRunSpec, VlmSimulation, build_members
from loadtest.sim.vlm import GatewayLeaseEngine
from testkit.harness import ROOT, data_url, image_bytes, image_part, run_gateway, text_part, write_config

pytestmark = pytest.mark.timeout(120)

CATALOG = load_catalog()
MODEL = CATALOG.model("llava-1.5-7b")
SLO = Slo(ttft_s=2.0, itl_s=0.1)


def plan_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=90)


def test_pruned_search_finds_the_best_plan_of_every_split_that_simulating_all_plans_finds() -> None:
    trace = described_trace(Description(14.0, image_share=0.5), MODEL, 210, seed=3)
    problem = Problem(CATALOG, MODEL, trace, SLO, Limits(budget_per_hour=3.0, max_gpus=4),
                      ("L40S", "RTX-4090"), grouping="split")
    result = search(problem, workers=1)

    space = enumerate_space(CATALOG, MODEL, problem.gpus, problem.limits, images=True)
    everything = [space.plan(i) for i in range(len(space))]
    best: dict[str, Evaluated] = {}
    for plan in everything:
        e = Evaluated(Candidate(plan, plan.cost_per_hour(CATALOG), 0.0), simulate(plan, trace, MODEL, CATALOG, SLO))
        group = plan.split
        if group not in best or better(e, best[group], problem.target):
            best[group] = e

    assert result.considered == len(everything)
    assert result.simulated + result.ruled_out + result.ruled_out_subplan == len(everything) and result.left == 0
    assert result.simulated < len(everything) / 2, "the rules ruled out fewer than half the plans"
    assert set(result.best_by_group) == set(best) == {"monolithic", "E+PD"}
    for group, e in best.items():
        assert result.best_by_group[group].plan == e.plan, group
    assert result.best is not None and result.best.outcome.sustains(problem.target)


def test_plans_stay_within_the_budget_and_the_caps_and_none_is_missing() -> None:
    gpus = ("H100", "L40S", "RTX-4090")
    limits = Limits(budget_per_hour=6.0, max_gpus=4, max_types=2, max_vision=1)
    space = enumerate_space(CATALOG, MODEL, gpus, limits, images=True)
    plans = {space.plan(i) for i in range(len(space))}
    price = {g: CATALOG.gpu(g).price_per_hour for g in gpus}

    expected = set()
    for counts in itertools.product(range(5), repeat=3):
        language = tuple((g, n) for g, n in zip(gpus, counts, strict=True) if n)
        if not language or len(language) > 2:
            continue
        pools = [tuple((g, "both", n) for g, n in language)]
        pools += [(*((g, "language", n) for g, n in language), (v, "vision", 1)) for v in gpus]
        for pool in pools:
            if sum(n for _, _, n in pool) <= 4 and sum(price[g] * n for g, _, n in pool) <= 6.0 + 1e-9:
                expected.add(Plan(pool, any(r == "vision" for _, r, _ in pool)))
    assert plans == expected
    assert all(p.cost_per_hour(CATALOG) <= 6.0 + 1e-9 and p.gpus <= 4 for p in plans)


def test_plans_use_only_the_inventory() -> None:
    inventory = (("A100-80GB", 2), ("RTX-4090", 3))
    limits = Limits(inventory=inventory, max_gpus=16)
    space = enumerate_space(CATALOG, MODEL, ("A100-80GB", "RTX-4090", "H100"), limits, images=True)
    assert len(space) > 0
    for i in range(len(space)):
        used: dict[str, int] = {}
        for gpu, _, n in space.plan(i).pools:
            used[gpu] = used.get(gpu, 0) + n
        assert all(n <= dict(inventory).get(gpu, 0) for gpu, n in used.items()), space.plan(i)
    full = Plan((("A100-80GB", "language", 2), ("RTX-4090", "language", 2), ("RTX-4090", "vision", 1)), True)
    assert full in {space.plan(i) for i in range(len(space))}


def test_the_written_backends_yaml_is_one_the_gateway_loads(tmp_path: Path) -> None:
    trace = described_trace(Description(5.0, image_share=0.5), MODEL, 60, seed=0)
    problem = Problem(CATALOG, MODEL, trace, Slo(1.5, 0.05), Limits(budget_per_hour=10.0), ("A100-80GB", "RTX-4090"))
    plan = Plan((("A100-80GB", "language", 2), ("RTX-4090", "vision", 2)), steal=True)
    evaluated = Evaluated(Candidate(plan, plan.cost_per_hour(CATALOG), 1.0),
                          simulate(plan, trace, MODEL, CATALOG, problem.slo))
    path = tmp_path / "planned.yaml"
    write_backends(path, evaluated, problem, 0.5, "gateway plan --test")

    config = load_cluster(path)
    backends = config.raw.backends
    assert [(b.gpu, b.role, b.steal) for b in backends] == [(g, r, s) for g, r, s in plan.members()]
    assert all(b.launch is not None and b.launch.time_scale == 0.5 for b in backends)
    # Engines at time scale 0.5 take half a second for a second of the model: the targets scale with them.
    assert config.settings.routing.itl_target_ms == 25.0
    overload = config.settings.overload
    assert (overload.ttft_slo_s, overload.hold_above_s, overload.max_wait_s) == (0.75, 0.375, 0.375)
    assert config.settings.routing.policy == problem.policies.language


def test_gateway_plan_runs_end_to_end_on_a_tiny_catalog_and_writes_a_runnable_plan(tmp_path: Path) -> None:
    """A catalog of two GPU types at prices of its own: the plan is priced from it, stays in its budget, and
    the written file is a cluster the gateway loads (with its own catalog: the same GPU names)."""
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    gpus = yaml.safe_load((CONFIG_DIR / "gpus.yaml").read_text())
    prices = {"L40S": 0.40, "RTX-4090": 0.30}
    (catalog / "gpus.yaml").write_text(yaml.safe_dump({g: {**gpus[g], "price_per_hour": p} for g, p in prices.items()}))
    (catalog / "models.yaml").write_text((CONFIG_DIR / "models.yaml").read_text())
    out, report = tmp_path / "plan" / "backends.yaml", tmp_path / "plan.json"
    done = plan_command("--catalog", str(catalog), "--rate", "8", "--image-share", "0.5", "--budget", "1.2",
                        "--max-gpus", "3", "--duration", "10", "--out", str(out), "--json", str(report))
    assert done.returncode == 0, done.stderr
    assert "plans considered" in done.stdout and "best plans" in done.stdout
    result = yaml.safe_load(report.read_text())
    best = result["ranked"][0]
    counts = result["search"]
    assert counts["simulated"] + counts["ruled_out"] + counts["ruled_out_subplan"] == counts["considered"]
    assert best["cost_per_hour"] == pytest.approx(sum(prices[g] * n for g, _, n in best["pools"]))
    assert best["cost_per_hour"] <= 1.2
    config = load_cluster(out)
    members = [(b.gpu, b.role) for b in config.raw.backends]
    assert sorted(members) == sorted((g, r) for g, r, n in best["pools"] for _ in range(n))


@pytest.mark.parametrize(("args", "message"), [
    (["--rate", "5", "--budget", "5", "--inventory", "H100=1"], "not allowed with argument"),
    (["--rate", "5", "--budget", "5", "--gpus", "NOPE"], "unknown GPU 'NOPE'"),
    (["--rate", "5", "--inventory", "H100"], "write GPU=COUNT"),
    (["--rate", "5", "--budget", "5", "--image-share", "0.5", "--model", "llama-2-7b"], "takes no images"),
    (["--budget", "5", "--trace", "/nonexistent/requests.log"], "cannot read the request log"),
    (["--budget", "5"], "give the arrival rate"),
])
def test_bad_input_is_refused_with_a_message(args: list[str], message: str) -> None:
    done = plan_command(*args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_the_gateways_own_request_log_is_a_trace(tmp_path: Path) -> None:
    # A split cluster: a request's line names the vision backend that encoded its images (a `both` backend
    # encodes its own, and its line names none).
    config = write_config(tmp_path, {"model": MODEL.name, "backends": [
        {"id": "vision-0", "role": "vision", "gpu": "RTX-4090", "launch": {"time_scale": 0.05}},
        {"id": "language-0", "role": "language", "gpu": "A100-80GB", "launch": {"time_scale": 0.05}}]})
    image = data_url(image_bytes())
    with run_gateway(config, "--log-level", "info") as gw, gw.client() as client:
        for k in range(4):
            content = [text_part("describe this"), image_part(image)] if k % 2 else "hello there, gateway"
            resp = client.post("/v1/chat/completions", json={
                "model": MODEL.name, "messages": [{"role": "user", "content": content}], "max_tokens": 8})
            assert resp.status_code == 200, resp.text
        last_usage = resp.json()["usage"]
        bad = client.post("/v1/chat/completions", json={"model": MODEL.name, "messages": []})
        assert bad.status_code == 400
    trace = log_trace(gw.log_path, MODEL)
    assert trace.n == 4                               # the refused request is not traffic to plan for
    assert list(trace.lengths.images) == [0, 1, 0, 1]
    assert int(trace.lengths.input_tokens[-1]) == last_usage["prompt_tokens"]
    assert int(trace.lengths.output_tokens[-1]) == last_usage["completion_tokens"]
    assert list(trace.arrival_s) == sorted(trace.arrival_s)


def test_an_overloaded_plan_is_simulated_behind_the_overload_queue_as_the_gateway_runs_it() -> None:
    """With the queue (the gateway's default) an overloaded plan refuses some text requests before any
    engine sees them and serves the rest; every request is served or refused once, image requests are
    never refused; without it nothing is refused and more requests miss their first-token target."""
    trace = described_trace(Description(20.0, image_share=0.5, output_tokens=96.0), MODEL, 300, seed=0)
    plan = Plan((("RTX-4090", "both", 2),), False)
    outcomes = {}
    for queue in (True, False):
        rec = Recorder.for_lengths(trace.lengths)
        engines = build_members(plan.members(), MODEL, CATALOG, rec, lambda gpu: prior_service_s(MODEL, gpu),
                                GatewayLeaseEngine)
        spec = VlmRunSpec("overloaded", trace_rate(trace), trace.n, model=MODEL.name)
        VlmSimulation(spec, trace, engines, rec, SLO.overload() if queue else None).run()
        refused, done = rec.rejected, ~np.isnan(rec.finish)
        assert (refused ^ done).all()
        assert (rec.backend[refused] == -1).all()
        assert not (refused & (trace.lengths.image_tokens > 0)).any()
        outcomes[queue] = outcome(trace, rec, SLO, 1.0, 0.0, 0.0)
        assert refused.any() == queue
    assert outcomes[True].attainment > outcomes[False].attainment


def test_the_live_checks_requests_share_no_prefix_and_no_image() -> None:
    """The planner's workload shares nothing, so its live replay must not either: the engines cache prefixes
    and image embeddings by content (a shared prompt or image made the live plans look faster)."""
    from loadtest.planner.live_check import replay_body, request_images

    trace = described_trace(Description(5.0, image_share=0.5), MODEL, 40, seed=0)
    images = request_images(trace, seed=0)
    bodies = [replay_body(trace, i, f"p0-{i}", images[i]) for i in range(trace.n)]
    texts, urls = [], []
    for i, body in enumerate(bodies):
        content = body["messages"][0]["content"]
        text = content if isinstance(content, str) else content[0]["text"]
        texts.append(text)
        urls += [part["image_url"]["url"] for part in content[1:]] if not isinstance(content, str) else []
        assert len(text) == max(1, int(trace.lengths.text_tokens[i]) - CHAT_MESSAGE_OVERHEAD) * BYTES_PER_TOKEN
        assert len(images[i]) == int(trace.lengths.images[i])
    assert sum(1 for c in trace.lengths.images if c) >= 10 and len(set(urls)) == len(urls)
    first_blocks = [t[:64] for t in texts if len(t) >= 64]   # the first 16-token block of each prompt
    assert len(first_blocks) >= 10 and len(set(first_blocks)) == len(first_blocks)
