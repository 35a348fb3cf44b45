"""The `gateway:` section's smaller schemas: admission, overload, breakers, TLS files, CORS, Redis.

They live here, not beside the code that uses them, so the config room imports no feature module: a
feature imports its settings from here, never the other way round.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from common.errors import ConfigError
from common.yaml_files import StrictModel


class AdmissionConfig(StrictModel):
    max_waiting: NonNegativeInt = 1024      # 0 = no queue: 429 as soon as everything is saturated
    saturated_queue_depth: PositiveInt = 256  # a backend with Q_i at least this is saturated
    max_wait_s: float = Field(default=30.0, gt=0)
    # A request that goes past a saturated pool on its tenant's `min_in_flight` goes to the backend where
    # its first token is predicted soonest, not where the pool's policy would send it (False: the policy's).
    guaranteed_first_token: bool = True


class OverloadConfig(StrictModel):
    """The overload queue (gateway/pipeline/overload.py): when every backend's predicted time to first
    token for a request is above `hold_above_s`, the gateway holds it (earliest deadline first) instead
    of adding it to an engine's queue, and releases it when a backend's prediction falls to that.

    A held request must leave by its start deadline, arrival + min(max_wait_s, ttft_slo_s -
    hold_above_s) (sooner if its own deadline is): released then, its first token can still come
    within `ttft_slo_s`. One still held at its start deadline gets 429 with Retry-After; one that finds
    `max_queued` held gets it at once (unless it takes a lower tenant class's place), and so, with
    `refuse_at_once`, does one that the requests ahead of it, at the rate requests have been
    completing, would take past its start deadline (off: that estimate refused requests that would
    have started in time). A request goes, at once or when
    released, to one of the backends that take it (`gateway.pipeline.overload.taking`)."""

    enabled: bool = True
    ttft_slo_s: PositiveFloat = 2.0       # the time to first token a request is held against
    hold_above_s: PositiveFloat = 1.0     # hold while every backend's predicted TTFT for it is above this
    max_wait_s: PositiveFloat = 1.0       # held at most this long
    max_queued: NonNegativeInt = 1024     # held at most this many at once (0: 429 instead of holding)
    protect_itl: bool = True              # hold too while its prefill would break every backend's inter-token slack
    itl_reserve_steps: NonNegativeFloat = 4.0   # with protect_itl: slack each in-flight request keeps, in decode steps
    refuse_at_once: bool = False          # 429 on arrival when those held ahead, at the completion rate, start too late
    rate_window: PositiveInt = Field(default=64, ge=2)   # completions the recent completion rate is taken over

    @model_validator(mode="after")
    def _hold_below_slo(self) -> OverloadConfig:
        if self.hold_above_s >= self.ttft_slo_s:
            raise ValueError(f"hold_above_s ({self.hold_above_s}) must be below ttft_slo_s ({self.ttft_slo_s}): a "
                             "request released at that prediction has no time left to wait")
        return self


class BreakerConfig(StrictModel):
    failure_threshold: PositiveInt = 5
    open_s: float = Field(default=5.0, gt=0)


class TlsFiles(StrictModel):
    cert_file: Path
    key_file: Path


class TlsConfig(StrictModel):
    http: TlsFiles | None = None
    grpc: TlsFiles | None = None
    ca_file: Path | None = None


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")   # an HTTP token (RFC 9110 §5.6.2): a header or method name
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")
_HOST = re.compile(r"[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?|\[[0-9a-f:.]+\]")   # a name, an IPv4 or a [IPv6] address
_DEFAULT_PORTS = {"http": 80, "https": 443}


def cors_origin(value: str) -> str:
    """`value` as browsers send it in `Origin`: scheme://host[:port], lower case, without the scheme's
    default port; ValueError naming what is wrong otherwise."""
    text = value.strip().lower()
    try:
        parts = urlsplit(text)
    except ValueError:
        parts = None
    if parts is None or not _SCHEME.fullmatch(parts.scheme) or not text.startswith(f"{parts.scheme}://"):
        raise ValueError(f"origin {value!r} is not scheme://host[:port] (such as https://app.example.com)")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"origin {value!r}: the port is not a number from 1 to 65535") from None
    if parts.path or parts.query or parts.fragment or text.endswith(("?", "#")):
        raise ValueError(f"origin {value!r} has a path, query or fragment: an origin is scheme://host[:port] only, "
                         "without even a trailing slash")
    host = parts.netloc.rpartition(":")[0] if port is not None or parts.netloc.endswith(":") else parts.netloc
    if "@" in parts.netloc or not _HOST.fullmatch(host):
        raise ValueError(f"origin {value!r}: {host!r} is no host name or address (a wildcard such as *.example.com "
                         'is not supported: list each origin, or allow every one with "*")')
    if port == 0 or (port is None and parts.netloc.endswith(":")):
        raise ValueError(f"origin {value!r} has an empty or zero port")
    if port is None or _DEFAULT_PORTS.get(parts.scheme) == port:
        return f"{parts.scheme}://{host}"
    return f"{parts.scheme}://{host}:{port}"


def _tokens(values: list[str], what: str, case: str, prefixes: bool = False) -> list[str]:
    """The names, "*" (any), and with `prefixes` names ending in "*" (any name that starts so)."""
    out: list[str] = []
    for value in values:
        name = value[:-1] if prefixes and len(value) > 1 and value.endswith("*") else value
        if value != "*" and (not _TOKEN.fullmatch(name) or "*" in name):
            raise ValueError(f"{what} {value!r} is not a valid HTTP token" + (
                ' ("*" alone, or at the end of a prefix such as x-stainless-*)' if prefixes else ' (or "*" alone)'))
        value = value.upper() if case == "upper" else value.lower()
        if value not in out:
            out.append(value)
    return out


class CorsConfig(StrictModel):
    """Cross-origin requests from browsers (gateway/doors/http_server.py, `Cors`): off while
    `allow_origins` is empty. `"*"` there allows every origin; otherwise exact origins. The default
    headers are those the gateway reads (`allow_headers`) and sets (`expose_headers`); a `"*"` in
    `allow_methods` or `allow_headers` answers a preflight with the method or headers it asked for, and
    an `allow_headers` entry ending in `*` allows every header that starts so (`x-stainless-*`: the
    OpenAI JavaScript SDK's, a set that grows with its versions)."""

    allow_origins: list[str] = Field(default_factory=list)
    allow_methods: list[str] = Field(default_factory=lambda: ["GET", "POST", "DELETE"])
    # those the gateway reads, and those the OpenAI (and every Stainless-made) JavaScript SDK adds to each request
    allow_headers: list[str] = Field(default_factory=lambda: [
        "authorization", "content-type", "x-request-id", "x-request-timeout", "x-session-id", "traceparent",
        "tracestate", "x-stainless-*"])
    expose_headers: list[str] = Field(default_factory=lambda: [
        "x-request-id", "x-heterogate-backend", "x-heterogate-vision-backend", "retry-after", "x-should-retry"])
    max_age_s: NonNegativeInt = 600       # how long a browser may keep a preflight's answer
    allow_credentials: bool = False       # cookies and HTTP auth from the browser (not needed for a bearer key)

    @field_validator("allow_origins")
    @classmethod
    def _origins(cls, values: list[str]) -> list[str]:
        out: list[str] = []
        for value in values:
            origin = "*" if value.strip() == "*" else cors_origin(value)
            if origin not in out:
                out.append(origin)
        return out

    @field_validator("allow_methods")
    @classmethod
    def _methods(cls, values: list[str]) -> list[str]:
        return _tokens(values, "method", "upper")

    @field_validator("allow_headers")
    @classmethod
    def _allowed_headers(cls, values: list[str]) -> list[str]:
        return _tokens(values, "header", "lower", prefixes=True)

    @field_validator("expose_headers")
    @classmethod
    def _exposed_headers(cls, values: list[str]) -> list[str]:
        return _tokens(values, "header", "lower")

    @model_validator(mode="after")
    def _credentials_need_origins(self) -> CorsConfig:
        if self.allow_credentials and "*" in self.allow_origins:
            raise ValueError('allow_credentials: true cannot go with allow_origins "*": the CORS protocol (Fetch '
                             "standard) refuses a credentialed response allowed for every origin; list the origins")
        if self.allow_credentials and "*" in self.expose_headers:
            raise ValueError('allow_credentials: true cannot go with expose_headers "*": on a credentialed response '
                             "the browser reads it as a header named *; list the headers")
        return self


class RedisConfig(StrictModel):
    url: str | None = None                # redis://host:6379/0; `--redis-url` overrides
    key_prefix: str = Field(default="heterogate:", min_length=1)   # every key this deployment writes
    refresh_ms: PositiveInt = Field(default=50, le=1000)    # one pipelined round trip per refresh
    replica_ttl_ms: PositiveInt = 600     # a replica's in-flight counts outlive its last refresh this long
    timeout_ms: PositiveInt = 250         # connect and read timeout of every Redis call
    spread: float = Field(default=0.05, ge=0, le=1)   # near-best tolerance of the spreading layer (relative)
    leader_lease_ms: PositiveInt = Field(default=3000, ge=300)   # managed engines' supervisor lease
    fail_open_hold_s: PositiveFloat = 60.0   # Redis down: backends last heard through it stay assumed alive
    # ... and past that hold, those that answer this replica's own checks (shared_state.py, direct_checks.py):
    # each checked at most once every `held_check_interval_s`, each check bounded by `held_check_timeout_s`;
    # `held_check_failures` checks in a row without an answer and it is no candidate here until Redis is back.
    held_check_interval_s: PositiveFloat = 1.0
    held_check_timeout_s: PositiveFloat = 0.5
    held_check_failures: PositiveInt = 2
    # Managed engines outlive a leader that dies (the next one adopts them); one that no replica has
    # heard for this long exits by itself.
    engine_orphan_s: PositiveFloat = 10.0
    # `P identities` and `P engines_port` expire this long after the last replica rewrote them: they must
    # outlive every replica by more than `engine_orphan_s` (engines that outlive them are found again
    # through both), and once no replica has run for this long they describe engines that have exited.
    engine_keys_ttl_s: PositiveFloat = 120.0
    # Cache-aware routing across replicas (shared_state.py): what each replica routed, one stream entry
    # per replica and refresh holding at most `prefix_batch_max` records (the oldest dropped first); the
    # stream keeps at most `prefix_stream_max` entries, and a refresh reads at most `prefix_read_max`.
    prefix_stream_max: PositiveInt = 256
    prefix_batch_max: PositiveInt = 2_000
    prefix_read_max: PositiveInt = 64
    # The stream expires this long after the last entry appended: an idle deployment's predictions of
    # the engines' caches are stale by then, and a stopped one's would otherwise stay in Redis for good.
    prefix_stream_ttl_s: PositiveFloat = 600.0

    @model_validator(mode="after")
    def _limits_agree(self) -> RedisConfig:
        if self.held_check_timeout_s > self.held_check_interval_s:
            raise ValueError(f"held_check_timeout_s ({self.held_check_timeout_s}) must not exceed "
                             f"held_check_interval_s ({self.held_check_interval_s}): one check per backend at a time")
        least_s = max(self.engine_orphan_s, 3 * self.leader_lease_ms / 1000)
        if self.engine_keys_ttl_s <= least_s:
            raise ValueError(f"engine_keys_ttl_s ({self.engine_keys_ttl_s}) must exceed engine_orphan_s and three "
                             f"leases ({least_s:g} s): engines that outlive their replicas are found again through "
                             "these keys")
        return self


def require_torch() -> None:
    """Config-time check, so a missing torch fails at start-up rather than on the first image."""
    if importlib.util.find_spec("torch") is None:
        raise ConfigError('image_embeds needs PyTorch: pip install -e ".[vllm-embeds]" (or torch==2.13.0)')
