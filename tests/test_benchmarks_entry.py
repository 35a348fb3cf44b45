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
