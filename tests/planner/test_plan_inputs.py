"""`gateway plan`'s inputs at their edges: GPU names the config's ids cannot hold, rates and traces beyond
the simulated trace's bound, an inventory count of 0, and a catalog whose YAML is broken; each is one line
before any search, or a plan the gateway loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from common.catalog import CONFIG_DIR, load_catalog
from gateway.config.cluster import load_cluster
from loadtest.planner import cli
from loadtest.planner.options import MAX_WORKERS
from loadtest.planner.search import Problem
from loadtest.planner.space import Limits, Plan, Slo
from loadtest.planner.workload import MAX_RATE_RPS, MAX_TRACE_REQUESTS, Description, described_trace

pytestmark = pytest.mark.timeout(120)

TINY = ["--rate", "5", "--budget", "1", "--gpus", "L4", "--max-gpus", "2", "--duration", "5"]   # a search of ~1 s
ODD = ("My GPU", "My/GPU", "A100/40GB")   # a space and slashes; the first two make the same id stem


def odd_catalog(tmp: Path) -> Path:
    """The built-in catalog's models, and its L4 and A100-80GB under names with characters ids cannot hold."""
    folder = tmp / "catalog"
    folder.mkdir()
    gpus = yaml.safe_load((CONFIG_DIR / "gpus.yaml").read_text())
    profiles = {"My GPU": gpus["L4"], "My/GPU": gpus["L4"], "A100/40GB": gpus["A100-80GB"]}
    (folder / "gpus.yaml").write_text(yaml.safe_dump(profiles))
    (folder / "models.yaml").write_text((CONFIG_DIR / "models.yaml").read_text())
    return folder


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(list(args))
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_written_ids_are_ones_the_config_takes_and_stay_unique(tmp_path: Path) -> None:
    folder = odd_catalog(tmp_path)
    catalog = load_catalog(folder)
    model = catalog.model("llava-1.5-7b")
    problem = Problem(catalog, model, described_trace(Description(5.0), model, 50, 0), Slo(2.0, 0.1),
                      Limits(budget_per_hour=10.0), ODD)
    plan = Plan((("My GPU", "language", 2), ("My/GPU", "language", 1), ("A100/40GB", "vision", 1)))
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump(cli.backends_config(plan, problem, 1.0, folder)))
    backends = load_cluster(path).raw.backends
    assert [(b.id, b.gpu) for b in backends] == [
        ("my-gpu-0", "My GPU"), ("my-gpu-1", "My GPU"), ("my-gpu-2", "My/GPU"), ("a100-40gb-vision-0", "A100/40GB")]
    assert cli.id_stem("!!!") == "gpu" and len(cli.id_stem("X" * 200)) == cli.ID_STEM_CHARS


def test_a_plan_of_a_gpu_named_with_a_space_runs_end_to_end_to_a_file_the_gateway_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "planned.yaml"
    assert cli.main(["--rate", "2", "--budget", "3", "--max-gpus", "2", "--duration", "5", "--workers", "1",
                     "--catalog", str(odd_catalog(tmp_path)), "--gpus", "My GPU", "--out", str(out)]) == 0
    assert next(b.id for b in load_cluster(out).raw.backends) == "my-gpu-0"


@pytest.mark.parametrize(("args", "message"), [
    (["--rate", "1e7"], f"argument --rate: must be at most {MAX_RATE_RPS:,.0f} requests/s, not 1e7"),
    (["--rate", "1000000"], "argument --rate: must be at most"),
    (["--rate", "50000"], f"--rate 50000 for --duration 30 s makes 1,500,000 requests; a simulated trace holds "
                          f"at most {MAX_TRACE_REQUESTS:,}"),
    (["--rate", "5", "--requests", str(MAX_TRACE_REQUESTS + 1)],
     f"argument --requests: must be at most {MAX_TRACE_REQUESTS:,}"),
])
def test_a_trace_beyond_the_bound_is_refused_before_it_is_built(
        capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    err = refused(capsys, *args, "--budget", "8")
    assert err.splitlines()[-1].startswith("gateway plan: error: ") and message in err.splitlines()[-1]


def test_a_request_log_beyond_the_bound_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "requests.log"
    log.write_text("".join(f'{{"event": "request", "status": 200, "timestamp": "2024-01-01T00:00:0{k}Z", '
                           '"prompt_tokens": 20, "completion_tokens": 5}\n' for k in range(3)))
    monkeypatch.setattr(cli, "MAX_TRACE_REQUESTS", 2)
    assert cli.main(["--trace", str(log), "--budget", "8"]) == 2
    assert capsys.readouterr().err == (f"gateway plan: --trace {log}: 3 requests, more than the 2 a simulated "
                                       "trace holds: give --requests to take the first ones\n")


def served_log(path: Path, n: int) -> Path:
    """A gateway request log of `n` served requests, one a second."""
    path.write_text("".join(f'{{"event": "request", "status": 200, "timestamp": "2024-01-01T00:{k // 60:02d}:'
                            f'{k % 60:02d}Z", "prompt_tokens": 20, "completion_tokens": 5}}\n' for k in range(n)))
    return path


def test_a_short_request_log_rescaled_to_a_rate_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nine logged requests at --rate 50 span 0.16 s: no plan was loaded, every one "sustained" the rate, and
    the cheapest GPU was written out for 50 req/s, exit 0. At its own rate such a log is still planned for."""
    log = served_log(tmp_path / "requests.log", 9)
    assert cli.main(["--trace", str(log), "--rate", "50", "--budget", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gateway plan: --trace {log}: 9 served requests at --rate 50 span 0.16 s, too few to load "
                          "a plan (at least 200") and len(err.splitlines()) == 1
    assert cli.main(["--trace", str(log), "--requests", "300", "--budget", "8"]) == 2   # a log's first 300: 9
    assert capsys.readouterr().err == (f"gateway plan: --requests 300: the request log {log} holds 9 served requests "
                                       "(--requests takes the first ones of a log, it makes no more)\n")


def test_no_plan_that_sustains_the_target_exits_1_with_the_best_written(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "planned.yaml"
    assert cli.main([*TINY, "--ttft-slo", "0.001", "--workers", "1", "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "no plan within the limits sustains 90% attainment" in printed
    assert f"wrote {out}: 1×L4, 1 backend; it does not sustain the target (above)" in printed
    assert out.exists()   # the best, written as asked, for a look


def test_a_budget_no_plan_fits_prints_no_empty_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--rate", "5", "--budget", "0.1"]) == 1
    out = capsys.readouterr().out
    assert out.endswith("\n\nno plan fits the limits: raise the budget or the inventory, or allow more GPU types\n")
    assert "best plans" not in out


def test_a_model_no_allowed_gpu_holds_is_refused_as_such(capsys: pytest.CaptureFixture[str]) -> None:
    """It said "no plan fits the limits: raise the budget or the inventory", which no budget could help."""
    assert cli.main(["--rate", "5", "--inventory", "L4=2", "--model", "llama-2-70b"]) == 2
    err = capsys.readouterr().err
    assert err == ("gateway plan: model llama-2-70b's weights (138.0 GB) leave no room for a KV cache on any GPU "
                   "allowed (L4): allow a larger one (--gpus, --inventory)\n")


def test_more_workers_than_four_a_core_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "--rate", "5", "--budget", "8", "--workers", str(MAX_WORKERS + 1))
    assert f"argument --workers: must be at most {MAX_WORKERS:,}, not {MAX_WORKERS + 1}" in err


def test_an_inventory_count_of_zero_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "--rate", "5", "--inventory", "H100=0")
    assert "argument --inventory: 'H100=0': write GPU=COUNT with a count of 1 or more" in err


def test_a_catalog_with_broken_yaml_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = odd_catalog(tmp_path)
    (folder / "gpus.yaml").write_text("gpus: [unclosed\n")
    assert cli.main(["--rate", "5", "--budget", "8", "--catalog", str(folder)]) == 2
    assert capsys.readouterr().err == (f"gateway plan: {folder / 'gpus.yaml'}: not valid YAML: line 2, column 1: "
                                       "expected ',' or ']', but got '<stream end>' (while parsing a flow sequence "
                                       "at line 1, column 7)\n")


def test_a_best_plan_under_its_rate_on_a_short_trace_is_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    """On a 10 s trace a plan whose capacity bound is 20% under the rate still meets the TTFT SLO before its
    backlog grows: the plan is printed with a note to check it on a longer trace."""
    args = ["--rate", "20", "--image-share", "0.5", "--output-tokens", "96", "--budget", "8",
            "--gpus", "H100,A100-80GB,L40S,RTX-4090", "--workers", "1"]
    assert cli.main([*args, "--duration", "10"]) == 0
    assert "is below the rate (20.0): it may sustain this 10 s trace only" in capsys.readouterr().out
    assert cli.main(args) == 0   # the default 30 s: its best plan's bound covers the rate
    assert "note:" not in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--itl-slo", "1e306"], "--itl-slo 1e+306 with --time-scale 1 makes gateway.routing.itl_target_ms inf"),
    (["--time-scale", "1e307"], "--itl-slo 0.1 with --time-scale 1e+307 makes gateway.routing.itl_target_ms inf"),
    (["--ttft-slo", "5e-324"], "--ttft-slo 4.94066e-324 with --time-scale 1 makes the simulated overload queue's "
                               "hold_above_s and max_wait_s (TTFT SLO / 2) 0"),
    (["--ttft-slo", "1e300", "--time-scale", "1e10"],
     "--ttft-slo 1e+300 with --time-scale 1e+10 makes gateway.overload.ttft_slo_s inf"),
])
def test_targets_the_gateway_would_refuse_are_one_line_naming_the_option(
        capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    """Each option is finite, but the written target (a product of two) or half the TTFT SLO is not a finite
    positive number: refused before the search, not written as `.inf` or refused in pydantic's six lines."""
    err = refused(capsys, "--rate", "5", "--budget", "8", *args)
    assert err == f"gateway plan: error: {message}; the gateway takes a finite positive number\n"


def test_the_largest_finite_targets_write_a_file_the_gateway_loads(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    assert cli.main([*TINY, "--itl-slo", "1e300", "--ttft-slo", "1e300", "--time-scale", "1e5",
                     "--out", str(out)]) == 0
    assert load_cluster(out).settings.routing.itl_target_ms == pytest.approx(1e308)


@pytest.mark.parametrize(("args", "message"), [
    (["--gpus", "H100", "--inventory", "L40S=2"], "--gpus H100 and --inventory L40S have no GPU type in common"),
    (["--gpus", ",", "--budget", "8"], "argument --gpus: ',': give at least one name, comma-separated"),
    (["--splits", " , ", "--budget", "8"], "argument --splits: ' , ': give at least one name, comma-separated"),
])
def test_gpu_choices_that_leave_no_gpu_are_refused(
        capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    err = refused(capsys, "--rate", "5", *args)
    assert err.startswith(f"gateway plan: error: {message}") and err.count("\n") == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--budget", "0"], "argument --budget: must be positive, not 0"),
    (["--inventory", "H100=0"], "argument --inventory: 'H100=0': write GPU=COUNT"),
    (["--budget", "8", "--attainment", "1.5"], "argument --attainment: must be in (0, 1], not 1.5"),
    # 0 was taken, and every plan "sustained" it
    (["--budget", "8", "--attainment", "0"], "argument --attainment: must be in (0, 1], not 0"),
    (["--budget", "8", "--inventory", "H100=1"], "argument --inventory: not allowed with argument --budget"),
    ([], "one of the arguments --budget --inventory is required"),
])
def test_a_refused_argument_is_one_line_without_the_usage(
        capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    err = refused(capsys, "--rate", "5", *args)
    assert err.startswith(f"gateway plan: error: {message}") and err.count("\n") == 1
