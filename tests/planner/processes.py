"""Signal a command once its worker processes exist, and see which of them outlive it (Linux /proc)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from testkit.harness import ROOT

WORKERS_WITHIN_S = 90.0     # enumeration, bounds or the sweep's set-up come before the pool
EXIT_WITHIN_S = 30.0
GONE_WITHIN_S = 10.0


@dataclass(frozen=True)
class Stopped:
    returncode: int
    stderr: str
    workers: list[int]          # the command's children once it had `workers` of them
    survivors: list[int]        # those still running after it exited


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def running(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _stat(pid: int) -> list[str] | None:
    """State, parent pid, ... of /proc/PID/stat (after the command name, which may hold spaces)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _ctrl_c_default() -> None:
    """SIGINT as a terminal leaves it: a run started in the background (CI's, `cmd &` in a script) inherits
    it ignored, and Python then installs no KeyboardInterrupt for it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_with_workers(command: list[str], sig: signal.Signals, workers: int = 2,
                      env: dict[str, str] | None = None) -> Stopped:
    """Start `command` in a session of its own, send `sig` to it once it has `workers` children (SIGINT to its
    whole process group, as a terminal's Ctrl-C does) and wait for it and them to go."""
    # PYTHONFAULTHANDLER: a command that does not exit in time is sent SIGABRT, and the failure shows where
    # each of its threads was (a rare hang after the interrupt's one line was seen once under a full suite)
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})},
                            preexec_fn=_ctrl_c_default)
    kids: list[int] = []
    try:
        deadline = time.monotonic() + WORKERS_WITHIN_S
        while len(kids := children(proc.pid)) < workers and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(kids) >= workers, f"no {workers} workers within {WORKERS_WITHIN_S} s: {proc.poll()}"
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        try:
            _, stderr = proc.communicate(timeout=EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=GONE_WITHIN_S)
            with contextlib.suppress(ProcessLookupError):   # its workers hold its stderr open
                os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate(timeout=GONE_WITHIN_S)
            raise AssertionError(f"not exited within {EXIT_WITHIN_S} s of {sig.name}; its threads:\n{stderr}") from None
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(running(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        return Stopped(proc.returncode, stderr, kids, [k for k in kids if running(k)])
    finally:                    # a failed check leaves nothing behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for k in kids:
            if running(k):
                os.kill(k, signal.SIGKILL)
