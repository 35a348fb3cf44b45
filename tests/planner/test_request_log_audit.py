"""`gateway plan` on request logs and settings an operator's audit found wrong, as the command runs them: a log
line no gateway writes (a latency of NaN or below 0, a token count of Infinity) is skipped like any other
line that is not a served request, a log of requests the model's context cannot hold is one line (exit 2)
rather than a worker's traceback or a plan sized around them, and the written inter-token target of a tight
SLO on fast engines is a number the gateway loads."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.harness import ROOT

pytestmark = pytest.mark.timeout(120)

START = datetime(2026, 1, 1, tzinfo=UTC)


def gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=90)


def request_log(path: Path, n: int = 240, **odd: dict[str, Any]) -> Path:
    """n served text requests 0.1 s apart; `odd` maps a line's number (as a string) to fields it overrides."""
    lines = []
    for i in range(n):
        event = {"event": "request", "status": 200, "latency_s": 0.5, "prompt_tokens": 600, "completion_tokens": 100,
                 "vision_backends": [], "timestamp": (START + timedelta(seconds=i / 10)).isoformat()}
        event.update(odd.get(str(i), {}))
        lines.append(json.dumps(event))   # NaN and Infinity as Python's json writes and reads them
    path.write_text("\n".join(lines) + "\n")
    return path


def plan(log: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return gateway("plan", "--trace", str(log), "--budget", "4", "--gpus", "H100,L40S", "--max-simulations", "2",
                   "--top", "1", *args)


@pytest.mark.parametrize("field, value", [("latency_s", float("nan")), ("latency_s", -1e12),
                                          ("prompt_tokens", float("inf")), ("completion_tokens", 10**30)])
def test_a_line_no_gateway_writes_is_skipped(tmp_path: Path, field: str, value: float) -> None:
    done = plan(request_log(tmp_path / "requests.log", **{"5": {field: value}}))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    # the 239 lines left, over their own 24 s (a latency of -1e12 would have stretched the trace to years)
    assert "10.0 req/s (239 requests over 24 s)" in done.stdout


def test_a_log_whose_requests_do_not_fit_the_context_is_one_line(tmp_path: Path) -> None:
    log = request_log(tmp_path / "requests.log", **{"7": {"completion_tokens": 1_000_000}})
    done = plan(log)
    assert done.returncode == 2
    assert done.stderr == (f"gateway plan: {log}: 1 of its 240 served requests do not fit model llava-1.5-7b's "
                           "context of 4096 tokens (up to 1,000,000 completion tokens): a log of a model with a "
                           "longer context? plan for that --model\n")


def test_a_tight_target_on_fast_engines_is_written_as_the_gateway_loads_it(tmp_path: Path) -> None:
    out = tmp_path / "planned.yaml"
    done = plan(request_log(tmp_path / "requests.log"), "--time-scale", "1e-7", "--out", str(out))
    assert done.returncode == 0, done.stderr
    # 100 ms at a ten-millionth: 1e-05 ms, which three decimals made 0
    assert yaml.safe_load(out.read_text())["gateway"]["routing"]["itl_target_ms"] == pytest.approx(1e-5)
    checked = gateway("check-config", str(out))
    assert checked.returncode == 0, checked.stderr
