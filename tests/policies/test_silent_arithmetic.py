"""The policies' array arithmetic is as silent as Python's on floats (0 · inf, x / 0), with no
np.errstate per decision: the filter gateway/routing/policies/candidates.py sets at import does it.

Run in a fresh interpreter with RuntimeWarnings as errors, because pytest replaces the warning
filters around each test (pyproject restates the filter for the rest of the suite)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import dataclasses, math, random
import numpy as np
from gateway.routing.policies import build_policy
from gateway.routing.policies.contracts import RequestProfile
from tests.snapshots import random_cluster

backends = random_cluster(random.Random(5), 32)
# T̄_service = inf with an empty queue: 0 · inf (invalid) in heteroserve's queue term when w2 != 1
odd = [dataclasses.replace(b, queue_depth=0, mean_service_s=math.inf) for b in backends]
d = build_policy("heteroserve", {"w2": 2.0}).choose(RequestProfile("r", 100), odd, 0.0)
assert math.isnan(d.costs[0].queue), d.costs[0]
# no KV capacity known: over / capacity divides by 0 in marginal_delay's (discarded) branch
unknown = [dataclasses.replace(b, kv_total_bytes=0, kv_free_bytes=0) for b in backends]
d = build_policy("marginal_delay").choose(RequestProfile("r", 100), unknown, 0.0)
assert math.isfinite(d.cost), d.cost
try:   # only the policies are silenced
    np.array([0.0]) * np.array([math.inf])
except RuntimeWarning:
    print("ok")
"""


def test_policies_compute_on_inf_and_zero_without_warnings_and_nothing_else_is_silenced() -> None:
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", SCRIPT], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
