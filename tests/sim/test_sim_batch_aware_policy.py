"""`batch_aware`: registered, strict params, and the decisions its formula promises."""

from __future__ import annotations

import dataclasses

import pytest

from common.errors import ConfigError
from gateway.routing.policies import REGISTRY, build_policy
from gateway.routing.policies.batch_aware import BatchAware, BatchAwareParams
from gateway.routing.policies.contracts import RequestProfile
from gateway.routing.policies.heteroserve import HeteroServe
from tests.snapshots import cluster, snapshot

REQ = RequestProfile("r", input_tokens=800, max_output_tokens=256)


def test_registered_and_strict() -> None:
    assert REGISTRY["batch_aware"] is BatchAware
    assert isinstance(build_policy("batch_aware", {"w_decode": 0.5}), BatchAware)
    with pytest.raises(ConfigError, match="nope"):
        build_policy("batch_aware", {"nope": 1})
    with pytest.raises(ConfigError):
        build_policy("batch_aware", {"max_batch": 0})


def test_idle_cluster_picks_the_fastest_gpu() -> None:
    backends = cluster({"L40S": 1, "A100-80GB": 1, "H100": 1})
    assert BatchAware().choose(REQ, backends, 0.0).backend.gpu == "H100"


def test_a_running_batch_does_not_count_as_a_queue() -> None:
    """40 sequences running with free KV: a continuous-batching GPU admits the next one at once."""
    h100 = snapshot("h100", "H100", queue_depth=40, mean_service_s=20.0)
    a100 = snapshot("a100", "A100-80GB")
    assert BatchAware().choose(REQ, [h100, a100], 0.0).backend.id == "h100"
    assert HeteroServe().choose(REQ, [h100, a100], 0.0).backend.id == "a100"   # Q · T̄ says 800 s


def test_full_kv_cache_turns_into_a_wait() -> None:
    h100 = snapshot("h100", "H100", queue_depth=60, kv_free_bytes=0, mean_service_s=20.0)
    a100 = snapshot("a100", "A100-80GB", queue_depth=10)
    decision = BatchAware().choose(REQ, [h100, a100], 0.0)
    assert decision.backend.id == "a100"
    waits = {c.backend_id: c.queue for c in decision.costs}
    assert waits["h100"] > 0.0 and waits["a100"] == 0.0


def test_serial_configuration_reproduces_heteroserve_queue_term() -> None:
    b = snapshot("h100", "H100", queue_depth=3, mean_service_s=12.0)
    terms = BatchAware(BatchAwareParams(max_batch=1)).cost(REQ, b)
    assert terms.queue == pytest.approx(3 * 12.0)


def test_request_larger_than_the_whole_cache_is_vetoed() -> None:
    small = snapshot("l40s", "L40S")
    huge = RequestProfile("big", input_tokens=small.kv_free_tokens + 1, max_output_tokens=16)
    big = snapshot("h100", "H100", kv_free_bytes=0, queue_depth=500)
    terms = {c.backend_id: c for c in BatchAware().choose(huge, [small, big], 0.0).costs}
    assert terms["l40s"].oom > 0.0


def test_decision_is_pure_given_the_same_state() -> None:
    backends = cluster({"H100": 2, "L40S": 2})
    a, b = BatchAware(), BatchAware()
    assert a.choose(REQ, backends, 0.0) == b.choose(REQ, backends, 5.0)


def test_prompts_waiting_to_prefill_count_toward_the_first_token() -> None:
    """Two H100s alike but for the prompt tokens queued ahead: the one with the shorter prefill queue
    wins, by exactly that backlog's prefill time (no herding onto the fastest tier)."""
    idle = snapshot("idle", "H100")
    backlog = dataclasses.replace(snapshot("busy", "H100"), prefill_backlog_tokens=6000)
    p = BatchAware()
    assert p.choose(REQ, [backlog, idle], 0.0).backend.id == "idle"
    assert p.cost(REQ, backlog).prefill - p.cost(REQ, idle).prefill == pytest.approx(6000 * idle.prefill_s_per_token)
