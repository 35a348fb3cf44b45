"""What start-up (and `gateway check-config`) checks of `gateway.autoscaling` against the backends file: a
monolithic plan's `both` engines are the language pool's template, a `min` beyond the engines and the
inventory is refused naming min, durations are finite and bounded, export mode refuses the settings only
manage mode reads, and a catalog's YAML error is one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from common.errors import ConfigError
from gateway.config.autoscaling import MIN_INTERVAL_S
from gateway.config.cluster import load_cluster
from testkit.harness import ROOT, write_config

pytestmark = pytest.mark.timeout(60)

MONOLITHIC = [{"id": f"rtx-4090-{k}", "role": "both", "gpu": "RTX-4090", "launch": {"time_scale": 1.0}}
              for k in range(2)]   # what `gateway plan` writes for a monolithic plan


def cluster(tmp: Path, autoscaling: dict[str, Any], backends: list[dict[str, Any]] | None = None,
            **top: Any) -> Path:
    return write_config(tmp, {"model": "llava-1.5-7b", **top, "backends": backends or MONOLITHIC,
                              "gateway": {"autoscaling": autoscaling}})


def manage(**language: Any) -> dict[str, Any]:
    return {"mode": "manage", "pools": {"language": {"min": 1, "max": 4, "gpus": ["RTX-4090"], **language}}}


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "check-config", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_a_monolithic_plan_is_autoscaled_by_copies_of_its_both_engines(tmp_path: Path) -> None:
    done = check_config(cluster(tmp_path, manage()))
    assert done.returncode == 0, done.stderr
    load_cluster(cluster(tmp_path, manage(template="rtx-4090-1")))
    # a `both` engine is of the language pool only: the vision pool's template must encode and nothing else
    with pytest.raises(ConfigError, match=r"pools.vision.template: manage mode needs .* role vision"):
        load_cluster(cluster(tmp_path, {"mode": "manage", "pools": {"vision": {"max": 2, "gpus": ["L4"]}}}))


def test_a_min_the_engines_and_the_inventory_cannot_reach_is_refused_naming_min(tmp_path: Path) -> None:
    one = [{"id": "h100-0", "gpu": "H100", "launch": {}}]
    pool = {"mode": "manage", "pools": {"language": {"min": 3, "max": 4, "gpus": ["H100"]}}}
    done = check_config(cluster(tmp_path, pool, one))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert ("gateway.autoscaling.pools.language.min: min 3 cannot be reached: 1 engine(s) of the pool in "
            "`backends:` and 1 GPU(s) in its `gpus:` inventory make at most 2") in done.stderr
    pool["pools"]["language"]["gpus"] = ["H100", "H100"]   # type: ignore[index]
    load_cluster(cluster(tmp_path, pool, one))


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("interval_s", float("inf"), "interval_s: Input should be a finite number"),
    ("interval_s", 1e-9, f"interval_s: Input should be greater than or equal to {MIN_INTERVAL_S}"),
    ("up_delay_s", float("inf"), "up_delay_s: Input should be a finite number"),
    ("down_delay_s", float("nan"), "down_delay_s: Input should be"),
    ("lookahead_s", 1e9, "lookahead_s: Input should be less than or equal to"),
])
def test_durations_are_finite_and_bounded(tmp_path: Path, setting: str, value: float, message: str) -> None:
    with pytest.raises(ConfigError, match=f"gateway.autoscaling.{message}"):
        load_cluster(cluster(tmp_path, {**manage(), setting: value}))


def test_a_language_mark_is_finite(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"pools.language.queue_per_engine: Input should be a finite number"):
        load_cluster(cluster(tmp_path, manage(queue_per_engine=float("inf"))))


@pytest.mark.parametrize(("extra", "named"), [
    ({"gpus": ["H999"]}, "gpus"), ({"template": "nosuch"}, "template"),
    ({"gpus": ["H100"], "template": "rtx-4090-0"}, "gpus and template"),
])
def test_export_mode_refuses_what_only_manage_mode_reads(tmp_path: Path, extra: dict[str, Any], named: str) -> None:
    exported = {"mode": "export", "pools": {"language": {"min": 1, "max": 4, **extra}}}
    done = check_config(cluster(tmp_path, exported))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (f"gateway.autoscaling: Value error, pools.language: {named} would be ignored: mode export starts "
            "no engines") in done.stderr
    load_cluster(cluster(tmp_path, {"mode": "export", "pools": {"language": {"min": 1, "max": 4}}}))


def test_a_catalog_with_broken_yaml_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "catalog"
    folder.mkdir()
    (folder / "models.yaml").write_text((ROOT / "configs" / "models.yaml").read_text())
    (folder / "gpus.yaml").write_text("gpus: [unclosed\n")
    done = check_config(cluster(tmp_path, {"mode": "off"}, catalog="catalog"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[1:] == [
        f"{folder / 'gpus.yaml'}: not valid YAML: line 2, column 1: expected ',' or ']', but got '<stream end>' "
        "(while parsing a flow sequence at line 1, column 7)"]
