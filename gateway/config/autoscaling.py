"""`gateway.autoscaling`: how many engines each pool (vision, language) should run, and where new ones come from.

The scaler (gateway/control/autoscaler.py) reads the pools' demand; this is only its schema and the checks
start-up makes against the backends file (the template backend, `min` within reach of the engines and
the inventory, the inventory's GPUs in the catalog, the language pool's reference request within its
models' context).
Off by default.

- `mode: manage`: the gateway adds engines (copies of the pool's template backend, one per GPU of the
  inventory) and drains and stops the ones it added, through gateway/control/fleet.py.
- `mode: export`: it changes nothing and exports the desired engine count per pool on /metrics
  (`heterogate_pool_desired_replicas`), for an autoscaler outside (KEDA, HPA) that runs the engines.
  A pool's `gpus` and `template` say where manage mode's new engines come from; export mode starts none,
  so it refuses them rather than ignore them (and an unknown GPU or template in them) without a word.

Every duration is finite and bounded: an infinite interval or delay would turn the scaler off without a
word, and an interval of microseconds spins a CPU reading demand that cannot change that fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, TypeVar

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from common.errors import ConfigError
from common.yaml_files import StrictModel

Pool = Literal["language", "vision"]
MIN_INTERVAL_S = 0.05     # demand changes no faster than heartbeats (100 ms at the least) report it
MAX_INTERVAL_S = 60.0     # a scaler that looks less than once a minute misses whole bursts
MAX_DELAY_S = 3600.0      # up and down delays and the lookahead; also bounds the down window's ticks (72,000)


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
    # the load the engines left may carry, of their high mark
    low_mark: float = Field(default=0.3, ge=0, lt=1, allow_inf_nan=False)
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
    # high mark: requests held (Q_i) or queued at admission
    queue_per_engine: float = Field(default=16.0, gt=0, allow_inf_nan=False)
    # high mark: the best engine's predicted time to first token
    ttft_slo_s: float = Field(default=2.0, gt=0, allow_inf_nan=False)
    ttft_prompt_tokens: NonNegativeInt = 512        # ... for a prompt of this many tokens
    ttft_max_tokens: NonNegativeInt = 128           # ... and max_tokens (its KV: prompt + these)


class ScaledPools(StrictModel):
    language: LanguageScaling | None = None
    vision: VisionScaling | None = None


class AutoscalingConfig(StrictModel):
    mode: Literal["off", "manage", "export"] = "off"
    # demand is read and the decision made this often
    interval_s: float = Field(default=1.0, ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S, allow_inf_nan=False)
    # demand above the high mark this long (at a need just above the engines; a need n times them: 1/n of it)
    up_delay_s: float = Field(default=10.0, ge=0, le=MAX_DELAY_S, allow_inf_nan=False)
    # the window averaged before engines go
    down_delay_s: float = Field(default=60.0, ge=0, le=MAX_DELAY_S, allow_inf_nan=False)
    # a step up is sized for the need this far ahead, at the rate it grew during its high spell (about an
    # engine's start-up: what arrives while the new engines load waits for them); 0: the need as measured
    lookahead_s: float = Field(default=30.0, ge=0, le=MAX_DELAY_S, allow_inf_nan=False)
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
        if self.mode == "export":
            for pool, scaling in self.scaled().items():
                given = [key for key in ("gpus", "template") if key in scaling.model_fields_set]
                if given:
                    raise ValueError(f"pools.{pool}: {' and '.join(given)} would be ignored: mode export starts no "
                                     "engines (an autoscaler outside runs them); they are manage mode's")
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


def check_min(pool: Pool, scaling: PoolScaling, backends: Sequence[Entry]) -> None:
    """ConfigError where a managed pool's `min` is out of reach of the engines in `backends` and the GPUs
    of its inventory (the scaler adds an engine only on a GPU of `gpus`, so a `min` above both is a pool
    that can never be as large as it says). Checked at start-up and at every change of the fleet."""
    engines = sum(1 for b in backends if b.role in POOL_ROLES[pool])
    if scaling.min > engines + len(scaling.gpus):
        raise ConfigError(f"min {scaling.min} cannot be reached: {engines} engine(s) of the pool in `backends:` "
                          f"and {len(scaling.gpus)} GPU(s) in its `gpus:` inventory make at most "
                          f"{engines + len(scaling.gpus)}; lower min or list more GPUs")


def check_reference_request(scaling: LanguageScaling, contexts: Sequence[int]) -> None:
    """ConfigError where the language pool's reference request (`ttft_prompt_tokens` + `ttft_max_tokens`, whose
    predicted first token the scaler compares with `ttft_slo_s`) fits no context of the pool's models
    (`contexts`): its prefill would be predicted however long, so an idle pool would read as high and grow."""
    reference = scaling.ttft_prompt_tokens + scaling.ttft_max_tokens
    if contexts and reference > max(contexts):
        raise ConfigError(f"{scaling.ttft_prompt_tokens} + ttft_max_tokens {scaling.ttft_max_tokens} = {reference} "
                          f"tokens, more than the pool's models' context ({max(contexts)}): no engine takes such "
                          "a request; give a typical one")


def pick_template(pool: Pool, scaling: PoolScaling, backends: Sequence[B]) -> B:
    """The backend a new engine of the pool copies: a managed simulated or torch engine (`kind: engine`
    with `launch`) of one of the pool's roles, `template:` or else the first in the file. A copy keeps its
    template's role: a `both` engine (a monolithic plan's, `gateway plan` writes them) counts in the
    language pool, and its copy is another monolithic engine that encodes its own images, as the plan's
    engines do; a copy as role language would leave every image to the engines there before it.
    ConfigError when there is none."""
    roles = POOL_ROLES[pool]
    fits = [b for b in backends if b.kind == "engine" and b.launch is not None and b.role in roles]
    wanted = " or ".join(roles)
    if scaling.template is not None:
        named = next((b for b in backends if b.id == scaling.template), None)
        if named is None or named not in fits:
            raise ConfigError(f"template {scaling.template!r} is not a managed `kind: engine` backend with role "
                             f"{wanted} in `backends:`")
        return named
    if not fits:
        raise ConfigError(f"manage mode needs a managed `kind: engine` backend with role {wanted} to copy "
                         "(or `template:` naming one)")
    return fits[0]
