"""`python -m benchmarks`: lists every benchmark with its summary, runs one by name, refuses an unknown one."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.harness import ROOT
from tests.planner.processes import stop_with_workers


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_lists_runs_and_refuses() -> None:
    listed = run()
    assert listed.returncode == 0
    names = {line.split()[0] for line in listed.stdout.splitlines()[2:] if line.strip()}
    assert {"front-door", "mixed-tier", "routing-latency", "workers"} <= names
    assert "bench-cluster" not in names and "loadgen" not in names   # shared set-up, not commands
    helped = run("routing-latency", "--help")
    assert helped.returncode == 0 and "usage: routing_latency" in helped.stdout.replace(".py", "")
    unknown = run("no-such-benchmark")
    assert unknown.returncode == 2 and "python -m benchmarks` lists them" in unknown.stderr


def test_every_listed_benchmark_imports() -> None:
    """Each benchmark `python -m benchmarks` offers loads: two imported a name that had moved out of
    gateway.cli and died at their first line. A third-party package of the `bench` extra that is not
    installed is not this repository's fault and is let pass; a missing name of its own is."""
    listed = run()
    names = [line.split()[0] for line in listed.stdout.splitlines()[2:] if line.strip()]
    script = (
        "import importlib, sys\n"
        "own = ('gateway', 'common', 'backends', 'loadtest', 'benchmarks', 'testkit', 'tests')\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module('benchmarks.' + name.replace('-', '_'))\n"
        "    except ModuleNotFoundError as exc:\n"
        "        if (exc.name or '').split('.')[0] in own:\n"
        "            raise\n"
    )
    done = subprocess.run([sys.executable, "-c", script, *names], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize(("sig", "code", "word"), [(signal.SIGINT, 130, "interrupted"),
                                                   (signal.SIGTERM, 143, "terminated")])
def test_a_signal_stops_a_benchmark_and_what_it_forked_in_one_line(
        tmp_path: Path, sig: signal.Signals, code: int, word: str) -> None:
    """Ctrl-C (to the whole group, as a terminal sends it) printed tracebacks from the parent and each pool
    worker; SIGTERM (`timeout`, a CI cancel, to the parent alone) skipped the clean-up, and a live benchmark's
    gateways ran on holding their ports."""
    stopped = stop_with_workers(
        [sys.executable, "-m", "benchmarks", "routing-family", "--members", "m00", "m01", "--loads", "0.9",
         "--seeds", "11", "12", "--requests", "3000", "--jobs", "2", "--out", str(tmp_path / "out.json")], sig)
    assert stopped.returncode == code, stopped.stderr
    assert stopped.stderr == f"benchmarks routing-family: {word}; what it launched is stopped\n", stopped.stderr
    assert stopped.survivors == []
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("args", [
    # each ended in a ZeroDivisionError, IndexError or numpy traceback, hung, or ran to the end on nonsense
    ("routing-family", "--requests", "0"), ("routing-family", "--members", "nosuch"),
    ("routing-family", "--targets", "bogus_policy"), ("routing-family", "--variant", "garbage"),
    ("prefix-affinity", "--interval-ms", "0"), ("prefix-affinity", "--loads", "-1"),
    ("routing-latency", "--sizes", "-1"),
    # found only after the whole run, its results lost
    ("routing-family", "--out", "/"), ("prefix-affinity", "--out", "/"),
])
def test_arguments_a_benchmark_cannot_run_are_refused_in_one_line_before_it_runs(args: tuple[str, ...]) -> None:
    refused = run(*args)
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr   # argparse's usage, then one line
    assert ".py: error: " in refused.stderr.splitlines()[-1]
