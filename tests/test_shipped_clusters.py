"""`--backends NAME`: the clusters the package ships (package data in common/configs) by name, from any
directory, so a wheel's user can run them without a checkout; unknown names are refused with the list."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from pathlib import Path

from common.catalog import CONFIG_DIR
from gateway.config.cluster import shipped_clusters
from tests.test_check_config_parity import REPO, finish, start_cli

SHIPPED = ("backends", "external-vllm", "tiny-real")


def test_shipped_clusters_are_package_data() -> None:
    names = shipped_clusters()
    assert set(SHIPPED) <= set(names) and not {"gpus", "models"} & set(names)   # catalogs are no clusters
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["common"]
    for path in names.values():
        assert any(fnmatch(str(path.relative_to(CONFIG_DIR.parent)), p) for p in patterns), path


def test_a_shipped_cluster_by_name_from_outside_the_checkout(tmp_path: Path) -> None:
    for name in ("tiny-real", "backends.yaml"):
        result = finish(start_cli("check-config", name, cwd=tmp_path))
        assert result.returncode == 0, result.stderr
        assert f"{CONFIG_DIR / name.removesuffix('.yaml')}.yaml: OK" in result.stdout


def test_unknown_names_are_refused_with_the_shipped_ones_and_help_lists_them(tmp_path: Path) -> None:
    for args in (("--backends", "no-such-cluster"), ("check-config", "--backends", "configs/tiny-real.yaml")):
        result = finish(start_cli(*args, cwd=tmp_path))   # a path with folders means that file, here absent
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert "no such file, and not the name of a shipped cluster" in result.stderr
        assert all(name in result.stderr for name in SHIPPED), result.stderr
    help_text = finish(start_cli("--help", env={"COLUMNS": "300"})).stdout   # argparse wraps at hyphens
    assert all(name in help_text for name in SHIPPED)
