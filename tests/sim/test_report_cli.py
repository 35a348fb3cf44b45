"""`python -m loadtest.sim.report`'s command line: what it refuses before simulating, and Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.harness import ROOT
from tests.planner.processes import stop_with_workers

pytestmark = pytest.mark.timeout(180)

REPORT = [sys.executable, "-m", "loadtest.sim.report"]
# the report without matplotlib, whether or not this environment has it
NO_MATPLOTLIB = ("import runpy, sys; sys.modules['matplotlib'] = None; "
                 "runpy.run_module('loadtest.sim.report', run_name='__main__', alter_sys=True)")


@pytest.fixture
def stub_matplotlib(tmp_path: Path) -> dict[str, str]:
    """An importable `matplotlib` that draws nothing: enough for runs that stop before the figures."""
    (tmp_path / "stub" / "matplotlib").mkdir(parents=True)
    (tmp_path / "stub" / "matplotlib" / "__init__.py").write_text("")
    return {"PYTHONPATH": str(tmp_path / "stub")}


def report(*args: str, env: dict[str, str] | None = None, code: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", code, *args] if code else [*REPORT, *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_help_and_a_missing_matplotlib_need_no_matplotlib(tmp_path: Path) -> None:
    done = report("--help", code=NO_MATPLOTLIB)
    assert done.returncode == 0 and "--quick" in done.stdout
    done = report("--quick", "--out", str(tmp_path), code=NO_MATPLOTLIB)
    assert done.returncode == 2
    assert done.stderr == ("report: the figures need matplotlib, the 'sim' extra: pip install 'heterogate[sim]' "
                           "(in a checkout: pip install -e '.[sim]')\n")


@pytest.mark.parametrize("workers", ["0", "-1", "two"])
def test_a_bad_worker_count_is_refused_naming_the_option(workers: str) -> None:
    done = report("--quick", f"--workers={workers}")
    assert done.returncode == 2 and "argument --workers:" in done.stderr and "Traceback" not in done.stderr


def test_an_output_folder_that_is_a_file_is_refused_before_any_simulation(
        tmp_path: Path, stub_matplotlib: dict[str, str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    done = report("--quick", "--out", str(afile), env=stub_matplotlib)
    assert done.returncode == 2
    assert done.stderr == f"report: cannot make {afile / 'results'}: Not a directory\n"


def test_ctrl_c_stops_the_report_and_its_workers_in_one_line(
        tmp_path: Path, stub_matplotlib: dict[str, str]) -> None:
    stopped = stop_with_workers([*REPORT, "--quick", "--workers", "2", "--out", str(tmp_path)], signal.SIGINT,
                                env=stub_matplotlib)
    assert stopped.survivors == []
    assert stopped.returncode == 130
    assert stopped.stderr == "report: interrupted; the simulations are stopped\n"
