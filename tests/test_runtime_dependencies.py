"""The gateway, the engines and the shared package run without what only the benchmarks use, and without a
web framework: the gateway's own HTTP server serves every route (gateway/doors/route_table.py)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_ONLY = {"aiohttp", "granian"}
FRAMEWORKS = {"fastapi", "starlette", "uvicorn"}   # uvicorn: only the tests' fake upstream and the benchmarks


def imported_top_levels(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.partition(".")[0])
    return names


def runtime_imports(names: set[str]) -> list[str]:
    return [f"{path.relative_to(ROOT)}: {sorted(found)}"
            for package in ("gateway", "backends", "common") for path in sorted((ROOT / package).rglob("*.py"))
            if (found := imported_top_levels(path) & names)]


def requirement_names(requirements: list[str]) -> set[str]:
    return {r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip() for r in requirements}


def test_no_runtime_package_imports_a_benchmark_only_dependency() -> None:
    assert runtime_imports(BENCH_ONLY) == []


def test_benchmark_only_dependencies_are_in_the_bench_extra_not_the_runtime() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert requirement_names(project["dependencies"]) & BENCH_ONLY == set()
    assert BENCH_ONLY <= requirement_names(project["optional-dependencies"]["bench"])


def test_no_web_framework_is_imported_or_required_at_runtime() -> None:
    assert runtime_imports(FRAMEWORKS) == []
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert requirement_names(project["dependencies"]) & FRAMEWORKS == set()
