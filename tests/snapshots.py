"""Build `BackendSnapshot`s from the catalogs and the performance model, as the state table does."""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cache

from common import perf_model
from common.catalog import Catalog, load_catalog
from gateway.routing.policies.contracts import BackendSnapshot, Role

MODEL = "llava-1.5-7b"
# The state table's prior for T̄_service: one 512-token prompt, 128 output tokens, unloaded.
SERVICE_PROMPT_TOKENS, SERVICE_OUTPUT_TOKENS = 512, 128


@cache
def catalog() -> Catalog:
    return load_catalog()


def snapshot(
    backend_id: str,
    gpu: str,
    *,
    model: str = MODEL,
    role: Role = "language",
    queue_depth: int = 0,
    in_flight: int | None = None,
    kv_free_bytes: int | None = None,
    mean_service_s: float | None = None,
    vision_backlog: int = 0,
) -> BackendSnapshot:
    """An idle backend by default: the whole KV budget free, T̄_service = the performance-model prior."""
    cat = catalog()
    m, g = cat.model(model), cat.gpu(gpu)
    kv_total = perf_model.kv_capacity_bytes(m, g)
    if mean_service_s is None:
        mean_service_s = perf_model.service_seconds(m, g, SERVICE_PROMPT_TOKENS, SERVICE_OUTPUT_TOKENS)
    return BackendSnapshot(
        id=backend_id,
        role=role,
        gpu=g.name,
        tflops=g.tflops,
        bandwidth_gbs=g.bandwidth_gbs,
        price_per_hour=g.price_per_hour,
        queue_depth=queue_depth,
        in_flight=queue_depth if in_flight is None else in_flight,
        kv_free_bytes=kv_total if kv_free_bytes is None else kv_free_bytes,
        kv_total_bytes=kv_total,
        kv_bytes_per_token=m.kv_bytes_per_token,
        vision_backlog=vision_backlog,
        mean_service_s=mean_service_s,
        prefill_s_per_token=perf_model.prefill_seconds_per_token(m, g),
        weight_bytes=m.weight_bytes,
        encode_s_per_token=perf_model.encode_seconds(m, g, 1),
    )


def cluster(counts: dict[str, int], *, model: str = MODEL) -> list[BackendSnapshot]:
    """`{"H100": 2, "L40S": 1}` -> idle snapshots h100-0, h100-1, l40s-0."""
    return [snapshot(f"{gpu.lower()}-{i}", gpu, model=model) for gpu, n in counts.items() for i in range(n)]


def random_cluster(
    rng: random.Random,
    n: int,
    *,
    gpus: Sequence[str] | None = None,
    max_queue: int = 32,
    model: str = MODEL,
) -> list[BackendSnapshot]:
    """`n` backends of GPU types drawn from `gpus` (default: the whole catalog), random queues and free KV."""
    cat = catalog()
    names = sorted(cat.gpus) if gpus is None else list(gpus)
    out = []
    for i in range(n):
        gpu = rng.choice(names)
        kv_total = perf_model.kv_capacity_bytes(cat.model(model), cat.gpu(gpu))
        queue = rng.randint(0, max_queue)
        kv_free = int(kv_total * rng.random())
        out.append(snapshot(f"b{i}", gpu, model=model, queue_depth=queue, kv_free_bytes=kv_free))
    return out
