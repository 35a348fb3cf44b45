"""Regenerate the Python gRPC code in common/wire/ from proto/heterogate/*.proto.

Run `python proto/generate.py` after editing a .proto file. protoc writes absolute imports
(`import engine_pb2`) into the *_grpc.py files; they are rewritten as package-relative imports so the
generated code lives inside the `common.wire` package. `tests/test_wire_fresh.py` regenerates into a
temporary folder and fails when the committed code is stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "heterogate"
OUT_DIR = ROOT / "common" / "wire"
_ABSOLUTE_IMPORT = re.compile(r"^import (\w+_pb2) as", re.MULTILINE)


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Generate code for every .proto into `out_dir`; return the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = sorted(out_dir.glob("*_pb2*.py*"))
    for path in written:
        text = path.read_text()
        fixed = _ABSOLUTE_IMPORT.sub(r"from . import \1 as", text)
        if fixed != text:
            path.write_text(fixed)
    return written


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR):
        print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
