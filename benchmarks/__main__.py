"""One entry point for the benchmarks: `python -m benchmarks` lists them, `python -m benchmarks NAME [ARGS]` runs
one (the same as `python -m benchmarks.NAME ARGS`, with `-` for `_`). Every benchmark prints its table and writes
its results file (see its `--help`); the modules without a command line are the set-up they share (a gateway and
its engines on loopback, load generators, workloads)."""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

from loadtest.ctrl_c import ctrl_c_in_this_process_only
from loadtest.planner.pool import stopped_in_one_line

HERE = Path(__file__).resolve().parent


def commands() -> dict[str, tuple[str, str]]:
    """name -> (module, first line of its docstring), for every module here that runs as a program."""
    out = {}
    for path in sorted(HERE.glob("*.py")):
        source = path.read_text()
        if path.stem.startswith("_") or 'if __name__ == "__main__":' not in source:
            continue
        paragraph = " ".join((ast.get_docstring(ast.parse(source)) or "").split("\n\n")[0].split())
        out[path.stem.replace("_", "-")] = (path.stem, paragraph.split(". ")[0].rstrip(".") + ".")
    return out


def main(argv: list[str]) -> int:
    table = commands()
    if not argv or argv[0] in {"-h", "--help"}:
        width = max(map(len, table))
        print("usage: python -m benchmarks NAME [ARGS...]   (NAME --help for its options)\n")
        for name, (_, summary) in table.items():
            print(f"  {name:<{width}}  {summary}")
        return 0
    name = argv[0].replace("_", "-")
    if name not in table:
        print(f"benchmarks: no benchmark {argv[0]!r}; `python -m benchmarks` lists them", file=sys.stderr)
        return 2
    sys.argv = [f"benchmarks.{table[name][0]}", *argv[1:]]
    # Ctrl-C and SIGTERM (`timeout`, a CI cancel, `kill`) unwind the benchmark's `with` blocks, which stop the
    # gateways and engines it launched (SIGTERM left them running, ports held), and end in one line; forked
    # workers leave the signal to this process (loadtest/ctrl_c.py, loadtest/planner/pool.py).
    def run() -> int:
        with ctrl_c_in_this_process_only():
            runpy.run_module(f"benchmarks.{table[name][0]}", run_name="__main__", alter_sys=True)
        return 0

    return stopped_in_one_line(f"benchmarks {name}", "what it launched is stopped", run)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
