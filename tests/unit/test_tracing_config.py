"""Tracing is set up from the standard OTEL_* variables (common/tracing.py): off unless an exporter or an
OTLP endpoint is named, and off means the gateway and the engine never import OpenTelemetry's tracing SDK."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import ConfigError
from common.tracing import check, exporters, parent, sampler, setup
from testkit.harness import write_config


@pytest.mark.parametrize(("env", "expected"), [
    ({}, []),
    ({"OTEL_TRACES_EXPORTER": "none"}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console, otlp"}, ["console", "otlp"]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
])
def test_the_exporters_come_from_the_environment(env: dict[str, str], expected: list[str]) -> None:
    assert exporters(env) == expected


def test_an_unknown_exporter_or_protocol_is_refused_with_its_name() -> None:
    with pytest.raises(ConfigError, match="jaeger"):
        exporters({"OTEL_TRACES_EXPORTER": "jaeger"})
    with pytest.raises(ConfigError, match=r"^OTEL_EXPORTER_OTLP_PROTOCOL: 'grpc'"):
        setup("t", "s", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    with pytest.raises(ConfigError, match=r"^OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: 'grpc'"):   # the one in effect
        setup("t", "s", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                         "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert check({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "HTTP/Protobuf "}) == ["otlp"]


@pytest.mark.parametrize(("env", "message"), [
    # each was taken: then every export failed ("Invalid URL ... No scheme supplied"), or the SDK warned
    # and waited its default, with the gateway running as if all were well
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "not-a-url"}, "OTEL_EXPORTER_OTLP_ENDPOINT: 'not-a-url' is not an http(s) URL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT: 'collector:4318' is not"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: 'http://' is not"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:99999"}, "'http://h:99999' is not"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TIMEOUT": "abc"},
     "OTEL_EXPORTER_OTLP_TIMEOUT: 'abc' is not a positive number of seconds"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "0"}, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"),
])
def test_an_otlp_endpoint_or_timeout_the_exporter_cannot_use_is_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check(env)
    assert str(refused.value).startswith(message) or message in str(refused.value)
    ok = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector.example:4318", "OTEL_EXPORTER_OTLP_TIMEOUT": "2.5"}
    assert check(ok) == ["otlp"]
    assert check({"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_ENDPOINT": "not-a-url"}) == ["console"]


def test_the_sampler_comes_from_the_environment_and_a_bad_one_is_refused() -> None:
    assert sampler({}).get_description().startswith("ParentBased{root:AlwaysOnSampler")
    assert "0.25" in sampler({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                              "OTEL_TRACES_SAMPLER_ARG": "0.25"}).get_description()
    with pytest.raises(ConfigError, match="OTEL_TRACES_SAMPLER"):
        sampler({"OTEL_TRACES_SAMPLER": "sometimes"})
    with pytest.raises(ConfigError, match="OTEL_TRACES_SAMPLER_ARG"):
        sampler({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"})


def test_the_service_name_defaults_to_the_process_kind_unless_the_environment_names_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    default = setup("t", "heterogate-gateway", {"OTEL_TRACES_EXPORTER": "console"})
    assert default is not None and default.resource.attributes["service.name"] == "heterogate-gateway"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gw-eu-1")
    named = setup("t", "heterogate-gateway", {"OTEL_TRACES_EXPORTER": "console"})
    assert named is not None and named.resource.attributes["service.name"] == "gw-eu-1"


def test_a_malformed_traceparent_is_no_parent() -> None:
    assert parent(None) is None
    assert parent("00-zz-1-01") is None
    assert parent("00-00000000000000000000000000000000-b7ad6b7169203331-01") is None
    assert parent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01") is not None


def test_with_tracing_off_the_sdk_is_never_imported() -> None:
    """The gateway and the engine without OTEL_* variables: no tracer, and neither the SDK's tracing nor an
    exporter in sys.modules (redis imports the SDK's metrics on its own when OpenTelemetry is installed)."""
    code = """
import sys
from backends.engine_tracing import EngineTracing
from gateway.pipeline.tracing import Tracing
import gateway.daemon, backends.engine
assert Tracing.from_env() is None and EngineTracing.from_env("x") is None
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter"))))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_check_config_refuses_a_bad_tracing_variable_by_name(tmp_path: Path) -> None:
    """What start-up checks (`gateway check-config` runs the same): exit 2 and the variable, no traceback."""
    config = write_config(tmp_path, {"model": "llava-1.5-7b", "backends": [
        {"id": "up0", "kind": "openai", "role": "language", "gpu": "H100", "address": "http://127.0.0.1:9"}]})
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
           "OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "sometimes"}
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "check-config", "--backends", str(config)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "OTEL_TRACES_SAMPLER" in out.stderr and "Traceback" not in out.stderr
