"""The committed gRPC code in common/wire/ must match what proto/generate.py makes from proto/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = {p.name: p.read_text() for p in module.generate(tmp_path)}
    committed = {p.name: p.read_text() for p in (ROOT / "common" / "wire").glob("*_pb2*.py*")}
    assert fresh.keys() == committed.keys()
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code: {stale}; run `python proto/generate.py`"
