"""The bursty autoscaling benchmark's options: each of a checked type with the bounds of the gateway setting
it stands for, `--out` checked before the run, rates and durations bounded by the simulated trace's size;
every refusal one line, exit 2, before any simulation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bursty_autoscaling
from testkit.harness import ROOT

pytestmark = pytest.mark.timeout(60)


def refusal(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The last line of stderr of arguments refused with exit 2 (argparse prints its usage above it)."""
    with pytest.raises(SystemExit) as exit_:
        bursty_autoscaling.main(list(args))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.splitlines()[-1]


@pytest.mark.parametrize(("option", "value", "why"), [
    ("--interval", "0", "must be in [0.05, 60], not 0"),
    ("--interval", "inf", "must be a finite number, not inf"),
    ("--max-step", "0", "must be at least 1, not 0"),
    ("--low-mark", "2", "must be in [0, 1), not 2"),
    ("--min-vision", "-1", "must be at least 0, not -1"),
    ("--min-language", "1.5", "not an integer: 1.5"),
    ("--queue-per-engine", "0", "must be positive, not 0"),
    ("--startup", "-5", "must be at least 0, not -5"),
    ("--up-delay", "inf", "must be a finite number, not inf"),
    ("--down-delay", "4000", "must be in [0, 3600], not 4000"),
    ("--itl-slo", "inf", "must be a finite number, not inf"),
    ("--image-tokens-per-engine", "0", "must be at least 1, not 0"),
    ("--text-rps", "1e9", "must be in [0, 100000], not 1e9"),
    ("--image-rps", "inf", "must be a finite number, not inf"),
    ("--duration", "1e9", "must be in [1, 604800], not 1e9"),
])
def test_a_bad_option_is_one_line_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str,
                                            value: str, why: str) -> None:
    line = refusal(capsys, "--out", str(tmp_path / "r.json"), f"{option}={value}")
    assert line == f"bursty_autoscaling: error: argument {option}: {why}"


def test_a_trace_beyond_the_bound_is_refused_before_it_is_built(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    assert bursty_autoscaling.main(["--out", str(tmp_path / "r.json"), "--text-rps", "1000"]) == 2
    assert capsys.readouterr().err == (
        "bursty_autoscaling: text_rps + image_rps over the duration make 1,805,400 requests (before bursts); a "
        "simulated trace holds at most 1,000,000: lower the rates or the duration\n")


def test_out_is_checked_before_the_run_and_its_default_shown(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    assert refusal(capsys, "--out", str(tmp_path)) == (
        f"bursty_autoscaling: error: --out: {tmp_path} is a folder; give a file name")
    assert refusal(capsys, "--out", str(afile / "r.json")) == (
        f"bursty_autoscaling: error: --out: {afile / 'r.json'}: {afile} is not a folder")
    shown = subprocess.run([sys.executable, "-m", "benchmarks", "bursty-autoscaling", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert "(default:" in shown.stdout and "bursty_autoscaling.json" in " ".join(shown.stdout.split())


def test_a_folder_as_out_is_refused_at_once_by_the_command(tmp_path: Path) -> None:
    """The command as run (the benchmarks' entry point, a process of its own): exit 2 within seconds, not
    after minutes of simulation and a traceback."""
    done = subprocess.run([sys.executable, "-m", "benchmarks", "bursty-autoscaling", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == f"bursty_autoscaling: error: --out: {tmp_path} is a folder; give a file name"
