"""Builds an engine's executors from its config: simulated (performance model) or torch (the real model).

torch and transformers are imported only for `executor: torch`, so a simulated engine starts in well
under a second and needs neither.
"""

from __future__ import annotations

from collections.abc import Callable

from backends.engine_config import EngineConfig
from backends.executors import LanguageExecutor, VisionEncoder
from backends.scheduling import stealing_limits
from backends.sim_encoder import SimulatedEncoder
from backends.sim_executor import SimulatedExecutor
from backends.vision_executor import Deliver, VisionExecutor
from common import perf_model
from common.catalog import GpuProfile, ModelProfile


def build_executors(
    config: EngineConfig, model: ModelProfile, gpu: GpuProfile, deliver: Deliver, on_change: Callable[[], None]
) -> tuple[LanguageExecutor | None, VisionExecutor | None]:
    wants_vision = config.role in ("vision", "both")
    wants_language = config.role in ("language", "both") or config.steal
    stealing = config.role == "vision"
    # a stealing GPU keeps its language steps short: half a batch, and bounded prefill per step
    max_batch, prefill_budget = config.max_batch, None
    if stealing:
        max_batch, prefill_budget = stealing_limits(
            config.max_batch, config.steal_episode_ms / 1000, perf_model.prefill_seconds_per_token(model, gpu)
        )
    encoder: VisionEncoder | None = None
    language: LanguageExecutor | None = None
    if config.executor == "simulated":
        if wants_vision:
            encoder = SimulatedEncoder(model, gpu, time_scale=config.time_scale)
        if wants_language:
            kv = perf_model.kv_capacity_bytes(
                model, gpu, memory_utilization=config.memory_utilization, encoder_loaded=wants_vision
            )
            language = SimulatedExecutor(
                model, gpu, kv, time_scale=config.time_scale, max_batch=max_batch,
                max_prefill_tokens=prefill_budget, on_change=on_change,
            )
    else:
        from backends.torch_executor import TorchLanguageExecutor, kv_budget_bytes
        from backends.torch_models import load_model
        from backends.torch_vision import TorchEncoder

        keep = "both" if wants_vision and wants_language else "vision" if wants_vision else "language"
        loaded = load_model(model, model_path=config.model_path, seed=config.seed, dtype=config.dtype,
                            device=config.device, keep=keep)
        if wants_vision:
            encoder = TorchEncoder(loaded, model)
        if wants_language:
            language = TorchLanguageExecutor(
                loaded, model, gpu, kv_budget=kv_budget_bytes(loaded, model, gpu, config.memory_utilization),
                max_batch=max_batch, max_len=config.max_model_len or model.max_context, on_change=on_change,
            )
    vision = None
    if encoder is not None:
        vision = VisionExecutor(
            encoder, deliver, time_scale=config.time_scale if config.executor == "simulated" else 1.0,
            max_images=config.vision_batch, batch_timeout_s=config.vision_batch_timeout_ms / 1000,
            on_change=on_change, cache_images=config.embedding_cache_images,
        )
    return language, vision
