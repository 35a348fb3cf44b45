"""The README's commands leave the tracked files alone: their results go under `results/` in the current
directory (git ignores it in a checkout) unless an explicit `--out` sends them into the repository.

A user who runs the consistency check or a Locust run from a clone must not find `git status` full of
rewritten docs and CSVs.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import subprocess
import sys
import time

import pytest

from loadtest.consistency import DEFAULT_OUT, RECORDED_OUT, parse_args
from testkit.harness import ROOT

README = ROOT / "README.md"
LOCUST_CSV_SUFFIXES = ("_stats.csv", "_stats_history.csv", "_failures.csv", "_exceptions.csv")


def readme_command(program: str) -> list[str]:
    """The README's shell command that starts with `program` (in a bash block; comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        if line.startswith(program):
            return shlex.split(line, comments=True)
    raise AssertionError(f"README.md has no command starting with {program!r}")


def git(*args: str) -> str:
    run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.returncode in (0, 1), run.stderr
    return run.stdout


def ignored_and_untracked(path: str) -> bool:
    return git("check-ignore", "--no-index", path).strip() == path and git("ls-files", path) == ""


def tracked_digests(folder: str) -> dict[str, str]:
    return {p: hashlib.sha256((ROOT / p).read_bytes()).hexdigest() for p in git("ls-files", folder).split()}


def test_the_readme_commands_write_into_an_ignored_folder() -> None:
    locust = readme_command("locust")
    prefix = locust[locust.index("--csv") + 1]
    assert all(ignored_and_untracked(prefix + suffix) for suffix in LOCUST_CSV_SUFFIXES), prefix

    consistency = readme_command("python -m loadtest.consistency")
    out = parse_args(consistency[3:]).out
    assert out == DEFAULT_OUT
    assert ignored_and_untracked(str(out / "consistency.json"))
    # The tracked results stay reachable, by asking for them.
    assert parse_args(["--out", str(RECORDED_OUT)]).out == RECORDED_OUT
    assert git("ls-files", str(RECORDED_OUT / "consistency.json")).strip() == str(RECORDED_OUT / "consistency.json")

    report = readme_command("python -m loadtest.sim.report")
    assert "--out" not in report


@pytest.mark.timeout(180)
def test_a_consistency_run_from_the_checkout_changes_no_tracked_file() -> None:
    """A short run of the README's check, from the repository root as the README says: its results land in
    results/consistency/, which `git status` does not list, and the tracked results are untouched."""
    before = tracked_digests("docs/results")
    started = time.time()
    # engines at 0.5× real time: what is checked is where the results go, not how close live and sim agree
    run = subprocess.run([sys.executable, "-m", "loadtest.consistency", "--loads", "1.0", "--requests", "8",
                          "--time-scale", "0.5"], cwd=ROOT, capture_output=True, text=True, timeout=170)
    output = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode in (0, 1), output     # 1: eight requests are too few to stay within the tolerances
    written = [ROOT / DEFAULT_OUT / name for name in ("consistency.json", "consistency.csv")]
    assert all(p.is_file() and p.stat().st_mtime >= started - 1 for p in written), output
    assert f"wrote {DEFAULT_OUT / 'consistency.json'}" in run.stdout
    assert git("status", "--porcelain", "--untracked-files=all", "--", str(DEFAULT_OUT)) == ""
    assert tracked_digests("docs/results") == before
