"""Runs one managed engine command and takes its whole process tree down with it.

    python -m gateway.control.process_guard --parent PID --grace-s 5 [--outlive-parent] -- vllm serve ...

The gateway's supervisor starts every managed engine through this guard, because engines spawn
workers (vLLM, SGLang) that outlive their leader, and because a gateway killed with SIGKILL cannot
clean up after itself:

- the guard asks the kernel for SIGTERM when its parent (the gateway) dies (PR_SET_PDEATHSIG), and
  exits at once if the gateway is already gone; with `--outlive-parent` (replicas on one Redis) it
  does neither: the engine keeps serving the other replicas and the next leader adopts the guard
  (gateway/control/adoption.py), and an engine that no replica hears exits by itself
  (`heterogate-engine --orphan-timeout-s`);
- the engine runs in a process group of its own; on SIGTERM the guard sends SIGTERM to that group,
  and SIGKILL to what is left of it after `--grace-s`;
- when the engine exits by itself (a crash, kill -9), the guard SIGKILLs the rest of its group and
  exits with the engine's status, so the supervisor sees the exit and no worker is left behind.

Standard library only: the guard starts in milliseconds and imports none of the gateway.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def ask_for_parent_death_signal(sig: int) -> None:
    """Linux: deliver `sig` to this process when its parent exits (a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def run(command: list[str], parent: int, grace_s: float, outlive_parent: bool = False) -> int:
    if not outlive_parent:
        ask_for_parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent:   # the gateway died before the line above took effect
            return 1
    # A plain flag: a handler that takes a lock (threading.Event.set) can deadlock against the main loop.
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda sig, _: stopping.append(sig))
    signal.signal(signal.SIGINT, lambda sig, _: stopping.append(sig))
    try:
        # The leader also dies with the guard, should the guard itself be SIGKILLed.
        engine = subprocess.Popen(command, process_group=0,
                                  preexec_fn=lambda: ask_for_parent_death_signal(signal.SIGKILL))
    except OSError as exc:
        print(f"process_guard: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return 127
    pgid = engine.pid
    while engine.poll() is None and not stopping:
        time.sleep(0.1)
    if stopping and engine.poll() is None:
        kill_group(pgid, signal.SIGTERM)
        try:
            engine.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    kill_group(pgid, signal.SIGKILL)   # leftover workers, or an engine that ignored SIGTERM
    code = engine.wait()
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="process_guard", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--parent", type=int, required=True, help="pid of the supervising gateway")
    p.add_argument("--grace-s", type=float, default=5.0, help="SIGTERM → SIGKILL delay on stop")
    p.add_argument("--outlive-parent", action="store_true", help="keep the engine running when the gateway dies")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given")
    sys.exit(run(command, args.parent, args.grace_s, args.outlive_parent))


if __name__ == "__main__":
    main()
