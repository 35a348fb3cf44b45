"""OpenTelemetry tracing of the gateway and the engines, set up from the standard OTEL_* variables.

Off unless `OTEL_TRACES_EXPORTER` names an exporter (`otlp` or `console`; `none` is off too) or an OTLP
endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); `OTEL_SDK_DISABLED=true`
turns it off whatever else is set. Off, nothing of OpenTelemetry's tracing is imported and `setup()` is
None: the request path's only cost is checking for None. On, the sampler comes from `OTEL_TRACES_SAMPLER`
and `OTEL_TRACES_SAMPLER_ARG` (an unknown one is refused, not replaced), and the SDK (the `tracing` extra)
reads the rest of the standard variables itself: the resource (`OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`) and the OTLP/HTTP exporter's endpoint, headers and timeout. The batch
processor's queue and delays (`OTEL_BSP_*`) are read here, so that a bad one is a ConfigError naming it
(`check`, start-up and `gateway check-config`) and not the SDK's ValueError out of start-up.

At exit the spans still queued get `SHUTDOWN_S` to be exported, then are dropped: a collector that
accepts connections and never answers would otherwise hold the exit for the exporter's timeout
(`OTEL_EXPORTER_OTLP_TIMEOUT`, 10 s) and more, out of the drain's grace period.

The provider is the process's own, not OpenTelemetry's global one: libraries that trace through the
global provider (FastAPI's routes) stay silent. W3C `traceparent` strings are formatted here, not by a
propagator: one goes with every dispatch, and a format string is a fraction of the propagator's cost;
incoming ones are parsed by the API's propagator (validation included).
"""

from __future__ import annotations

import atexit
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import urlsplit

from common.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Tracer

_EXPORTERS = ("otlp", "console")
_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
# The batch processor's settings, in BatchSpanProcessor's order, with their defaults (the OpenTelemetry spec's)
_BATCH = (("OTEL_BSP_MAX_QUEUE_SIZE", 2048), ("OTEL_BSP_SCHEDULE_DELAY", 5000),
          ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), ("OTEL_BSP_EXPORT_TIMEOUT", 30000))
SHUTDOWN_S = 2.0   # what the spans queued at exit get to be exported


@dataclass(frozen=True, slots=True)
class TraceSetup:
    """What a process traces with: the SDK's tracer (spans made one at a time), and for a caller that
    records its spans itself (the gateway's request path, gateway/pipeline/tracing.py) the sampler, the
    resource and scope its spans carry, and the processors that export them."""

    tracer: Tracer
    sampler: Sampler
    resource: Resource
    scope: InstrumentationScope
    processors: tuple[SpanProcessor, ...]


def _not_installed(exc: ImportError) -> ConfigError:
    return ConfigError(f"tracing is configured (OTEL_*) but OpenTelemetry is not installed ({exc}); "
                       "pip install 'heterogate[tracing]'")


def exporters(env: Mapping[str, str] = os.environ) -> list[str]:
    """The trace exporters the environment asks for; empty: tracing is off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not named:
        return ["otlp"] if any(env.get(name) for name in _ENDPOINTS) else []
    if "none" in named:
        return []
    unknown = [n for n in named if n not in _EXPORTERS]
    if unknown:
        raise ConfigError(f"OTEL_TRACES_EXPORTER: unknown exporter(s) {', '.join(unknown)}; "
                          f"use {', '.join(_EXPORTERS)} or none")
    return named


def sampler(env: Mapping[str, str] = os.environ) -> Sampler:
    """The sampler `OTEL_TRACES_SAMPLER` names (default parentbased_always_on), with its ratio from
    `OTEL_TRACES_SAMPLER_ARG`."""
    try:
        from opentelemetry.sdk.trace import sampling
    except ImportError as exc:   # pragma: no cover - the extra is not installed
        raise _not_installed(exc) from None

    name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    fixed = {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
             "parentbased_always_on": sampling.DEFAULT_ON, "parentbased_always_off": sampling.DEFAULT_OFF}
    if name in fixed:
        return fixed[name]
    if name not in ("traceidratio", "parentbased_traceidratio"):
        raise ConfigError(f"OTEL_TRACES_SAMPLER: unknown sampler {name!r}; use one of "
                          f"{', '.join([*fixed, 'traceidratio', 'parentbased_traceidratio'])}")
    raw = env.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
    try:
        ratio = float(raw)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG: {raw!r} is not a ratio between 0 and 1")
    root = sampling.TraceIdRatioBased(ratio)
    return root if name == "traceidratio" else sampling.ParentBased(root)


def _positive(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{name}: {raw!r} is not a positive whole number")
    return value


class Batch(NamedTuple):
    """The batch processor's settings (`OTEL_BSP_*`), in BatchSpanProcessor's order."""

    max_queue_size: int
    schedule_delay_ms: int
    max_export_batch_size: int
    export_timeout_ms: int


def batch(env: Mapping[str, str] = os.environ) -> Batch:
    """The batch processor's settings (`OTEL_BSP_*`); ConfigError naming the variable for one the SDK
    would refuse with a ValueError out of start-up (or, not a number, log and replace)."""
    settings = Batch(*(_positive(env, name, default) for name, default in _BATCH))
    if settings.max_export_batch_size > settings.max_queue_size:
        raise ConfigError(f"OTEL_BSP_MAX_EXPORT_BATCH_SIZE: {settings.max_export_batch_size} is larger than "
                          f"the queue (OTEL_BSP_MAX_QUEUE_SIZE, {settings.max_queue_size})")
    return settings


# The OTLP exporter's endpoint variables (the traces' own first: it wins) and its timeouts (seconds, as the
# SDK reads them)
_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_TIMEOUTS = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")


def _given(env: Mapping[str, str], names: Iterable[str]) -> Iterator[tuple[str, str]]:
    """(name, value) of each of these variables that is set to more than blanks."""
    for name in names:
        if raw := env.get(name, "").strip():
            yield name, raw


def otlp_target(env: Mapping[str, str] = os.environ) -> None:
    """ConfigError naming the variable where the OTLP exporter's endpoint is no http(s) URL with a host,
    or its timeout no positive number: the SDK takes either, then fails every export (or warns and uses
    its default), so a typo lost every trace with the gateway running as if all were well."""
    for name, raw in _given(env, _ENDPOINTS):
        try:
            url = urlsplit(raw)
            port_ok = url.port is None or url.port > 0
        except ValueError:
            port_ok = False
        if not (port_ok and url.scheme in ("http", "https") and url.hostname):
            raise ConfigError(f"{name}: {raw!r} is not an http(s) URL with a host (e.g. http://collector:4318)")
    for name, raw in _given(env, _TIMEOUTS):
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0.0 < value < float("inf"):
            raise ConfigError(f"{name}: {raw!r} is not a positive number of seconds")


def check(env: Mapping[str, str] = os.environ) -> list[str]:
    """The exporters the environment asks for, once its exporters, OTLP protocol, sampler and batch
    processor are known to be ones this process can use (ConfigError naming the variable); start-up checks
    this first."""
    names = exporters(env)
    if not names:
        return names
    variable = next((p for p in _PROTOCOLS if env.get(p)), None)
    protocol = env[variable].strip().lower() if variable else "http/protobuf"   # HTTP/PROTOBUF too
    if "otlp" in names and protocol != "http/protobuf":
        raise ConfigError(f"{variable}: {protocol!r}; traces are exported over http/protobuf only")
    if "otlp" in names:
        otlp_target(env)
    sampler(env)
    batch(env)
    return names


def _shut_down(provider: TracerProvider, timeout_s: float) -> None:
    """Export what is queued, for at most `timeout_s`: the SDK's own shutdown waits out the exporter's
    timeout (and its retries) on a collector that never answers. Its threads are daemons: left behind."""
    worker = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)


def setup(scope: str, service: str, env: Mapping[str, str] = os.environ) -> TraceSetup | None:
    """This process's tracing as the environment says; None when it is off. `service`: the service name
    unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES give one."""
    names = check(env)
    if not names:
        return None
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    except ImportError as exc:   # pragma: no cover - the extra is not installed
        raise _not_installed(exc) from None
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    chosen, settings = sampler(env), batch(env)
    provider = TracerProvider(sampler=chosen, resource=resource, shutdown_on_exit=False)
    atexit.register(_shut_down, provider, SHUTDOWN_S)   # at exit what is queued is exported, for SHUTDOWN_S
    processors = []
    for name in names:
        exporter: SpanExporter
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter()
        processors.append(BatchSpanProcessor(exporter, *settings))
        provider.add_span_processor(processors[-1])
    return TraceSetup(provider.get_tracer(scope), chosen, resource, InstrumentationScope(scope), tuple(processors))


# A W3C traceparent of version 00, and the longest tracestate passed on (the spec's 512 characters): what a
# gateway that traces nothing forwards as its client sent it, and nothing else
_TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_MAX_TRACESTATE = 512


def tracestate(state: str | None) -> str:
    """The client's tracestate to pass on: as sent, or "" for none or one too long (the spec lets a hop drop it)."""
    return state if state is not None and len(state) <= _MAX_TRACESTATE else ""


def pass_through(header: str, state: str | None) -> tuple[str, str] | None:
    """The client's traceparent and tracestate to pass on as they are (tracing off), or None for a
    traceparent that is no W3C one (a tracestate too long is dropped, as the spec lets a hop do)."""
    if _TRACEPARENT.fullmatch(header) is None or header[3:35] == "0" * 32 or header[36:52] == "0" * 16:
        return None
    return header, tracestate(state)


def traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    """The W3C `traceparent` header naming span `span_id` of trace `trace_id` as the callee's parent, with
    its sampled flag: an unsampled request passes its trace on too, so the callee's logs and its own
    sampler see the same trace as the gateway's."""
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def parent(header: str | None) -> Context | None:
    """The remote parent a W3C `traceparent` header names; None when there is none or it is malformed."""
    if not header:
        return None
    from opentelemetry.trace import get_current_span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract({"traceparent": header})
    return context if get_current_span(context).get_span_context().is_valid else None
