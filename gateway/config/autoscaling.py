"""`gateway.autoscaling`: how many engines each pool (vision, language) should run, and where new ones come from.

The scaler (gateway/control/autoscaler.py) reads the pools' demand; this is only its schema and the checks
start-up makes against the backends file (the template backend, the inventory's GPUs in the catalog).
Off by default.

- `mode: manage`: the gateway adds engines (copies of the pool's template backend, one per GPU of the
  inventory) and drains and stops the ones it added, through gateway/control/fleet.py.
- `mode: export`: it changes nothing and exports the desired engine count per pool on /metrics
  (`heterogate_pool_desired_replicas`), for an autoscaler outside (KEDA, HPA) that runs the engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, TypeVar

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from common.errors import ConfigError
from common.yaml_files import StrictModel

Pool = Literal["language", "vision"]


class PoolScaling(StrictModel):
    """One pool's bounds, inventory and marks. A pool's need is its largest signal over that signal's
    high mark, in engines: at or above the engines it has, demand is high; averaged over the down delay
    and spread over one engine fewer, at `low_mark` or less, that engine may go."""

    min: NonNegativeInt = 1
    max: PositiveInt
    # GPUs free for new engines, one entry per GPU (names of the catalog, repeated for several); manage mode
    gpus: list[str] = Field(default_factory=list)
    # the managed backend whose entry new engines copy (default: the pool's first managed `kind: engine`)
    template: str | None = None
    low_mark: float = Field(default=0.3, ge=0, lt=1)   # the load the engines left may carry, of their high mark
    max_step: PositiveInt = 4   # engines one step may add or remove

    @model_validator(mode="after")
    def _bounds(self) -> PoolScaling:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self


class VisionScaling(PoolScaling):
    image_tokens_per_engine: PositiveInt = 4096     # high mark: image tokens waiting per vision engine


class LanguageScaling(PoolScaling):
    prefill_tokens_per_engine: PositiveInt = 16384  # high mark: prompt tokens sent, first token not seen
    queue_per_engine: PositiveFloat = 16.0          # high mark: requests held (Q_i) or queued at admission
    ttft_slo_s: PositiveFloat = 2.0                 # high mark: the best engine's predicted time to first token
    ttft_prompt_tokens: NonNegativeInt = 512        # ... for a prompt of this many tokens
    ttft_max_tokens: NonNegativeInt = 128           # ... and max_tokens (its KV: prompt + these)


class ScaledPools(StrictModel):
    language: LanguageScaling | None = None
    vision: VisionScaling | None = None


class AutoscalingConfig(StrictModel):
    mode: Literal["off", "manage", "export"] = "off"
    interval_s: PositiveFloat = 1.0     # demand is read and the decision made this often
    # demand above the high mark this long (at a need just above the engines; a need n times them: 1/n of it)
    up_delay_s: float = Field(default=10.0, ge=0)
    down_delay_s: float = Field(default=60.0, ge=0)    # the window averaged before engines go
    # a step up is sized for the need this far ahead, at the rate it grew during its high spell (about an
    # engine's start-up: what arrives while the new engines load waits for them); 0: the need as measured
    lookahead_s: float = Field(default=30.0, ge=0)
    pools: ScaledPools = ScaledPools()

    def scaled(self) -> dict[Pool, PoolScaling]:
        """The pools scaled (those configured)."""
        out: dict[Pool, PoolScaling] = {}
        if self.pools.language is not None:
            out["language"] = self.pools.language
        if self.pools.vision is not None:
            out["vision"] = self.pools.vision
        return out

    @model_validator(mode="after")
    def _some_pool(self) -> AutoscalingConfig:
        if self.mode != "off" and not self.scaled():
            raise ValueError(f"mode {self.mode} needs at least one pool (`pools.language` or `pools.vision`)")
        return self


POOL_ROLES: dict[Pool, tuple[str, ...]] = {"language": ("language", "both"), "vision": ("vision",)}


class Entry(Protocol):
    """What the template is chosen by, of an entry of `backends:` (cluster.py's BackendSpec, which imports
    this module)."""

    @property
    def id(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def launch(self) -> object | None: ...


B = TypeVar("B", bound=Entry)


def template_of(pool: Pool, scaling: PoolScaling, backends: Sequence[B]) -> B:
    """The backend a new engine of the pool copies: new engines
    are managed simulated or torch engines (`kind: engine` with `launch`), of the pool's role. ConfigError
    when there is none (removing the template at runtime is refused for the same reason)."""
    role = "vision" if pool == "vision" else "language"
    fits = [b for b in backends if b.kind == "engine" and b.launch is not None and b.role == role]
    if scaling.template is not None:
        named = next((b for b in backends if b.id == scaling.template), None)
        if named is None or named not in fits:
            raise ConfigError(f"template {scaling.template!r} is not a managed `kind: engine` backend with role "
                             f"{role} in `backends:`")
        return named
    if not fits:
        raise ConfigError(f"manage mode needs a managed `kind: engine` backend with role {role} to copy "
                         "(or `template:` naming one)")
    return fits[0]
