"""The papers' reported numbers that the report compares against, and bounds their own models imply."""

from __future__ import annotations

from common import perf_model
from common.catalog import Catalog
from loadtest.sim import capacity

# capability-weighted routing paper, Table 2 (8 GPUs, Llama-70B, ShareGPT, 1.0×): tok/s, P95 TTFT, P99 E2E
TABLE2 = {
    "round_robin": (2222.0, 28.5, 235.4),
    "capacity_proportional": (2200.0, 11.4, 190.1),
    "shortest_queue": (2256.0, 3.4, 182.8),
    "heteroserve": (6190.0, 14.6, 124.0),
    "oracle": (4828.0, 15.7, 133.6),
}
# Table 3 (8 GPUs, ShareGPT, 1.0×): tok/s mean and std per model
TABLE3 = {
    "round_robin": {"llama-2-7b": (22166.0, 2428.0), "llama-2-70b": (2222.0, 245.0)},
    "shortest_queue": {"llama-2-7b": (25773.0, 9281.0), "llama-2-70b": (2256.0, 117.0)},
    "heteroserve": {"llama-2-7b": (46447.0, 3583.0), "llama-2-70b": (6190.0, 484.0)},
    "oracle": {"llama-2-7b": (24304.0, 4289.0), "llama-2-70b": (4828.0, 872.0)},
}
RATIO = 2.8                                                    # HeteroServe / Uniform at 1.0×
LOAD = {0.5: {"round_robin": 2147.0, "heteroserve": 4805.0}, 1.0: {"round_robin": 2222.0, "heteroserve": 6190.0},
        2.0: {"heteroserve": 6567.0}}                          # §4.3, Fig. 4
HETEROGENEITY_GAIN = {"homogeneous 8×A100": 1.0, "2-tier 4×H100+4×A100": 64.0,
                      "3-tier 2×H100+3×A100+3×L40S": 179.0}    # % over Uniform, §4.4 (homogeneous: "<1%")
WORKLOAD_GAIN = {"sharegpt": 179.0, "short_heavy": 103.0, "bimodal": 38.0, "uniform": 42.0, "long_heavy": -7.0}
SCALING_EFFICIENCY_32 = 91.0                                   # %, §4.6
ABLATION = {"w2=0 (no queue)": -58.0, "w1=0 (no length term)": -45.0, "w3=0 (no OOM veto)": 1.5}   # %, §5.1
W2_ROBUSTNESS = 3.0                                            # any w2 > 0 within 3% of the best

# modality paper, Tables 4, 8 and §6.5 (LLaVA-1.5-7B, COCO): tok/s, hardware $
MODALITY = {
    "4×A100 monolithic": (5986.0, 64000.0),
    "2×4090 vision + 2×A100": (2793.0, 38000.0),
    "2×4090 vision + 2×A100 + stealing": (3156.0, 38000.0),
}
VLLM_4XA100 = 3886.0


def uniform_bound(catalog: Catalog, gpus: tuple[str, ...], model: str, workload: str, mode: str) -> float:
    """Σ_i μ_i / (N · min_i μ_i): the most any policy can gain over a saturated round robin, whose
    slowest GPU receives 1/N of the requests."""
    m = catalog.model(model)
    mus = [capacity.service_rate(m, catalog.gpu(g), mode, workload) for g in gpus]
    return sum(mus) / (len(mus) * min(mus))


def serial_max_output_tok_s(catalog: Catalog, gpus: tuple[str, ...], model: str) -> float:
    """The paper's serial model at its limit: every GPU decoding all the time at B_i / (2·P) tokens/s."""
    m = catalog.model(model)
    return sum(1.0 / perf_model.serial_decode_seconds_per_token(m, catalog.gpu(g)) for g in gpus)
