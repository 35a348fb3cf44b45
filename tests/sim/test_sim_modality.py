"""The modality split: conservation, bytes moved, vision-first encode timing, stealing thresholds."""

from __future__ import annotations

import numpy as np
import pytest

from common import perf_model
from common.catalog import load_catalog
from loadtest.sim.engines import Recorder
from loadtest.sim.modality import DEPLOYMENTS, VlmRunSpec, VlmSimulation, build, run_vlm
from loadtest.sim.workloads import make_trace

SATURATED, MODERATE = 100.0, 10.0          # requests/s; one A100 serves ≈ 20 COCO requests/s


def _simulate(spec: VlmRunSpec) -> tuple[Recorder, VlmSimulation]:
    trace = make_trace(spec.workload, "poisson", spec.rate, spec.n_requests, spec.seed)
    rec = Recorder.for_lengths(trace.lengths)
    sim = VlmSimulation(spec, trace, build(spec, load_catalog(), rec), rec)
    sim.run()
    return rec, sim


@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
@pytest.mark.parametrize("workload", ["coco", "mm_mixed"])
def test_every_request_completes_once(deployment: str, workload: str) -> None:
    rec, sim = _simulate(VlmRunSpec(deployment, SATURATED, n_requests=400, workload=workload))
    assert not np.isnan(rec.finish).any() and not rec.rejected.any()
    assert sum(e.entry.in_flight for e in sim.engines) == 0
    assert all(e.batcher.idle and not e.encode_queue and e.backlog_tokens == 0 for e in sim.engines)


def test_bytes_moved_are_embeddings_only_when_split() -> None:
    catalog = load_catalog()
    model = catalog.model("llava-1.5-7b")
    _, mono = _simulate(VlmRunSpec("4×A100 monolithic", SATURATED, n_requests=300))
    rec, split = _simulate(VlmRunSpec("2×4090 vision + 2×A100", SATURATED, n_requests=300))
    assert mono.bytes_moved == 0
    assert split.bytes_moved == 300 * perf_model.embedding_bytes(model, 576)
    assert np.isin(rec.backend, [2, 3]).all()                  # language work only on the A100s


def test_vision_gpus_steal_only_under_backlog() -> None:
    light = run_vlm(VlmRunSpec("2×4090 vision + 2×A100 + stealing", MODERATE, n_requests=300))
    heavy = run_vlm(VlmRunSpec("2×4090 vision + 2×A100 + stealing", SATURATED, n_requests=600))
    assert light["stolen_share"] == 0.0
    assert heavy["stolen_share"] > 0.0


def test_first_token_follows_encode_and_prefill() -> None:
    """One request on an idle split cluster: encode batch timeout, encode, PCIe, then prefill."""
    rec, _ = _simulate(VlmRunSpec("2×4090 vision + 2×A100", 1.0, n_requests=1))
    catalog = load_catalog()
    model, a100, rtx = catalog.model("llava-1.5-7b"), catalog.gpu("A100-80GB"), catalog.gpu("RTX-4090")
    prompt = int(rec.lengths.input_tokens[0])
    expected = (0.05 + perf_model.encode_seconds(model, rtx, 576) + perf_model.embedding_bytes(model, 576) / 25e9
                + perf_model.prefill_seconds(model, a100, prompt))
    assert rec.first_token[0] == pytest.approx(expected, rel=1e-9)
