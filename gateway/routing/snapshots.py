"""The snapshot builder: a backend's immutable `BackendSnapshot`, what policies read, from its entry.

Pure: the figures come from the entry (what its engine reported, this gateway's leases, the other
replicas' load, the learned speed) and from what the table resolved for it (KV capacity, context,
service time); nothing is read from a clock or a network. The state table (state_table.py) decides
when a snapshot is stale and caches the one this builds.
"""

from __future__ import annotations

from typing import NamedTuple

from common import perf_model
from common.catalog import GpuProfile, ModelProfile
from gateway.routing.backend_entry import BackendEntry
from gateway.routing.policies.contracts import BackendSnapshot, Role


class FixedFigures(NamedTuple):
    """A backend's snapshot figures that depend only on the model, its GPU and its configuration:
    computed once, at registration, instead of on every rebuild (a busy gateway rebuilds a few
    snapshots per decision)."""

    identity: tuple[str, Role, str, float, float, float]   # id, role, gpu, tflops, bandwidth_gbs, price_per_hour
    kv_bytes_per_token: int
    prefill_s_per_token: float
    weight_bytes: int
    encode_s_per_token: float
    unreported_kv_bytes: int                  # KV capacity where the engine reports none
    max_context: int                          # the catalog model's context


def fixed_figures(backend_id: str, role: Role, gpu: GpuProfile, profile: ModelProfile, unreported_kv_bytes: int) -> (
    FixedFigures
):
    return FixedFigures(
        (backend_id, role, gpu.name, gpu.tflops, gpu.bandwidth_gbs, gpu.price_per_hour),
        profile.kv_bytes_per_token, perf_model.prefill_seconds_per_token(profile, gpu),
        profile.weight_bytes, perf_model.encode_seconds(profile, gpu, 1), unreported_kv_bytes, profile.max_context,
    )


def build_snapshot(e: BackendEntry, fixed: FixedFigures, kv: tuple[int, int], mean_service_s: float,
                   max_context: int, blind: bool = False) -> BackendSnapshot:
    """The entry's snapshot; `kv`: (free, total) bytes as the table resolved them. `blind`: what the
    gateway knows without metrics (its own in-flight counts, the configured or nominal KV, all free).

    Arguments go by position in BackendSnapshot's field order: 24 keyword arguments took longer to
    match than the snapshot takes to build (1.3 µs against 0.3), and a busy gateway rebuilds a few
    snapshots per decision (`dataclasses.replace` on the snapshot, for the blind one, took 4.6 µs
    against 2.0). tests/unit/test_state_table.py checks every field by name."""
    r, peer, speed = e.reported, e.peer, e.speed
    in_flight = e.in_flight + peer.in_flight
    if blind:   # its own counts only: no other clients' load either
        queue_depth, kv_free, kv_total = in_flight, fixed.unreported_kv_bytes, fixed.unreported_kv_bytes
        foreign_backlog = foreign_running = 0
    else:
        queue_depth = max(in_flight, r.waiting + r.running)
        kv_free, kv_total = kv
        foreign_backlog, foreign_running = e.foreign_backlog_tokens, e.foreign_running
    backend_id, role, gpu, tflops, bandwidth_gbs, price_per_hour = fixed.identity   # a call with *args costs more
    return BackendSnapshot(
        backend_id, role, gpu, tflops, bandwidth_gbs, price_per_hour,
        queue_depth, in_flight,
        kv_free, kv_total, fixed.kv_bytes_per_token,
        max(r.vision_backlog, e.vision_in_flight_tokens + peer.vision_tokens),   # vision_backlog
        mean_service_s,
        fixed.prefill_s_per_token, fixed.weight_bytes, fixed.encode_s_per_token, e.steal,
        max_context,
        speed.prefill.value, speed.decode.value,            # learned_prefill_s_per_token, decode_step_s
        e.prefilling + peer.prefilling,
        e.prefill_backlog_tokens + peer.prefill_backlog_tokens + foreign_backlog,
        e.kv_reserved_tokens + peer.kv_reserved_tokens,
        e.slack.slacks(),                                                       # itl_slack_s
        speed.stall_factor, speed.stall_per_prompt_s,                           # calibrated stalls
        foreign_running,
    )
