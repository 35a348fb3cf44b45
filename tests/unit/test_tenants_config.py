"""gateway.tenants: keys map to tenants (read as gateway.auth's keys are), and every invalid tenant
configuration stops start-up with an error naming the setting; `gateway check-config` says the same."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from common.errors import ConfigError
from gateway.config.auth import AuthConfig, KeyRing
from gateway.config.cluster import load_cluster
from gateway.config.tenants import TenantsConfig
from gateway.requests.errors import Forbidden, Unauthorized
from testkit.harness import ROOT, write_config


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The console script, with no HG_TEST_* variable but `env`'s."""
    exe = shutil.which("gateway", path=str(Path(sys.executable).parent))
    assert exe is not None
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HG_TEST_")}
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**environ, **(env or {})})


def tenants(**config: Any) -> TenantsConfig:
    return TenantsConfig.model_validate(config)


def test_keys_name_their_tenant_and_others_are_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "search.keys").write_text("# search team\nsk-search-1\nsk-search-2\n")
    monkeypatch.setenv("HG_TEST_BATCH_KEYS", "sk-batch")
    monkeypatch.setenv("HG_TEST_PLAIN", "sk-plain")
    ring = KeyRing.load(AuthConfig(api_keys_env="HG_TEST_PLAIN"), tenants(teams={
        "search": {"api_keys_file": str(tmp_path / "search.keys"), "weight": 3},
        "batch": {"api_keys_env": "HG_TEST_BATCH_KEYS", "priority": -1}}))
    assert ring.check("Bearer sk-search-2", admin=False) == "search"
    assert ring.check("Bearer sk-batch", admin=False) == "batch"
    assert ring.check("Bearer sk-plain", admin=False) == "default"
    with pytest.raises(Unauthorized):
        ring.check("Bearer sk-other", admin=False)
    with pytest.raises(Forbidden, match="admin"):   # a tenant's key is no admin key
        ring.check("Bearer sk-search-1", admin=True)


def test_a_key_repeated_in_its_own_tenants_list_is_that_tenants(tmp_path: Path) -> None:
    """It stopped start-up as "one of its keys is also tenant 'beta''s", the tenant itself."""
    (tmp_path / "beta.keys").write_text("sk-beta-1\nsk-beta-2\nsk-beta-1\n")
    ring = KeyRing.load(AuthConfig(), tenants(teams={"beta": {"api_keys_file": str(tmp_path / "beta.keys")}}))
    assert ring.check("Bearer sk-beta-1", admin=False) == "beta"


def test_tenant_keys_alone_turn_keys_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HG_TEST_KEYS", "sk-a")
    ring = KeyRing.load(AuthConfig(), tenants(teams={"a": {"api_keys_env": "HG_TEST_KEYS"}}))
    assert ring.enabled
    with pytest.raises(Unauthorized):
        ring.check(None, admin=False)
    assert KeyRing.load(AuthConfig(), TenantsConfig()).check(None, admin=False) == "default"


@pytest.mark.parametrize(("teams", "auth", "message"), [
    ({"a": {"api_keys_env": "HG_TEST_A"}, "b": {"api_keys_env": "HG_TEST_SAME"}}, {},
     r"gateway\.tenants\.teams\.b: one of its keys is also a key of tenant 'a';"),
    ({"a": {"api_keys_env": "HG_TEST_A"}}, {"api_keys_env": "HG_TEST_A"},
     r"gateway\.tenants\.teams\.a: one of its keys is also a key of gateway\.auth\.api_keys;"),
    ({"a": {"api_keys_env": "HG_TEST_UNSET"}}, {},
     r"gateway\.tenants\.teams\.a\.api_keys_env: environment variable HG_TEST_UNSET is not set"),
    ({"a": {"api_keys_env": "HG_TEST_COMMAS"}}, {},
     r"gateway\.tenants\.teams\.a\.api_keys_env: environment variable HG_TEST_COMMAS holds no keys"),
])
def test_key_conflicts_and_missing_keys_are_config_errors(
        monkeypatch: pytest.MonkeyPatch, teams: dict[str, Any], auth: dict[str, Any], message: str) -> None:
    monkeypatch.setenv("HG_TEST_A", "sk-a")
    monkeypatch.setenv("HG_TEST_SAME", "sk-b,sk-a")
    monkeypatch.setenv("HG_TEST_COMMAS", " , ")
    monkeypatch.delenv("HG_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError, match=message):
        KeyRing.load(AuthConfig.model_validate(auth), tenants(teams=teams))


BAD_TENANTS = [
    pytest.param({"teams": {"default": {"api_keys_env": "X"}}}, "'default' is the tenant of keys that name none",
                 id="default-named"),
    pytest.param({"teams": {"a": {"weight": 2}}}, "tenant 'a' has no api_keys_file or api_keys_env", id="no-keys"),
    pytest.param({"teams": {"a b": {"api_keys_env": "X"}}}, "tenant name 'a b'", id="bad-name"),
    pytest.param({"teams": {"a": {"api_keys_env": "X", "weight": 0}}}, "teams.a.weight: Input should be greater "
                 "than or equal to 0.001", id="zero-weight"),
    pytest.param({"teams": {"a": {"api_keys_env": "X", "weight": float("inf")}}}, "teams.a.weight: Input should be "
                 "a finite number", id="infinite-weight"),   # its tag never advanced: its class starved
    pytest.param({"teams": {"a": {"api_keys_env": "X", "weight": 1e-320}}}, "teams.a.weight: Input should be "
                 "greater than or equal to 0.001", id="denormal-weight"),   # its tags overflowed to inf, then NaN
    pytest.param({"teams": {"a": {"api_keys_env": "X", "requests_per_minute": 10**23}}}, "teams.a.requests_per_minute: "
                 "Input should be less than or equal to 9007199254740992", id="limit-past-2^53"),   # /admin/usage: 500
    pytest.param({"default": {"priority": 10**23}}, "default.priority: Input should be less than 2147483648",
                 id="priority-past-32-bits"),
    pytest.param({"default": {"requests_per_minute": 0}}, "default.requests_per_minute: Input should be greater than 0",
                 id="zero-limit"),
    pytest.param({"teams": {"a": {"api_keys_env": "X", "api_key": "sk-inline"}}}, "teams.a.api_key: Extra inputs",
                 id="inline-secret"),
    pytest.param({"on_redis_error": "maybe"}, "on_redis_error: Input should be 'open' or 'closed'", id="fail-mode"),
    pytest.param({"default": {"requests_per_minute": True}}, "default.requests_per_minute: Input should be a valid "
                 "integer", id="boolean-limit"),   # YAML's `true` / `yes` / `on` was a limit of 1
    pytest.param({"default": {"tokens_per_minute": "500"}}, "default.tokens_per_minute: Input should be a valid "
                 "integer", id="string-limit"),
]


def cluster(tmp: Path, tenants_section: dict[str, Any]) -> Path:
    return write_config(tmp, {"model": "llava-1.5-7b", "gateway": {"tenants": tenants_section},
                              "backends": [{"id": "h100-0", "gpu": "H100", "launch": {"time_scale": 0.1}}]})


@pytest.mark.parametrize(("section", "message"), BAD_TENANTS)
def test_invalid_tenants_are_refused_naming_the_setting(tmp_path: Path, section: dict[str, Any], message: str) -> None:
    path = cluster(tmp_path, section)
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert f"{path}: gateway.tenants." in str(err.value) and message in str(err.value)


@pytest.mark.timeout(120)
def test_check_config_refuses_what_start_up_refuses(tmp_path: Path) -> None:
    """The console script: a schema error and a key error (read at start-up, not by the schema)."""
    bad = cluster(tmp_path, {"teams": {"a": {"weight": 2}}})
    result = run_cli("check-config", str(bad))
    assert result.returncode == 2 and "tenant 'a' has no api_keys_file or api_keys_env" in result.stderr
    keys = cluster(tmp_path, {"teams": {"a": {"api_keys_env": "HG_TEST_TENANT_KEYS"}}})
    result = run_cli("check-config", str(keys))
    assert result.returncode == 2
    assert "gateway.tenants.teams.a.api_keys_env: environment variable HG_TEST_TENANT_KEYS is not set" in result.stderr
    (tmp_path / "token").write_text("cluster-secret\n")   # keys on: the control port needs its token
    ok = write_config(tmp_path, {"model": "llava-1.5-7b", "gateway": {
        "auth": {"cluster_token_file": str(tmp_path / "token")},
        "tenants": {"teams": {"a": {"api_keys_env": "HG_TEST_TENANT_KEYS", "tokens_per_minute": 1000}}}},
        "backends": [{"id": "h100-0", "gpu": "H100", "launch": {"time_scale": 0.1}}]})
    result = run_cli("check-config", str(ok), env={"HG_TEST_TENANT_KEYS": "sk-a"})
    assert result.returncode == 0, result.stderr


def test_a_backend_kept_for_a_class_no_tenant_has_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HG_TEST_KEYS", "sk-a")
    teams = {"teams": {"a": {"api_keys_env": "HG_TEST_KEYS", "priority": 1}}}
    backends = [{"id": "h100-0", "gpu": "H100", "launch": {"time_scale": 0.1}},
                {"id": "h100-1", "gpu": "H100", "launch": {"time_scale": 0.1}, "min_priority": 2}]
    path = write_config(tmp_path, {"model": "llava-1.5-7b", "gateway": {"tenants": teams}, "backends": backends})
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert "backends.1 (h100-1).min_priority: 2 is above every tenant's priority class (the highest is 1)" in str(
        err.value)
    backends[1]["min_priority"] = 1   # tenant a's class: fine
    load_cluster(write_config(tmp_path, {"model": "llava-1.5-7b", "gateway": {"tenants": teams}, "backends": backends}))
