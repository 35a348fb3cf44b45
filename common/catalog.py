"""GPU and model catalogs (configs/gpus.yaml, configs/models.yaml) as immutable value types."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from common import yaml_files
from common.errors import ConfigError
from common.yaml_files import StrictModel

# Package data: `common/configs` links to the repository's top-level `configs/`, so a wheel carries the
# catalogs and the demo cluster (pyproject: package-data) and a checkout reads the same files.
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
HF_CONFIG_DIR = CONFIG_DIR / "hf"
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8": 1}


class GpuProfile(StrictModel):
    name: str = ""
    tflops: PositiveFloat
    bandwidth_gbs: PositiveFloat
    hbm_gb: PositiveFloat
    price_per_hour: float = Field(ge=0)
    purchase_usd: float | None = None
    source: str = ""

    @property
    def flops(self) -> float:
        return self.tflops * 1e12

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_gbs * 1e9

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gb * 1e9)


class VisionProfile(StrictModel):
    mode: Literal["fixed", "dynamic"]
    tokens_per_image: PositiveInt | None = None
    pixels_per_token_side: PositiveInt = 28
    patch_size: PositiveInt = 14          # ViT patch side; tokens merge (side / patch)² patches (Qwen: 2×2)
    min_pixels: PositiveInt = 3136
    max_pixels: PositiveInt = 12845056
    encoder_params: PositiveFloat
    patches_per_token: PositiveInt = 1

    def model_post_init(self, _context: object) -> None:
        if self.mode == "fixed" and self.tokens_per_image is None:
            raise ValueError("a fixed vision profile needs tokens_per_image")


class ModelProfile(StrictModel):
    name: str = ""
    params: PositiveFloat
    layers: PositiveInt
    kv_heads: PositiveInt
    head_dim: PositiveInt
    hidden: PositiveInt
    dtype: Literal["float16", "bfloat16", "float32", "fp8"] = "float16"
    max_context: PositiveInt = 4096
    vision: VisionProfile | None = None
    # Hugging Face config (configs/hf/<file>): what a torch engine builds with random weights, and the
    # architecture it expects in a `model_path`; None: the model runs on simulated engines only
    hf_config: str | None = None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def weight_bytes(self) -> int:
        return int(self.params * self.dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) · layers · kv_heads · head_dim · dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def image_tokens(self, width: int, height: int) -> int:
        """Vision tokens for one image of `width` x `height` pixels (0 for a text-only model)."""
        v = self.vision
        if v is None:
            return 0
        if v.mode == "fixed":
            assert v.tokens_per_image is not None
            return v.tokens_per_image
        rows, cols = _dynamic_grid(width, height, v)
        return rows * cols

    def image_grid_thw(self, width: int, height: int) -> tuple[int, int, int] | None:
        """Qwen2-VL's `image_grid_thw` (frames, patch rows, patch columns); None for fixed-size encoders."""
        v = self.vision
        if v is None or v.mode == "fixed":
            return None
        rows, cols = _dynamic_grid(width, height, v)
        merge = v.pixels_per_token_side // v.patch_size
        return 1, rows * merge, cols * merge


def _dynamic_grid(width: int, height: int, v: VisionProfile) -> tuple[int, int]:
    """Qwen2-VL `smart_resize` as token rows × columns: sides to multiples of the factor, area in [min, max]."""
    f = v.pixels_per_token_side
    h = max(f, round(height / f) * f)
    w = max(f, round(width / f) * f)
    if h * w > v.max_pixels:
        beta = math.sqrt(height * width / v.max_pixels)
        h = max(f, math.floor(height / beta / f) * f)
        w = max(f, math.floor(width / beta / f) * f)
    elif h * w < v.min_pixels:
        beta = math.sqrt(v.min_pixels / (height * width))
        h = math.ceil(height * beta / f) * f
        w = math.ceil(width * beta / f) * f
    return h // f, w // f


@dataclass(frozen=True)
class Catalog:
    gpus: dict[str, GpuProfile]
    models: dict[str, ModelProfile]

    def gpu(self, name: str) -> GpuProfile:
        try:
            return self.gpus[name]
        except KeyError:
            raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(sorted(self.gpus))}") from None

    def model(self, name: str) -> ModelProfile:
        try:
            return self.models[name]
        except KeyError:
            raise ConfigError(f"unknown model {name!r}; known: {', '.join(sorted(self.models))}") from None


def load_catalog(config_dir: Path = CONFIG_DIR) -> Catalog:
    gpu_path, model_path = config_dir / "gpus.yaml", config_dir / "models.yaml"
    gpus: dict[str, GpuProfile] = yaml_files.load(gpu_path, dict[str, GpuProfile])
    models: dict[str, ModelProfile] = yaml_files.load(model_path, dict[str, ModelProfile])
    return Catalog(
        gpus={k: g.model_copy(update={"name": k}) for k, g in gpus.items()},
        models={k: m.model_copy(update={"name": k}) for k, m in models.items()},
    )
