"""`python -m benchmarks`: lists every benchmark with its summary, runs one by name, refuses an unknown one."""

from __future__ import annotations

import subprocess
import sys

from testkit.harness import ROOT


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
