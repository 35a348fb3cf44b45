"""Every repository path, module and config key that README.md and docs/*.md name exists.

Files move (the gateway's rooms, `common/`), and a doc that names a path or module that is gone sends a
reader nowhere. What is checked, in prose, backticks and code blocks alike:

- paths with a slash that end in a file extension or in `/` (a folder): they must exist relative to the
  repository root or to the doc's own folder, or be a path git ignores (made at run time, such as
  `benchmarks/.peers-venv` or a results folder);
- a folder of one segment, backticked (`tests/`) or starting a line of a layout listing;
- dotted names starting with one of the repository's packages (`gateway.control.process_guard`,
  `common.perf_model`, `backends.batcher.ContinuousBatcher`): a module or package, optionally followed by
  names that the module's source defines or mentions; or, under `gateway.`, a key of the `gateway:` section
  of backends.yaml (`gateway.limits.max_attempts`), checked against its schema.
"""

from __future__ import annotations

import re
import subprocess
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from gateway.config.cluster import GatewaySettings

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
PACKAGES = ("gateway", "common", "backends", "loadtest", "tests", "benchmarks")
EXTENSIONS = (".py", ".yaml", ".yml", ".md", ".proto", ".toml", ".json", ".csv", ".png", ".txt", ".sh")

# A path: segments of word characters, dots and dashes joined by slashes, not part of a URL or an absolute
# path (nothing of a path or a scheme right before it).
PATH = re.compile(r"(?<![\w./:~-])([\w.-]+(?:/[\w.-]+)+/?|[\w.-]+/(?![\w.-]))")
BACKTICKED_FOLDER = re.compile(r"`([\w.-]+/)`")
LISTED_FOLDER = re.compile(r"^([\w.-]+/) ", re.MULTILINE)     # a layout listing: `tests/    unit tests, ...`
DOTTED = re.compile(r"(?<![\w./-])((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)")


def _is_path(token: str) -> bool:
    return token.endswith("/") or token.endswith(EXTENSIONS)


def named_paths(text: str) -> set[str]:
    found = {m.group(1) for m in PATH.finditer(text) if "/" in m.group(1).rstrip("/") and _is_path(m.group(1))}
    return found | {m.group(1) for pattern in (BACKTICKED_FOLDER, LISTED_FOLDER) for m in pattern.finditer(text)}


def named_dotted(text: str) -> set[str]:
    return {m.group(1) for m in DOTTED.finditer(text) if not m.group(1).endswith(EXTENSIONS)}


def _git_ignored(paths: list[str]) -> set[str]:
    if not paths:
        return set()
    run = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(paths),
                         capture_output=True, text=True, timeout=30)
    assert run.returncode in (0, 1), run.stderr
    return set(run.stdout.split())


def missing_paths(doc: Path, text: str) -> list[str]:
    absent = sorted(p for p in named_paths(text) if not (ROOT / p).exists() and not (doc.parent / p).exists())
    ignored = _git_ignored(absent)
    return [p for p in absent if p not in ignored]


def _module_and_rest(name: str) -> tuple[Path | None, list[str]]:
    """The longest prefix of `name` that is a module or package of the repository, and the names after it."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:end])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, parts[end:]
    return None, parts


def _models(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    return []


def is_config_key(name: str) -> bool:
    """`gateway.a.b`: a path of fields through the gateway section's schema (a dict field ends the walk)."""
    parts = name.split(".")
    if parts[0] != "gateway":
        return False
    models: list[type[BaseModel]] = [GatewaySettings]
    for part in parts[1:]:
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return False
        annotation = fields[0].annotation
        if typing.get_origin(annotation) is dict:
            return True
        models = _models(annotation)
    return True


def names_resolve(name: str) -> bool:
    module, rest = _module_and_rest(name)
    if module is not None and module != ROOT / name.split(".")[0] / "__init__.py":
        source = module.read_text(encoding="utf-8")
        if all(re.search(rf"\b{re.escape(attr)}\b", source) for attr in rest):
            return True
    return is_config_key(name)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    assert missing_paths(doc, doc.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_and_config_key_a_doc_names_exists(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    assert sorted(n for n in named_dotted(text) if not names_resolve(n)) == []


def test_the_checks_catch_what_is_gone() -> None:
    """The extraction finds the forms the docs use, and a moved path or module is reported."""
    text = ("see `gateway/pipeline/dispatch.py` and gateway/state_table.py, the folder `gateway/doors/`, `tests/`,"
            " not http://host/x.py or /etc/x.yaml; `gateway.control.process_guard`, `gateway.limits.max_attempts`,"
            " `gateway.limits.max_attemps`, `gateway.pipeline.admission.AdmissionQueue`, `common.nowhere`,"
            " `backends.yaml`\nheterogate/   the old shared package\n")
    assert named_paths(text) == {"gateway/pipeline/dispatch.py", "gateway/state_table.py", "gateway/doors/", "tests/",
                                 "heterogate/"}
    assert missing_paths(ROOT / "README.md", text) == ["gateway/state_table.py", "heterogate/"]
    dotted = named_dotted(text)
    assert "backends.yaml" not in dotted
    assert sorted(n for n in dotted if not names_resolve(n)) == ["common.nowhere", "gateway.limits.max_attemps"]
