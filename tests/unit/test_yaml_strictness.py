"""backends.yaml (and the catalogs) are parsed strictly, as README says, beyond unknown keys: a key written
twice is refused naming both lines (PyYAML kept the last one silently), a YAML syntax error is one line
naming the file, an empty or comment-only file or a top-level list is said plainly (not as `instance of
ClusterFile`), and `.inf` or `.nan` in any float is refused as not finite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.catalog import load_catalog
from common.errors import ConfigError
from gateway.config.cluster import load_cluster
from testkit.harness import ROOT
from tests.config_files import config_error, write
from tests.snapshots import catalog

pytestmark = pytest.mark.timeout(60)

BACKEND = "backends:\n  - {id: h100-0, role: language, gpu: H100, launch: {}}\n"


def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "gateway:\n  heartbeat_interval_ms: 200\n  heartbeat_interval_ms: 300\n" + BACKEND)
    assert config_error(path) == (f"{path}: not valid YAML: line 4, column 3: duplicate key "
                                  "'heartbeat_interval_ms' (first at line 3)")


def test_a_nested_key_written_twice_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "gateway:\n  limits:\n    request_timeout_s: 60\n    max_tokens: 512\n"
                           "    request_timeout_s: 600\n" + BACKEND)
    assert config_error(path) == (f"{path}: not valid YAML: line 6, column 5: duplicate key "
                                  "'request_timeout_s' (first at line 4)")


def test_a_key_written_twice_in_a_flow_mapping_is_refused_one_over_a_merge_is_not(tmp_path: Path) -> None:
    merged = "backends:\n  - &h100 {id: h100-0, role: language, gpu: H100, launch: {}}\n  - {<<: *h100, id: h100-1}\n"
    assert [b.id for b in load_cluster(write(tmp_path, merged), catalog()).raw.backends] == ["h100-0", "h100-1"]
    path = write(tmp_path, merged + "  - {id: h100-2, role: language, gpu: H100, id: h100-3, launch: {}}\n")
    assert config_error(path) == f"{path}: not valid YAML: line 5, column 45: duplicate key 'id' (first at line 5)"


def test_a_syntax_error_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "gateway: [1, 2\n" + BACKEND)
    assert config_error(path) == (f"{path}: not valid YAML: line 3, column 9: expected ',' or ']', but got ':' "
                                  "(while parsing a flow sequence at line 2, column 10)")


@pytest.mark.parametrize("body", ["", "\n\n", "# the demo cluster, to be written\n# model: llava-1.5-7b\n"],
                         ids=["empty", "blank-lines", "comments-only"])
def test_an_empty_file_is_said_to_be_empty(tmp_path: Path, body: str) -> None:
    path = tmp_path / "backends.yaml"
    path.write_text(body)
    assert config_error(path) == f"{path}: the file is empty (no keys, at most comments)"


@pytest.mark.parametrize(("body", "kind"), [("- model: llava-1.5-7b\n- backends: []\n", "a list"),
                                            ("llava-1.5-7b\n", "a string")], ids=["list", "string"])
def test_a_top_level_that_is_no_mapping_is_said_plainly(tmp_path: Path, body: str, kind: str) -> None:
    path = tmp_path / "backends.yaml"
    path.write_text(body)
    assert config_error(path) == f"{path}: expected a mapping of keys at the top level, got {kind}"


@pytest.mark.parametrize(("body", "where"), [
    ("gateway:\n  drain_timeout_s: .inf\n", "gateway.drain_timeout_s"),
    ("gateway:\n  limits: {request_timeout_s: .inf}\n", "gateway.limits.request_timeout_s"),
    ("gateway:\n  limits: {first_token_timeout_s: -.Inf}\n", "gateway.limits.first_token_timeout_s"),
    ("gateway:\n  drain_timeout_s: .nan\n", "gateway.drain_timeout_s"),
], ids=["inf", "nested-inf", "minus-inf", "nan"])
def test_an_infinite_or_nan_float_is_refused(tmp_path: Path, body: str, where: str) -> None:
    path = write(tmp_path, body + BACKEND)
    assert config_error(path) == f"{path}: {where}: Input should be a finite number"


@pytest.mark.parametrize(("body", "where", "read"), [
    ("gateway:\n  overload: {ttft_slo_s: no}\n", "gateway.overload.ttft_slo_s", "false"),
    ("gateway:\n  overload: {max_queued: off}\n", "gateway.overload.max_queued", "false"),
    ("gateway:\n  limits: {max_tokens: yes}\n", "gateway.limits.max_tokens", "true"),
], ids=["float", "int", "limit"])
def test_a_boolean_where_a_number_belongs_is_refused(tmp_path: Path, body: str, where: str, read: str) -> None:
    path = write(tmp_path, body + BACKEND)   # pydantic took them as 0 and 1: a 0 s SLO, a 1-token limit
    assert config_error(path) == (f"{path}: {where}: a number, not {read} (YAML reads yes/no/on/off as "
                                  "true/false)")


@pytest.mark.parametrize(("launch", "where"), [
    ("{time_scale: fast}", "launch.time_scale: Input should be a valid number"),
    ('{command: "serve {port}", porta: 3}', "launch.porta: Extra inputs are not permitted"),
    ("5", "launch: Input should be a valid dictionary"),
], ids=["engine", "command", "no-mapping"])
def test_an_error_in_launch_names_the_key_as_written(tmp_path: Path, launch: str, where: str) -> None:
    """`launch` is one of two kinds (an engine the gateway runs, or a command): the error's path named
    the kind as if it were a key (`launch.engine.time_scale`, where the file has `launch.time_scale`)."""
    path = write(tmp_path, f"backends:\n  - {{id: h100-0, role: language, gpu: H100, launch: {launch}}}\n")
    assert config_error(path).startswith(f"{path}: backends.0 (h100-0).{where}")


def test_booleans_stay_booleans_and_numbers_numbers(tmp_path: Path) -> None:
    path = write(tmp_path, "gateway:\n  overload: {enabled: off, protect_itl: yes, ttft_slo_s: 3, max_queued: 8}\n"
                 + BACKEND)
    overload = load_cluster(path).settings.overload
    assert (overload.enabled, overload.protect_itl, overload.ttft_slo_s, overload.max_queued) == (False, True, 3.0, 8)


def test_a_catalog_with_a_nan_price_is_refused(tmp_path: Path) -> None:
    (tmp_path / "models.yaml").write_text((ROOT / "configs" / "models.yaml").read_text())
    gpus = (ROOT / "configs" / "gpus.yaml").read_text()
    (tmp_path / "gpus.yaml").write_text(gpus + "\nX1:\n  {tflops: 1, bandwidth_gbs: 1, hbm_gb: 1, price_per_hour: 1, "
                                               "purchase_usd: .nan}\n")
    with pytest.raises(ConfigError, match=r"gpus\.yaml: X1\.purchase_usd: Input should be a finite number$"):
        load_catalog(tmp_path)


@pytest.mark.parametrize(("body", "message"), [
    ("model: llava-1.5-7b\nmodel: llava-1.5-7b\n" + BACKEND, "not valid YAML: line 2, column 1: duplicate key "
                                                            "'model' (first at line 1)"),
    ("", "the file is empty (no keys, at most comments)"),
    ("model: llava-1.5-7b\ngateway: {drain_timeout_s: .inf}\n" + BACKEND,
     "gateway.drain_timeout_s: Input should be a finite number"),
], ids=["duplicate-key", "empty", "inf"])
def test_check_config_says_it_in_one_line(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "backends.yaml"
    path.write_text(body)
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "check-config", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == ["gateway: invalid configuration", f"{path}: {message}"]
