"""The bursty autoscaling benchmark refuses bad input in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testkit.harness import ROOT


@pytest.mark.parametrize(("args", "message"), [
    (["--vision-gpu", "FOO"], "bursty_autoscaling: unknown GPU 'FOO'"),
    (["--model", "bogus"], "bursty_autoscaling: unknown model 'bogus'"),
    (["--seeds", "0", "-1"], "argument --seeds: must be at least 0, not -1"),
])
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks", "bursty-autoscaling", "--duration", "60",
                           "--out", str(tmp_path / "no.json"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "no.json").exists()
