"""The GPU benchmark script runs end to end on the CPU with the tiny model (its figures are not checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.harness import ROOT


@pytest.mark.timeout(360)   # two gateways with torch engines, one after the other, on a 2-core machine
def test_gpu_benchmark_runs_on_the_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/torch_engine_gpu.py", "--model", "llava-1.5-tiny", "--device", "cpu",
         "--dtype", "auto", "--concurrency", "1,2", "--requests-per-client", "1", "--max-tokens", "4",
         "--max-model-len", "128", "--image-size", "64x48", "--startup-timeout-s", "120",
         "--request-timeout-s", "60", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| 2 | split / monolithic |" in proc.stdout
    summary = json.loads(out.read_text())["summary"]
    for setup in ("monolithic", "split"):
        assert [(r["concurrency"], r["requests"], r["tokens"]) for r in summary[setup]] == [(1, 1, 4), (2, 2, 8)]
