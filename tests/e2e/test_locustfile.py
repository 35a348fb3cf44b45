"""The Locust file drives the live demo cluster headless: text, image and streamed requests, no failures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.harness import ROOT, Gateway


@pytest.mark.timeout(180)
def test_locust_headless_run(demo_gateway: Gateway, tmp_path: Path) -> None:
    # The seed's first 24 requests, each of the four kinds several times, however long Locust takes to start
    # (with -t alone, a busy host's start-up left a 4 s run one second of requests: no image request)
    cmd = [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "6", "-r", "6",
           "-t", "100s", "--requests", "24", "--host", demo_gateway.url, "--json-file", str(tmp_path / "run"),
           "--only-summary", "--workload", "mm_mixed", "--stream-fraction", "0.5", "--seed", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output

    # the final stats (the CSV, written every second, could miss the last second's: 1 image request of 6)
    stats = json.loads((tmp_path / "run.json").read_text())
    count = {(s["method"], s["name"]): s["num_requests"] for s in stats}
    for name in ("text", "image", "text stream", "image stream"):
        assert count.get(("POST", name), 0) > 0, f"no {name!r} requests:\n{output}"
    assert count[("TTFT", "text stream")] > 0 and count[("TTFT", "image stream")] > 0, output
    assert sum(count[("POST", name)] for name in ("text", "image", "text stream", "image stream")) == 24, output
    assert sum(s["num_failures"] for s in stats) == 0, output


@pytest.mark.parametrize(("option", "value", "words"), [("--seed", "-1", "a seed is 0 or more"),
                                                         ("--requests", "-5", "give 0 (no limit) or more"),
                                                         ("--max-context", "100", "below 256 tokens")])
def test_a_bad_option_is_one_line_before_any_user_starts(option: str, value: str, words: str) -> None:
    """A negative seed failed in numpy at the test's start: every user then raised on every request
    (9,444 tracebacks in 6 s); a context of 100 clipped every prompt to nothing without a word."""
    cmd = [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "1", "-t", "2s",
           "--host", "http://127.0.0.1:9", option, value]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
