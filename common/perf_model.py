"""Roofline performance model: the one source of step timings and byte counts.

The simulated engine sleeps for these times, the router's prefill term uses them, and the
discrete-event simulator advances virtual time by them.

    prefill(L)            = 2 · P · L / F
    decode step(b, ctx)   = max((weight bytes + KV bytes of ctx tokens) / B,  2 · P · b / F)
    encode(image tokens)  = 2 · encoder params · patches / F
    KV bytes per token    = 2 · layers · kv_heads · head_dim · dtype bytes
    embedding bytes       = vision tokens · hidden · dtype bytes

Peak figures are used as they are (no efficiency factor): the model ranks GPUs and sizes queues; it
does not promise wall-clock times of a real engine.
"""

from __future__ import annotations

import math

from common.catalog import GpuProfile, ModelProfile

# Share of HBM an engine may use (vLLM's gpu_memory_utilization default).
DEFAULT_MEMORY_UTILIZATION = 0.9


def prefill_seconds_per_token(model: ModelProfile, gpu: GpuProfile) -> float:
    return 2.0 * model.params / gpu.flops


def prefill_seconds(model: ModelProfile, gpu: GpuProfile, tokens: int) -> float:
    return tokens * prefill_seconds_per_token(model, gpu)


def roofline_step_seconds(
    bytes_read: float, bandwidth_bytes_s: float, tokens: float, compute_s_per_token: float
) -> float:
    """One engine step: stream `bytes_read` from HBM or compute `tokens` tokens, whichever takes longer.

    Takes plain numbers so that a routing policy can call it on a backend snapshot's figures.
    """
    return max(bytes_read / bandwidth_bytes_s, tokens * compute_s_per_token)


def roofline_run_seconds(
    weights_s: float, kv_s_per_token: float, compute_s_per_token: float, batch: int, context_tokens: int, steps: int
) -> float:
    """`steps` decode steps of a fixed batch whose context grows by `batch` tokens a step, in closed form:
    Σ_j roofline_step_seconds(weights + (context + j·batch)·KV bytes, B, batch, 2P/F).

    The memory time rises linearly while the compute time is constant, so the first n steps are
    compute-bound and the rest memory-bound, each part an arithmetic series. Takes per-GPU constants
    (weight bytes / B, KV bytes per token / B, 2P/F) so that a caller can compute them once.
    """
    memory = weights_s + context_tokens * kv_s_per_token
    slope = batch * kv_s_per_token
    compute = batch * compute_s_per_token
    n = 0 if memory >= compute else min(steps, math.ceil((compute - memory) / slope))
    return n * compute + (steps - n) * memory + slope * ((steps - 1) * steps - (n - 1) * n) / 2


def decode_step_seconds(model: ModelProfile, gpu: GpuProfile, batch: int, context_tokens: int) -> float:
    """One decode iteration for `batch` sequences holding `context_tokens` tokens of KV in total."""
    if batch <= 0:
        return 0.0
    return roofline_step_seconds(model.weight_bytes + context_tokens * model.kv_bytes_per_token,
                                 gpu.bandwidth_bytes_s, batch, prefill_seconds_per_token(model, gpu))


def serial_decode_seconds_per_token(model: ModelProfile, gpu: GpuProfile) -> float:
    """The capability-weighted paper's serial engine: 2 · P / B per token (weights streamed once)."""
    return 2.0 * model.params / gpu.bandwidth_bytes_s


def encoder_flops(model: ModelProfile, image_tokens: int) -> float:
    if model.vision is None:
        return 0.0
    patches = image_tokens * model.vision.patches_per_token
    return 2.0 * model.vision.encoder_params * patches


def encode_seconds(model: ModelProfile, gpu: GpuProfile, image_tokens: int) -> float:
    return encoder_flops(model, image_tokens) / gpu.flops


def kv_bytes(model: ModelProfile, tokens: int) -> int:
    return tokens * model.kv_bytes_per_token


def embedding_bytes(model: ModelProfile, image_tokens: int) -> int:
    return image_tokens * model.hidden * model.dtype_bytes


def encoder_weight_bytes(model: ModelProfile) -> int:
    return 0 if model.vision is None else int(model.vision.encoder_params * model.dtype_bytes)


def kv_capacity_bytes(
    model: ModelProfile,
    gpu: GpuProfile,
    *,
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
    decoder_loaded: bool = True,
    encoder_loaded: bool = False,
) -> int:
    """HBM left for the KV cache once the weights that live on this GPU are loaded."""
    budget = gpu.hbm_bytes * memory_utilization
    if decoder_loaded:
        budget -= model.weight_bytes
    if encoder_loaded:
        budget -= encoder_weight_bytes(model)
    return max(0, int(budget))


def service_seconds(model: ModelProfile, gpu: GpuProfile, prompt_tokens: int, output_tokens: int) -> float:
    """Unloaded service time of one request: prefill, then decode at batch 1."""
    ctx = prompt_tokens + output_tokens // 2
    return prefill_seconds(model, gpu, prompt_tokens) + output_tokens * decode_step_seconds(model, gpu, 1, ctx)
