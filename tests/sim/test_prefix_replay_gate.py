"""The prefix replay's `hg-default`: the cache-aware gateway behind its overload queue, as it runs by default.

The replay drives the live gateway's `OverloadQueue` on its virtual clock (loadtest/sim/gate.py, as the
discrete-event simulator does). Far past capacity the queue must refuse some requests and spare
those it lets through the engines' queues, and every request must be either served or
refused, once: a request held and then forgotten, or placed twice, would pass unseen in a goodput figure.
Well below capacity the queue holds nothing, and the gated run is the plain one to the last figure.
"""

from __future__ import annotations

import math

from benchmarks.prefix_affinity import run


def test_far_past_capacity_the_queue_refuses_some_and_loses_none() -> None:
    rows, _ = run(["hotprefix"], ["hg-cache", "hg-default"], [1], [6.0], 0, 400, 0, 4, 0.2, log=lambda _: None)
    by_target = {r["target"]: r for r in rows}
    plain, gated = by_target["hg-cache"], by_target["hg-default"]
    assert plain["requests"] == gated["requests"] == 400   # each request once: served or refused
    assert plain["refused"] == 0
    assert 0 < gated["refused"] < 400
    # What it lets through does not wait out the engines' queues, as the queue-less policy's tail does.
    assert gated["ttft_p99_s"] < 0.75 * plain["ttft_p99_s"]
    assert math.isclose(sum(gated["tier_shares"].values()), 1.0)


def test_well_below_capacity_the_queue_changes_nothing() -> None:
    rows, _ = run(["multiturn"], ["hg-cache", "hg-default"], [1], [1.0], 40, 0, 10, 4, 0.2, log=lambda _: None)
    plain, gated = ({k: v for k, v in r.items() if k != "target"} for r in rows)
    assert gated["refused"] == 0
    assert plain == gated   # the same decisions, to the last figure
