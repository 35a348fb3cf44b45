"""backends.yaml: the one config path, parsed strictly (unknown keys are errors naming file and key)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    Discriminator,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from common import yaml_files
from common.catalog import CONFIG_DIR, HF_CONFIG_DIR, Catalog, GpuProfile, ModelProfile, load_catalog
from common.errors import ConfigError
from common.one_line_parser import GRPC_SCHEMES
from common.yaml_files import StrictModel, union_tag
from gateway.config.auth import AuthConfig
from gateway.config.autoscaling import POOL_ROLES, AutoscalingConfig, check_min, check_reference_request, pick_template
from gateway.config.models import MODEL_NAME, ModelNames, ModelSpec, ServedModel
from gateway.config.sections import (
    AdmissionConfig,
    BreakerConfig,
    CorsConfig,
    OverloadConfig,
    RedisConfig,
    TlsConfig,
    require_torch,
)
from gateway.config.tenants import TenantsConfig
from gateway.requests.images import ImageLimits
from gateway.routing.policies import build_policy
from gateway.routing.policies.stealing import DEFAULT_MAX_BATCH, DEFAULT_THRESHOLD

DEFAULT_BACKENDS = CONFIG_DIR / "backends.yaml"
CATALOG_FILES = frozenset({"gpus.yaml", "models.yaml"})   # in CONFIG_DIR beside the clusters, not clusters


def shipped_clusters() -> dict[str, Path]:
    """The cluster files the package carries (package data, so a wheel has them too), by name: the
    file name without `.yaml`."""
    return {p.stem: p for p in sorted(CONFIG_DIR.glob("*.yaml")) if p.name not in CATALOG_FILES}


def find_cluster(given: str) -> Path:
    """`--backends`: a file, else the name of a shipped cluster (`tiny-real`, `backends.yaml`); a
    ConfigError naming the shipped ones for anything else."""
    path = Path(given)
    if path.exists() and not path.is_dir():
        return path
    shipped = shipped_clusters()
    name = given.removesuffix(".yaml")
    # a bare name (even where a folder has it, as `backends` in a checkout); a path with folders means that file
    if name in shipped and path.name == given:
        return shipped[name]
    if path.is_dir():
        raise ConfigError(f"{given}: a folder, not a cluster file")
    raise ConfigError(f"{given}: no such file, and not the name of a shipped cluster ({', '.join(shipped)})")


class LaunchSpec(StrictModel):
    """How the gateway starts a managed engine (`python -m backends.engine ...`).

    `executor: torch` runs the real model: from `model_path` (a local Hugging Face directory) or with
    `random_weights` built from the catalog's Hugging Face config (`seed` picks the weights).
    """

    executor: Literal["simulated", "torch"] = "simulated"
    model_path: str | None = None
    random_weights: bool = False
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    seed: int = 0
    max_model_len: PositiveInt | None = None     # KV tokens per sequence slot (default: the model's context)
    time_scale: float = Field(default=1.0, ge=0)
    max_batch: PositiveInt = 256
    memory_utilization: float = Field(default=0.9, gt=0, le=1)
    vision_batch: PositiveInt = 32                 # aligned encode batch: images ...
    vision_batch_timeout_ms: PositiveFloat = 50.0  # ... or this long after the first one
    steal_episode_ms: PositiveFloat = 100.0        # bound on one work-stealing step
    extra_args: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _weights(self) -> LaunchSpec:
        if self.executor == "simulated":
            if self.model_path is not None or self.random_weights:
                raise ValueError("`model_path` and `random_weights` need `executor: torch`")
            return self
        if (self.model_path is None) == (not self.random_weights):
            raise ValueError("`executor: torch` needs exactly one of `model_path` and `random_weights: true`")
        if self.model_path is not None and not Path(self.model_path, "config.json").is_file():
            raise ValueError(f"model_path {self.model_path}: no config.json there (a local Hugging Face directory "
                             "is needed; nothing is downloaded)")
        return self


class CommandLaunchSpec(StrictModel):
    """How the gateway starts an OpenAI-compatible engine of a `kind: openai` entry (`vllm serve ...`).

    `{port}` in the command is replaced by `port` (a free loopback port picked at start-up when not
    given); `devices` become CUDA_VISIBLE_DEVICES. The backend is `starting` until `GET ready_path`
    answers 200, for at most `start_timeout_s` (then the process group is killed and started again).
    """

    command: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    devices: list[Annotated[int, Field(ge=0)]] | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    ready_path: str = Field(default="/health", pattern=r"^/")
    start_timeout_s: PositiveFloat = 900.0     # model loads take minutes
    probe_interval_s: PositiveFloat = 0.5

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        """A string is split as a shell would (no shell runs it)."""
        return shlex.split(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _port_reaches_the_engine(self) -> CommandLaunchSpec:
        if self.port is None and not any("{port}" in arg for arg in self.command):
            raise ValueError("the command needs `{port}` where the engine takes its port (or give `port`)")
        return self


_ENGINE, _COMMAND = union_tag("engine"), union_tag("command")


def _launch_kind(value: Any) -> str:
    command = isinstance(value, CommandLaunchSpec) or (isinstance(value, dict) and "command" in value)
    return _COMMAND.tag if command else _ENGINE.tag


Launch = Annotated[
    Annotated[LaunchSpec, _ENGINE] | Annotated[CommandLaunchSpec, _COMMAND],
    Discriminator(_launch_kind),
]


class ScrapeSpec(StrictModel):
    """Gateway-side scraping of an engine's Prometheus /metrics (for engines without an agent)."""

    engine: Literal["vllm", "sglang", "trtllm"]
    metrics_url: str | None = None       # default: <address>/metrics
    # default: gateway.heartbeat_interval_ms, as fresh as an agent's heartbeats (a longer one is allowed:
    # the backend then stays heard from for the miss limit of its own interval)
    interval_ms: PositiveInt | None = None

    def interval_s(self, heartbeat_interval_ms: int) -> float:
        return (self.interval_ms or heartbeat_interval_ms) / 1000


class ProbeSpec(StrictModel):
    """How the gateway asks a kind: openai upstream whether it answers at all, apart from its metrics:
    GET `path` every `interval_ms`; any HTTP status below 500 within `timeout_ms` is an answer. After
    `failures` probes in a row without one the backend is unreachable: no candidate and not counted
    ready, so requests fail at once (503) instead of waiting on it; one answer brings it back."""

    path: str | None = Field(default=None, pattern=r"^/")   # default: launch.ready_path, else /v1/models
    interval_ms: PositiveInt | None = None   # default: gateway.heartbeat_interval_ms
    timeout_ms: PositiveInt = 2000
    failures: PositiveInt = 2

    def url(self, address: str, launch: CommandLaunchSpec | None) -> str:
        return address + (self.path or (launch.ready_path if launch is not None else "/v1/models"))


ENDPOINT = r"^(tcp://[^\s/]+:[0-9]{1,5}|ipc://\S+)$"   # a ZeroMQ endpoint the gateway connects to


class KvEventsSpec(StrictModel):
    """Where a kind: openai engine publishes its KV cache events (vLLM's and SGLang's
    `--kv-events-config`, publisher zmq; common/kv_events.py): the gateway subscribes, and its prefix
    index follows what the engine stores and evicts (gateway/control/kv_event_listener.py). With
    `replay_endpoint` (the publisher's `replay_endpoint`) the batches a subscriber missed, on joining
    late or lost on the way, are asked for again from the engine's buffer (gateway/control/kv_event_replay.py)."""

    # the engine's ZeroMQ PUB endpoint as the gateway connects to it (vLLM binds tcp://*:5557 by default)
    endpoint: str = Field(pattern=ENDPOINT)
    topic: str = ""                      # the prefix of the topics subscribed to (vLLM's `topic`, "" by default)
    replay_endpoint: str | None = Field(default=None, pattern=ENDPOINT)   # its ROUTER (vLLM: tcp://*:5558 bound)
    replay_timeout_ms: int = Field(default=2000, gt=0, le=60_000)   # a replay not ended within this: the rest is lost

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _port(cls, endpoint: str | None) -> str | None:
        if endpoint is None or not endpoint.startswith("tcp://"):
            return endpoint
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if host in ("*", "0.0.0.0", "[::]"):   # a bind address, refused
            raise ValueError(f"endpoint {endpoint!r}: the gateway connects to the engine: name its host "
                             "(the engine binds tcp://*:PORT)")
        if not 0 < int(port) < 65536:
            raise ValueError(f"endpoint {endpoint!r}: the port is 1-65535")
        return endpoint

    @model_validator(mode="after")
    def _two_sockets(self) -> KvEventsSpec:
        if self.replay_endpoint is None and "replay_timeout_ms" in self.model_fields_set:
            raise ValueError("replay_timeout_ms bounds the requests to the engine's replay socket: name it "
                             "(replay_endpoint)")
        if self.replay_endpoint == self.endpoint:
            raise ValueError(f"replay_endpoint {self.endpoint!r} is the events' endpoint: the engine binds its "
                             "replay socket on a port of its own (vLLM: replay_endpoint tcp://*:5558)")
        return self


def check_address(address: str, kind: str) -> None:
    """ValueError unless `address` is what the backend's client dials: an engine's gRPC `host:port`
    (`[v6]:port`), or a target gRPC names by its scheme (`dns:///engine.svc:7000`, `unix:/run/e.sock`,
    ...), taken as it is; a kind: openai base URL `http(s)://host[:port][/path]`."""
    if kind == "openai":
        parts = urlsplit(address)
        try:
            port = parts.port   # ValueError when not a number in 0-65535
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == 0 or port == -1:
            raise ValueError(f"address {address!r}: kind: openai needs a base URL, e.g. http://10.0.0.5:8000")
        return
    if address.startswith(GRPC_SCHEMES):
        return
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:   # an IPv6 address takes brackets before its port
        host = ""
    if not sep or not host or "/" in host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"address {address!r}: an engine's address is host:port, e.g. 10.0.0.5:7000")


class BackendSpec(StrictModel):
    id: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")
    kind: Literal["engine", "openai"] = "engine"   # engine: our gRPC engine; openai: vLLM/SGLang/... over HTTP
    role: Literal["language", "vision", "both"] = "language"
    gpu: str
    address: str | None = None      # engine: host:port; openai: base URL. Managed engines report theirs.
    launch: Launch | None = None
    steal: bool = False
    # Kept for the tenants of this priority class or higher (gateway.tenants): the requests of a lower
    # class are never routed here, for language work, stealing or encoding. None (the default): anyone's.
    min_priority: int | None = None
    # the model(s) it serves, by name (gateway/config/models.py): default the cluster's first model; a
    # kind: openai upstream may serve several
    model: str | list[str] | None = None
    upstream_model: str | None = None   # openai: the model name the upstream serves (default: the model's name)
    scrape: ScrapeSpec | None = None
    # openai: a heartbeat agent (heterogate-agent) pushes its load; heartbeats for any other kind: openai
    # backend are refused, since the gateway watches those itself
    agent: bool = False
    probe: ProbeSpec | None = None      # openai: the liveness probe (default: ProbeSpec())
    kv_events: KvEventsSpec | None = None   # openai: the engine's KV cache events, for the prefix index
    # openai: the upstream takes vLLM `image_embeds` parts (vllm serve --enable-mm-embeds), so a vision
    # backend encodes the images and the upstream runs only the language model
    image_embeds: bool = False
    # Where the engine does not report them (see README "Honest limits"): context (prompt + completion
    # tokens) and KV capacity in tokens. The engine's own figures win; without either, the catalog
    # model's context and the performance model's KV estimate.
    max_model_len: PositiveInt | None = None
    kv_capacity_tokens: PositiveInt | None = None
    # openai: sent upstream as `Authorization: Bearer ...` (vllm serve --api-key); the env var is read at start-up
    api_key: str | None = Field(default=None, min_length=1)
    api_key_env: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _managed_or_external(self) -> BackendSpec:
        if self.launch is None and self.address is None:
            raise ValueError("an entry needs `launch` (managed) or `address` (external)")
        if self.address is not None:
            check_address(self.address, self.kind)
        if self.steal and self.role != "vision":
            raise ValueError("`steal` applies to vision backends only")
        if isinstance(self.model, list) and not self.model:
            raise ValueError("`model: []` serves nothing; name at least one model (or leave `model` out)")
        if isinstance(self.model, list) and len(self.model) > 1:
            if self.kind != "openai":
                raise ValueError("an engine serves one model; only a kind: openai upstream may list several")
            if self.upstream_model is not None:
                raise ValueError("`upstream_model` renames one model; a backend serving several sends each "
                                 "request's model under its own name")
        if self.kind == "openai":
            if self.role != "language":
                raise ValueError("kind: openai backends are language backends (role language)")
            if self.launch is not None and not isinstance(self.launch, CommandLaunchSpec):
                raise ValueError("a kind: openai `launch` needs `command` (e.g. vllm serve ... --port {port})")
            if self.launch is None and not (self.address or "").startswith(("http://", "https://")):
                raise ValueError("kind: openai needs `address` as a base URL, e.g. http://10.0.0.5:8000")
            if self.launch is not None and self.address is not None:
                raise ValueError("a managed kind: openai entry gets its address from `launch.port`; drop `address`")
            if self.api_key is not None and self.api_key_env is not None:
                raise ValueError("give `api_key` or `api_key_env`, not both")
            if self.agent and (self.scrape is not None or self.launch is not None):
                raise ValueError("`agent: true` is for an engine the gateway neither scrapes nor launches: with "
                                 "`scrape` or `launch` the gateway reads its load itself")
        else:
            if isinstance(self.launch, CommandLaunchSpec):
                raise ValueError("`launch.command` applies to kind: openai backends only")
            openai_only = ("upstream_model", "scrape", "image_embeds", "api_key", "api_key_env", "agent", "probe",
                           "kv_events")
            given = [f"`{name}`" for name in openai_only if getattr(self, name) not in (None, False)]
            if given:
                raise ValueError(f"{', '.join(given)} apply to kind: openai backends only")
        return self

    def upstream_api_key(self) -> str | None:
        """The key sent upstream; an `api_key_env` naming an unset variable is a ConfigError."""
        if self.api_key_env is None:
            return self.api_key
        value = os.environ.get(self.api_key_env)
        if not value:
            raise ConfigError(f"environment variable {self.api_key_env} is not set (api_key_env)")
        return value


class Limits(StrictModel):
    max_prompt_tokens: PositiveInt | None = None   # default: no cap beyond the backends' contexts
    max_tokens: PositiveInt = 4096                 # upper bound a client may ask for
    default_max_tokens: PositiveInt = 256          # for requests that name none; at most max_tokens
    max_body_bytes: PositiveInt = 32 << 20         # images arrive base64-encoded inside the body
    body_timeout_s: PositiveFloat = 60.0           # a body whole this long after its headers, else 408
    max_messages: PositiveInt = 256
    max_choices: PositiveInt = 8                   # `n`: kind: openai backends only (engines give one choice)
    max_stop_strings: PositiveInt = 16             # `stop` (OpenAI takes 4, vLLM any): each is checked every token
    max_attempts: PositiveInt = 3                  # dispatch attempts before the first token
    first_token_timeout_s: PositiveFloat = 60.0        # the longest wait for a first token, whatever is predicted
    first_token_floor_s: PositiveFloat = 10.0          # the first-token limit: max(this, factor x predicted TTFT)
    first_token_ttft_factor: PositiveFloat = 4.0       # (the pipeline's `predicted_ttft_s`), at most the timeout
    request_timeout_s: PositiveFloat = 600.0       # server maximum; clients may ask for less (x-request-timeout)

    @model_validator(mode="after")
    def _default_within_max(self) -> Limits:
        """An explicit default above its cap contradicts it (max_tokens; the first-token timeout for the
        floor); a built-in one is cut to the cap."""
        if "default_max_tokens" in self.model_fields_set and self.default_max_tokens > self.max_tokens:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) is above max_tokens ({self.max_tokens}), "
                             "the most a request may ask for")
        if "first_token_floor_s" in self.model_fields_set and self.first_token_floor_s > self.first_token_timeout_s:
            raise ValueError(f"first_token_floor_s ({self.first_token_floor_s:g}) is above first_token_timeout_s "
                             f"({self.first_token_timeout_s:g}), which caps every first-token limit: the floor would "
                             "never apply")
        return self


class KeepAliveConfig(StrictModel):
    """Idle keep-alive on both sides of the gateway.

    The front door keeps an idle client connection longer than common client pools do (aiohttp 15 s,
    httpx 5 s), so the client always closes first and never writes into a connection the server is
    closing. Towards upstreams the gateway is the client: its pool drops an idle connection before the
    engine does (vLLM and SGLang close after 5 s), for the same reason.
    """

    client_idle_s: PositiveFloat = 75.0      # HTTP front door
    upstream_idle_s: PositiveFloat = 4.0     # pooled connections to kind: openai backends
    upstream_max_connections: PositiveInt = 1024   # per kind: openai backend


class PrefixCacheConfig(StrictModel):
    """Cache-aware routing (gateway/routing/prefix_index.py): the prompt prefix each backend's cache is
    predicted to hold is priced as the prefill it saves there."""

    enabled: bool = True
    # tokens a block of the index stands for (4 engine blocks); a hit is counted in whole blocks, so a
    # block longer than most prompts would predict none
    block_tokens: int = Field(default=64, ge=1, le=4096, strict=True)
    # the index's bound per backend, below its KV in blocks: ~100 bytes a block, ~100 MB at the most
    max_blocks_per_backend: int = Field(default=1 << 20, ge=1, le=1 << 20, strict=True)
    images_per_encoder: int = Field(default=256, ge=1, le=1 << 20, strict=True)   # image digests per encoder


class RoutingConfig(StrictModel):
    policy: str = "marginal_delay"           # language pool
    vision_policy: str = "encode_cost"       # vision pool
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    itl_target_ms: PositiveFloat = 100.0     # mean inter-token time each request's slack is counted against
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()


class StealingConfig(StrictModel):
    enabled: bool = True
    threshold: PositiveInt = DEFAULT_THRESHOLD   # τ: language backlog that lets vision GPUs steal
    max_batch: PositiveInt = DEFAULT_MAX_BATCH   # language requests a stealing GPU holds at most


class GatewaySettings(StrictModel):
    heartbeat_interval_ms: PositiveInt = 200
    heartbeat_miss_limit: PositiveInt = 3
    # A pool with no backend heard from within the miss limit routes on those heard from within this (0: off)
    heartbeat_fail_open_s: NonNegativeFloat = 5.0
    engine_start_timeout_s: PositiveFloat = 60.0     # kind: engine; kind: openai has launch.start_timeout_s
    engine_stop_timeout_s: PositiveFloat = 10.0      # managed engines: SIGTERM, SIGKILL after half of it
    handoff_timeout_s: PositiveFloat = 10.0   # a language engine waits this long for embeddings
    drain_timeout_s: PositiveFloat = 30.0     # on SIGTERM: finish in-flight requests for up to this long
    retry_backoff_s: PositiveFloat = 0.02     # first retry waits U(0.5, 1) × this; doubles per retry
    retry_backoff_max_s: PositiveFloat = 1.0
    routing: RoutingConfig = RoutingConfig()
    limits: Limits = Limits()
    images: ImageLimits = ImageLimits()
    stealing: StealingConfig = StealingConfig()
    breaker: BreakerConfig = BreakerConfig()
    admission: AdmissionConfig = AdmissionConfig()
    overload: OverloadConfig = OverloadConfig()   # hold requests at the gateway when every TTFT is past the SLO
    auth: AuthConfig = AuthConfig()
    tls: TlsConfig = TlsConfig()
    cors: CorsConfig = CorsConfig()   # browsers on other origins (off: no allow_origins)
    keep_alive: KeepAliveConfig = KeepAliveConfig()
    redis: RedisConfig = RedisConfig()
    tenants: TenantsConfig = TenantsConfig()   # keys -> tenants, their priority, weight and limits
    autoscaling: AutoscalingConfig = AutoscalingConfig()   # pools that grow and shrink (off by default)
    # A simulated vision engine sends random numbers as embeddings: a real `image_embeds` upstream would
    # answer from noise, so such a cluster is refused unless this says the upstream is a simulation too.
    simulated_embeddings: bool = False


class ClusterFile(StrictModel):
    # a catalog folder (gpus.yaml, models.yaml: the figures of GPUs and models the file names), relative to
    # the file; default the built-in one (configs/). Managed engines are started with it too.
    catalog: Path | None = None
    model: str
    served_model_name: str | None = Field(default=None, pattern=MODEL_NAME)
    aliases: list[str] = Field(default_factory=list)   # other names of the first model
    # the first model's tokenizer (a local Hugging Face directory, relative to the file): text prompts to its
    # kind: openai backends are counted and hashed by it (README, "KV cache events"); `models:` each say theirs
    tokenizer: str | None = Field(default=None, min_length=1)
    models: list[ModelSpec] = Field(default_factory=list)   # more models (gateway/config/models.py)
    gateway: GatewaySettings = GatewaySettings()
    backends: list[BackendSpec] = Field(min_length=1)

    @field_validator("backends")
    @classmethod
    def _distinct(cls, backends: list[BackendSpec]) -> list[BackendSpec]:
        """Ids and the ports of managed kind: openai engines are each one backend's: two engines told one
        port both started, the second failed to listen and was restarted for ever, reported ready by the
        first one's answer to its probe. (Two entries may name one upstream: a server with LoRA adapters,
        each entry renaming its model with `upstream_model`.)"""
        for what, key in (("backend id", lambda b: b.id), ("launch.port", command_port)):
            seen: dict[object, int] = {}
            for i, b in enumerate(backends):
                if (k := key(b)) is None:
                    continue
                if k in seen:
                    raise ValueError(f"duplicate {what} {k!r} (entries {seen[k]} and {i})")
                seen[k] = i
        return backends

    @model_validator(mode="after")
    def _events_need_the_index(self) -> ClusterFile:
        with_events = [b.id for b in self.backends if b.kv_events is not None]
        endpoints: dict[str, str] = {}
        for b in self.backends:   # one engine's events describe one engine's cache
            spec = b.kv_events
            for endpoint in (spec.endpoint, spec.replay_endpoint) if spec is not None else ():
                if endpoint is not None and (other := endpoints.setdefault(endpoint, b.id)) != b.id:
                    raise ValueError(f"backends {other} and {b.id} name one kv_events endpoint {endpoint}")
        if with_events and not self.gateway.routing.prefix_cache.enabled:
            raise ValueError(f"backends {', '.join(with_events)}: `kv_events` feed the prefix index, which "
                             "gateway.routing.prefix_cache.enabled: false turns off")
        return self


def hf_context(config: Path) -> int | None:
    """A Hugging Face config's context (its text model's max_position_embeddings), None where it says none."""
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    value = text.get("max_position_embeddings")
    return value if isinstance(value, int) else None


def command_port(b: BackendSpec) -> int | None:
    """The port a managed kind: openai engine is told to serve on (None: not one, or a free one chosen)."""
    return b.launch.port if isinstance(b.launch, CommandLaunchSpec) else None


class ClusterConfig:
    """A validated backends.yaml resolved against the catalogs."""

    def __init__(self, path: Path, raw: ClusterFile, catalog: Catalog) -> None:
        self.path = path
        self.raw = raw
        self.catalog = catalog
        self.model: ModelProfile = _resolve(path, "model", lambda: catalog.model(raw.model))
        self.models = ModelNames(_served_models(path, raw, catalog, self.model))
        self.backend_models: dict[str, tuple[ServedModel, ...]] = {
            b.id: _models_of(path, f"backends.{i} ({b.id}).model", b, self.models)
            for i, b in enumerate(raw.backends)
        }
        self.gpus: dict[str, GpuProfile] = {
            b.id: _resolve(path, f"backends.{i} ({b.id}).gpu", lambda b=b: catalog.gpu(b.gpu))
            for i, b in enumerate(raw.backends)
        }
        routing = raw.gateway.routing
        for key, name in (("policy", routing.policy), ("vision_policy", routing.vision_policy)):
            _resolve(path, f"gateway.routing.{key}", lambda n=name: build_policy(n, routing.params.get(n)))
        for served in self.models.models.values():
            if not any(b.role in ("language", "both") and served in self.backend_models[b.id] for b in raw.backends):
                raise ConfigError(f"{path}: backends: none takes language work (role language or both) for model "
                                  f"{served.name!r}; every request needs one, and a vision backend only encodes images")
        for i, b in enumerate(raw.backends):
            for served in self.backend_models[b.id]:
                if served.profile.vision is None and (b.role != "language" or b.image_embeds):
                    field = "role" if b.role != "language" else "image_embeds"
                    raise ConfigError(f"{path}: backends.{i} ({b.id}).{field}: model {served.name!r} has no vision "
                                      "encoder")
            if b.image_embeds:
                _resolve(path, f"backends.{i} ({b.id}).image_embeds", require_torch)
            runs = self.model_of(b.id)
            if isinstance(b.launch, LaunchSpec) and b.launch.executor == "torch" and runs.profile.hf_config is None:
                raise ConfigError(f"{path}: backends.{i} ({b.id}).launch.executor: model {runs.catalog!r} has no "
                                  "Hugging Face config in the catalog (hf_config); it runs on simulated engines only")
            if isinstance(b.launch, LaunchSpec) and b.launch.executor == "torch" and b.launch.max_model_len:
                hf = (Path(b.launch.model_path) if b.launch.model_path else HF_CONFIG_DIR) / (
                    "config.json" if b.launch.model_path else str(runs.profile.hf_config))
                context = hf_context(hf)
                if context and b.launch.max_model_len > context:   # the engine would refuse it at every launch
                    raise ConfigError(f"{path}: backends.{i} ({b.id}).launch.max_model_len: {b.launch.max_model_len} "
                                      f"is over the model's context of {context} tokens ({hf.name}: "
                                      "max_position_embeddings)")
        tenants = raw.gateway.tenants
        highest = tenants.classes[-1]
        for i, b in enumerate(raw.backends):
            if b.min_priority is not None and b.min_priority > highest:
                raise ConfigError(f"{path}: backends.{i} ({b.id}).min_priority: {b.min_priority} is above every "
                                  f"tenant's priority class (the highest is {highest}): nothing would be "
                                  "routed to it")
        simulated_vision = [b.id for b in raw.backends if b.role == "vision" and isinstance(b.launch, LaunchSpec)
                            and b.launch.executor == "simulated"]
        embeds = [(i, b.id) for i, b in enumerate(raw.backends) if b.image_embeds]
        if embeds and simulated_vision and not raw.gateway.simulated_embeddings:
            i, bid = embeds[0]
            raise ConfigError(
                f"{path}: backends.{i} ({bid}).image_embeds: vision backend(s) {', '.join(simulated_vision)} run "
                "the simulated executor, whose embeddings are random numbers; give them `launch.executor: torch` "
                "with the upstream's weights, or set gateway.simulated_embeddings: true if the upstream is a "
                "simulation too")
        self.api_keys: dict[str, str | None] = {
            b.id: _resolve(path, f"backends.{i} ({b.id}).api_key_env", b.upstream_api_key)
            for i, b in enumerate(raw.backends) if b.kind == "openai"
        }
        self.torch_weights = _torch_weights(path, raw.backends, self.backend_models)
        torch_ids = [b.id for b in raw.backends if isinstance(b.launch, LaunchSpec) and b.launch.executor == "torch"]
        # the model the torch engines run: its requests are tokenised exactly (gateway/requests/exact_prompt.py)
        self.torch_model: ServedModel | None = self.model_of(torch_ids[0]) if torch_ids else None
        scaling = raw.gateway.autoscaling
        if scaling.mode != "off" and scaling.pools.language is not None:
            contexts = [m.profile.max_context for b in raw.backends if b.role in POOL_ROLES["language"]
                        for m in self.backend_models[b.id]]
            _resolve(path, "gateway.autoscaling.pools.language.ttft_prompt_tokens",
                     lambda s=scaling.pools.language: check_reference_request(s, contexts))
        for pool, pool_scaling in scaling.scaled().items() if scaling.mode == "manage" else ():
            where = f"gateway.autoscaling.pools.{pool}"
            for gpu in pool_scaling.gpus:
                _resolve(path, f"{where}.gpus", lambda g=gpu: catalog.gpu(g))
            _resolve(path, f"{where}.min", lambda p=pool, s=pool_scaling: check_min(p, s, raw.backends))
            _resolve(path, f"{where}.template", lambda p=pool, s=pool_scaling: pick_template(p, s, raw.backends))
        for name, params in routing.params.items():
            _resolve(path, f"gateway.routing.params.{name}", lambda n=name, p=params: build_policy(n, p))

    @property
    def served_model_name(self) -> str:
        """The first model's name (the one backends serve unless they name another)."""
        return self.models.default.name

    def encodes_images(self, model: str) -> bool:
        """Whether some backend of `model` takes its images: one that encodes them (role vision or both),
        or an upstream that reads them itself (kind: openai without image_embeds)."""
        served = self.models.models[model]
        return any(served in self.backend_models[b.id]
                   and (b.role in ("vision", "both") or (b.kind == "openai" and not b.image_embeds))
                   for b in self.raw.backends)

    def model_of(self, backend_id: str) -> ServedModel:
        """The (first) model a backend serves: its engine runs it, its figures come from its profile."""
        return self.backend_models[backend_id][0]

    @property
    def settings(self) -> GatewaySettings:
        return self.raw.gateway


def _torch_weights(path: Path, backends: list[BackendSpec], models: dict[str, tuple[ServedModel, ...]]) -> (
    tuple[str | None, int] | None
):
    """The weights every torch engine runs ((model_path or None for random weights, seed)); None without
    torch engines. They must agree: a split's halves must be one model, and the gateway tokenises for it
    (one tokenizer: torch engines serve one model of the cluster, the others run on simulated engines or
    upstreams)."""
    found = {(b.launch.model_path, b.launch.seed if b.launch.random_weights else 0, models[b.id][0].name): b.id
             for b in backends if isinstance(b.launch, LaunchSpec) and b.launch.executor == "torch"}
    if len(found) > 1:
        raise ConfigError(f"{path}: torch engines {', '.join(found.values())} run different weights "
                          "(model_path / seed / model); a split needs one model, and the gateway tokenises for one")
    return next(((model_path, seed) for model_path, seed, _ in found), None)


def _served_models(path: Path, raw: ClusterFile, catalog: Catalog, first: ModelProfile) -> list[ServedModel]:
    """The first model (`model`, `served_model_name`, `aliases`), then `models`; names unique across all."""
    def folder(setting: str, tokenizer: str | None) -> Path | None:
        if tokenizer is None:
            return None
        found = (path.parent / tokenizer).resolve()
        if not (found / "tokenizer_config.json").is_file():
            raise ConfigError(f"{path}: {setting}: {found} holds no tokenizer (tokenizer_config.json)")
        return found

    out = [ServedModel(raw.served_model_name or raw.model, raw.model, first, tuple(raw.aliases),
                       folder("tokenizer", raw.tokenizer))]
    for i, spec in enumerate(raw.models):
        name = spec.catalog or spec.name
        profile = _resolve(path, f"models.{i} ({spec.name}).catalog", lambda n=name: catalog.model(n))
        out.append(ServedModel(spec.name, name, profile, tuple(spec.aliases),
                               folder(f"models.{i} ({spec.name}).tokenizer", spec.tokenizer)))
    seen: dict[str, str] = {}   # each name or alias: the field that gave it
    for k, m in enumerate(out):
        where = "" if k == 0 else f"models.{k - 1} ({m.name})."
        named = ((m.name, "served_model_name" if raw.served_model_name else "model") if k == 0
                 else (m.name, f"{where}name"))
        for alias, field in (named, *((a, f"{where}aliases") for a in m.aliases)):
            if alias in seen:
                raise ConfigError(f"{path}: {field}: model name {alias!r} is given twice (first by {seen[alias]}); "
                                  "each name or alias picks one model")
            seen[alias] = field
    return out


def _models_of(path: Path, where: str, spec: BackendSpec, names: ModelNames) -> tuple[ServedModel, ...]:
    """A backend's models, by their served names (not aliases: a config names what it means)."""
    given = [spec.model] if isinstance(spec.model, str) else spec.model or [names.default.name]
    out = []
    for name in given:
        if name not in names.models:
            raise ConfigError(f"{path}: {where}: no model {name!r} in this cluster (it serves {names.names()})")
        out.append(names.models[name])
    return tuple(dict.fromkeys(out))


def _resolve(path: Path, where: str, fn: Any) -> Any:
    try:
        return fn()
    except ConfigError as exc:
        raise ConfigError(f"{path}: {where}: {exc}") from None


def load_cluster(path: Path = DEFAULT_BACKENDS, catalog: Catalog | None = None) -> ClusterConfig:
    """The file at `path`, resolved against `catalog`, else the catalog it names, else the built-in one."""
    raw: ClusterFile = yaml_files.load(path, ClusterFile)
    if catalog is None:
        folder = catalog_dir(path, raw)
        if folder is not None and not folder.is_dir():
            raise ConfigError(f"{path}: catalog: {raw.catalog} is not a folder (gpus.yaml, models.yaml) "
                              f"relative to this file ({folder})")
        catalog = load_catalog(folder or CONFIG_DIR)
    return ClusterConfig(path, raw, catalog)


def catalog_dir(path: Path, raw: ClusterFile) -> Path | None:
    """The catalog folder the file names, resolved against the file's own folder; None: the built-in one."""
    return None if raw.catalog is None else (path.parent / raw.catalog).resolve()
