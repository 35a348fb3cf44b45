"""Adopting a running engine (gateway/control/adoption.py) with real processes: an engine under a
process guard that outlives its parent, found by its pid, proven by the identity in its environment,
and then stopped through the adopter's pidfd; namesakes and wrong identities are not adopted."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from common.control_credentials import ENV_ENGINE_IDENTITY
from gateway.control.adoption import EXIT_UNKNOWN, adopt_engine
from gateway.control.engine_identities import EngineIdentities, digest
from testkit.harness import ROOT, free_port

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="Linux pidfds")]
SECRET = "the-identity-the-earlier-leader-gave"


@contextmanager
def guarded_engine(tmp: Path) -> Iterator[tuple[int, int]]:
    """(guard pid, engine pid) of a simulated engine under `process_guard --outlive-parent`, its
    identity in its environment (its gateway address answers nothing: it runs all the same)."""
    engine = [sys.executable, "-m", "backends.engine", "--backend-id", "h100-0", "--gpu", "H100", "--model",
              "llava-1.5-7b", "--gateway", f"127.0.0.1:{free_port()}", "--log-level", "warning"]
    with open(tmp / "engine.log", "wb") as log:
        guard = subprocess.Popen(
            [sys.executable, "-m", "gateway.control.process_guard", "--parent", str(os.getpid()), "--outlive-parent",
             "--", *engine], cwd=ROOT, env={**os.environ, ENV_ENGINE_IDENTITY: SECRET}, stdout=log,
            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        # until the engine has exec'd: a forked child's cmdline is the guard's, which names the engine too, and
        # while the exec replaces it /proc may read empty (adoption then saw no engine there)
        while not (children := Path(f"/proc/{guard.pid}/task/{guard.pid}/children").read_text().split()) or \
                not exec_done(Path(f"/proc/{children[0]}/cmdline").read_bytes()):
            assert time.monotonic() < deadline, "the guard started no engine"
            time.sleep(0.05)
        yield guard.pid, int(children[0])
    finally:
        if guard.poll() is None:
            guard.terminate()
        guard.wait(15)


def exec_done(cmdline: bytes) -> bool:
    return b"backends.engine" in cmdline and b"process_guard" not in cmdline


def admitting(digests: dict[str, str]) -> EngineIdentities:
    """A replica's identities that admit what the leader announced (`digests`), as a follower does."""
    identities = EngineIdentities.drawn(["h100-0", "l40s-0"], launching=False)
    identities.adopt(digests)
    return identities


def test_the_deployments_engine_is_adopted_and_stopped_through_the_pidfd(tmp_path: Path) -> None:
    with guarded_engine(tmp_path) as (guard, engine):
        ours = admitting({"h100-0": digest(SECRET)})
        assert adopt_engine(engine, "l40s-0", ours.verify) is None        # not that backend's engine
        assert adopt_engine(guard, "h100-0", ours.verify) is None         # the guard is not the engine
        assert adopt_engine(engine, "h100-0", admitting({"h100-0": digest("other")}).verify) is None
        adopted = adopt_engine(engine, "h100-0", ours.verify)
        assert adopted is not None and adopted.pid == guard and adopted.returncode is None
        adopted.terminate()   # the guard stops its engine's group, then exits
        assert asyncio.run(adopted.wait()) == EXIT_UNKNOWN
        assert adopted.returncode == EXIT_UNKNOWN
        with pytest.raises(ProcessLookupError):
            adopted.kill()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{engine}").exists() and Path(f"/proc/{engine}/stat").read_text().split()[2] != "Z":
            assert time.monotonic() < deadline, "the engine outlived its stopped guard"
            time.sleep(0.05)


def test_an_adopted_engine_keeps_its_announced_identity_until_launched_again() -> None:
    follower = admitting({"h100-0": digest(SECRET), "l40s-0": digest("l40s-secret")})
    follower.set_launching(True, keep=["h100-0"])
    assert follower.verify("h100-0", SECRET)                        # adopted: the earlier leader's engine
    assert follower.verify("l40s-0", follower.secret("l40s-0"))    # not adopted: its own from now on
    assert dict(follower.announced) == {"h100-0": digest(SECRET), "l40s-0": follower.own["l40s-0"]}
    follower.launched("h100-0")
    assert not follower.verify("h100-0", SECRET) and follower.verify("h100-0", follower.secret("h100-0"))
    assert dict(follower.announced) == follower.own
