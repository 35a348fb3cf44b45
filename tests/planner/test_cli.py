"""`gateway plan`'s command line: what it refuses before searching, and what it says after."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from common.catalog import CONFIG_DIR
from gateway.config.cluster import load_cluster
from loadtest.planner import cli

pytestmark = pytest.mark.timeout(120)

TINY = ["--rate", "5", "--budget", "1", "--gpus", "L4", "--max-gpus", "2", "--duration", "5"]   # a search of ~1 s


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The error of arguments argparse refuses (exit 2)."""
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(list(args))
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("option", "value"), [
    ("--rate", "inf"), ("--duration", "inf"), ("--time-scale", "nan"), ("--budget", "nan"), ("--ttft-slo", "inf"),
    ("--itl-slo", "-inf"), ("--prompt-tokens", "nan"), ("--output-tokens", "inf"), ("--time-limit", "inf"),
    ("--attainment", "nan"), ("--image-share", "nan"),
])
def test_a_number_that_is_not_finite_is_refused_naming_its_option(
        capsys: pytest.CaptureFixture[str], option: str, value: str) -> None:
    args = ["--rate", "5", "--budget", "8", f"{option}={value}"]
    assert f"argument {option}: must be" in refused(capsys, *args)


def test_too_few_requests_are_refused_with_the_minimum(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "--rate", "20", "--budget", "8", "--requests", "1")
    assert f"argument --requests: must be at least {cli.MIN_REQUESTS}, not 1" in err


def test_a_negative_seed_is_refused_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --seed: must be at least 0, not -1" in refused(capsys, "--rate", "5", "--budget", "8",
                                                                   "--seed", "-1")


@pytest.mark.parametrize(("source", "ignored"), [
    (["--workload", "sharegpt"], ["--image-share", "0.5", "--output-tokens", "50"]),
    (["--trace", "requests.log"], ["--prompt-tokens", "100", "--arrivals", "bursty", "--duration", "10"]),
])
def test_options_the_workload_would_ignore_are_refused(
        capsys: pytest.CaptureFixture[str], source: list[str], ignored: list[str]) -> None:
    err = refused(capsys, "--rate", "5", "--budget", "8", *source, *ignored)
    assert f"{source[0]} brings its own traffic, so {', '.join(ignored[::2])} would be ignored" in err


def test_a_split_a_text_only_workload_cannot_use_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--rate", "5", "--budget", "3", "--splits", "E+PD"]) == 2
    err = capsys.readouterr().err
    assert "--splits E+PD" in err and "no request of this workload carries one" in err


def test_a_mean_prompt_beyond_the_context_is_refused_and_a_clipped_one_noted(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*TINY, "--prompt-tokens", "100000"]) == 2
    assert "a mean prompt of 100000 tokens does not fit model 'llava-1.5-7b'" in capsys.readouterr().err
    cli.main([*TINY, "--prompt-tokens", "3000"])
    assert "note: --prompt-tokens 3000: text prompts are clipped" in capsys.readouterr().err
    cli.main(TINY)
    assert "clipped" not in capsys.readouterr().err


def test_outputs_that_cannot_be_written_are_refused_before_the_search(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    for option, path, why in (("--out", tmp_path, "is a folder"), ("--json", afile / "x.json", "is not a folder")):
        assert cli.main([*TINY, option, str(path)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and f"gateway plan: {option}: " in err and why in err


def test_a_failed_write_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device", str(tmp_path / "plan.yaml"))

    monkeypatch.setattr(cli, "write_backends", full)
    assert cli.main([*TINY, "--out", str(tmp_path / "plan.yaml")]) == 2
    assert capsys.readouterr().err == f"gateway plan: cannot write {tmp_path / 'plan.yaml'}: No space left on device\n"


def test_a_time_limit_that_ends_the_search_before_any_simulation_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*TINY, "--time-limit", "1e-9"]) == 1
    out = capsys.readouterr().out
    assert "the time limit ended the search before any plan was simulated" in out and "--time-limit" in out
    assert "no plan fits the limits" not in out


def test_the_json_of_a_search_is_finite(tmp_path: Path) -> None:
    assert cli.main([*TINY, "--json", str(tmp_path / "plan.json")]) == 1   # 1 L4 does not sustain 5 req/s
    json.loads((tmp_path / "plan.json").read_text(), parse_constant=pytest.fail)   # Infinity, NaN: not JSON
    assert json.loads((tmp_path / "plan.json").read_text())["rate_rps"] == pytest.approx(5.0)


def test_a_plan_of_a_catalog_of_its_own_names_it_and_the_gateway_runs_on_it(tmp_path: Path) -> None:
    gpus = yaml.safe_load((CONFIG_DIR / "gpus.yaml").read_text())
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    (catalog / "gpus.yaml").write_text(yaml.safe_dump({"MI300X": {**gpus["H100"], "price_per_hour": 0.5}}))
    (catalog / "models.yaml").write_text((CONFIG_DIR / "models.yaml").read_text())
    out = tmp_path / "plan.yaml"
    assert cli.main(["--catalog", str(catalog), "--rate", "5", "--budget", "1", "--max-gpus", "1", "--duration", "5",
                     "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["catalog"] == str(catalog.resolve())
    config = load_cluster(out)
    assert {g.name for g in config.gpus.values()} == {"MI300X"} and config.gpus["mi300x-0"].price_per_hour == 0.5


def test_the_json_of_a_free_plan_writes_null_for_its_tokens_per_dollar(tmp_path: Path) -> None:
    """A catalog GPU at $0/hour makes tokens/$ infinite: the file says null, which every JSON reader takes."""
    gpus = yaml.safe_load((CONFIG_DIR / "gpus.yaml").read_text())
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    (catalog / "gpus.yaml").write_text(yaml.safe_dump({"FREE": {**gpus["L4"], "price_per_hour": 0}}))
    (catalog / "models.yaml").write_text((CONFIG_DIR / "models.yaml").read_text())
    path = tmp_path / "plan.json"
    assert cli.main(["--catalog", str(catalog), "--rate", "1", "--budget", "1", "--max-gpus", "1", "--duration", "5",
                     "--json", str(path)]) == 0
    ranked = json.loads(path.read_text(), parse_constant=pytest.fail)["ranked"]
    assert ranked[0]["tokens_per_dollar"] is None and ranked[0]["tokens_per_s"] > 0


def test_a_command_with_a_newline_writes_a_header_the_gateway_loads_and_bash_reads_back(tmp_path: Path) -> None:
    """The header's command is one comment line (a raw newline would end the comment and break the YAML) that
    bash splits into the very arguments given."""
    log = tmp_path / "requests\nof\tmonday\x07.log"
    log.write_text("".join(f'{{"event": "request", "status": 200, "timestamp": "2024-01-01T00:00:0{k}Z", '
                           '"prompt_tokens": 20, "completion_tokens": 5}\n' for k in range(3)))
    out = tmp_path / "plan.yaml"
    argv = ["--trace", str(log), "--budget", "1", "--gpus", "L4", "--max-gpus", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    load_cluster(out)
    first = out.read_text().splitlines()[0]
    assert first.startswith("# Written by `gateway plan ") and first.endswith("`.")
    words = subprocess.run(["bash", "-c", f"printf '%s\\0' {first[len('# Written by `gateway plan '):-2]}"],
                           capture_output=True, check=True).stdout
    assert words.split(b"\0")[:-1] == [a.encode() for a in argv]
