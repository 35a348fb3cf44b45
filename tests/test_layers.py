"""The layering of the packages (pyproject.toml, [tool.importlinter]) holds: the gateway's rooms import only
rooms below them on the request's path, the shared package imports neither the gateway nor the engines, and no
package's modules import each other in a circle."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is part of the test extra"
    run = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("KEPT") == 3, run.stdout
