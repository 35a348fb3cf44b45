"""The supervisor's state machine, driven by a fake clock and fake processes: no sleeps, no processes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import pytest

from gateway.control.launchers import LaunchPlan
from gateway.control.supervisor import Supervisor
from gateway.routing.backend_entry import Lifecycle


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds
        await asyncio.sleep(0)


class FakeProcess:
    def __init__(self, pid: int, *, obeys_sigterm: bool = True) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.signals: list[str] = []
        self._obeys_sigterm = obeys_sigterm
        self._exited = asyncio.Event()

    def exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def terminate(self) -> None:
        self.signals.append("TERM")
        if self._obeys_sigterm:
            self.exit(-15)

    def kill(self) -> None:
        self.signals.append("KILL")
        self.exit(-9)


class FakeSpawner:
    def __init__(self, *, obeys_sigterm: bool = True) -> None:
        self.spawned: list[FakeProcess] = []
        self.plans: list[tuple[list[str], dict[str, str]]] = []
        self._obeys_sigterm = obeys_sigterm

    async def spawn(self, argv: list[str], env: dict[str, str], *, outlive_parent: bool = False) -> FakeProcess:
        self.plans.append((argv, env))
        process = FakeProcess(100 + len(self.spawned), obeys_sigterm=self._obeys_sigterm)
        self.spawned.append(process)
        return process


class FakeLauncher:
    backend_id = "vllm-0"
    start_timeout_s = 10.0
    probe_interval_s = 1.0

    def __init__(self) -> None:
        self.is_ready = False
        self.probes = 0

    def plan(self) -> LaunchPlan:
        return LaunchPlan(["vllm", "serve", "m", "--port", "8123"], {"CUDA_VISIBLE_DEVICES": "0,1"})

    async def ready(self) -> bool:
        self.probes += 1
        return self.is_ready


async def until(condition: Callable[[], bool], rounds: int = 10_000) -> None:
    """Let the event loop run (zero-length yields, never a timed sleep) until `condition` holds."""
    for _ in range(rounds):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def crash(spawner: FakeSpawner, code: int) -> None:
    """The running process exits with `code`; returns once its successor was launched."""
    launched = len(spawner.spawned)
    spawner.spawned[-1].exit(code)
    await until(lambda: len(spawner.spawned) == launched + 1)


def supervisor_of(launcher: FakeLauncher, clock: FakeClock, spawner: FakeSpawner,
                  states: list[tuple[str, Lifecycle]], **kwargs: float) -> Supervisor:
    return Supervisor([launcher], on_state=lambda b, s: states.append((b, s)), clock=clock, spawner=spawner,
                      **{"backoff_min_s": 1.0, "backoff_max_s": 4.0, "stable_after_s": 30.0, **kwargs})


async def test_starting_until_ready_then_restarted_with_doubling_backoff() -> None:
    clock, spawner, launcher, states = FakeClock(), FakeSpawner(), FakeLauncher(), []
    sup = supervisor_of(launcher, clock, spawner, states)
    sup.start()
    await until(lambda: launcher.probes >= 3)
    assert sup.children[0].state == "starting" and len(spawner.spawned) == 1
    assert spawner.plans[0] == (["vllm", "serve", "m", "--port", "8123"], {"CUDA_VISIBLE_DEVICES": "0,1"})
    launcher.is_ready = True
    await until(lambda: sup.children[0].state == "ready")
    for expected_backoff in (1.0, 2.0, 4.0, 4.0):   # crashes right after start: the backoff doubles to its cap
        clock.sleeps.clear()
        await crash(spawner, -9)
        assert clock.sleeps[0] == expected_backoff
        await until(lambda: sup.children[0].state == "ready")
    assert sup.children[0].restarts == 4
    assert [s for _, s in states[:4]] == ["starting", "starting", "ready", "restarting"]
    await sup.stop()
    assert spawner.spawned[-1].signals == ["TERM"] and sup.children[0].state == "stopped"


async def test_backoff_resets_once_an_engine_stayed_up() -> None:
    clock, spawner, launcher, states = FakeClock(), FakeSpawner(), FakeLauncher(), []
    launcher.is_ready = True
    sup = supervisor_of(launcher, clock, spawner, states)
    sup.start()
    for _ in range(2):
        await until(lambda: sup.children[0].state == "ready")
        await crash(spawner, 1)
    assert clock.sleeps == [1.0, 2.0]
    await until(lambda: sup.children[0].state == "ready")
    clock.t += 31.0   # up for longer than stable_after_s
    spawner.spawned[-1].exit(1)
    await until(lambda: len(spawner.spawned) == 4)
    assert clock.sleeps[-1] == 1.0
    await sup.stop()


async def test_an_engine_not_ready_within_its_start_timeout_is_stopped_and_launched_again() -> None:
    clock, spawner, launcher, states = FakeClock(), FakeSpawner(), FakeLauncher(), []
    sup = supervisor_of(launcher, clock, spawner, states)
    sup.start()
    await until(lambda: len(spawner.spawned) == 2)
    first = spawner.spawned[0]
    assert first.signals == ["TERM"] and first.returncode == -15
    assert clock.sleeps[:11] == [1.0] * 11   # a probe a second for the 10 s start timeout, then a 1 s backoff
    assert ("vllm-0", "ready") not in states and sup.children[0].state == "starting"
    await sup.stop()


async def test_an_engine_that_exits_while_starting_is_restarted() -> None:
    clock, spawner, launcher, states = FakeClock(), FakeSpawner(), FakeLauncher(), []
    sup = supervisor_of(launcher, clock, spawner, states)
    sup.start()
    await until(lambda: launcher.probes >= 1)
    spawner.spawned[0].exit(2)
    await until(lambda: len(spawner.spawned) == 2)
    assert [s for _, s in states] == ["starting", "starting", "restarting", "starting"]
    await sup.stop()


async def test_stop_kills_what_ignores_sigterm() -> None:
    clock, spawner, launcher, states = FakeClock(), FakeSpawner(obeys_sigterm=False), FakeLauncher(), []
    launcher.is_ready = True
    sup = supervisor_of(launcher, clock, spawner, states, stop_timeout_s=0.01)
    sup.start()
    await until(lambda: sup.children[0].state == "ready")
    await sup.stop()
    assert spawner.spawned[0].signals == ["TERM", "KILL"] and len(spawner.spawned) == 1
    assert states[-1] == ("vllm-0", "stopped")


async def test_an_adopted_engine_is_ready_at_once_and_launched_again_only_once_it_exits() -> None:
    clock, spawner, launcher, states = FakeClock(), FakeSpawner(), FakeLauncher(), []
    launched: list[str] = []
    adopted = FakeProcess(7)
    sup = Supervisor([launcher], on_state=lambda b, s: states.append((b, s)), clock=clock, spawner=spawner,
                     backoff_min_s=1.0, adopted={"vllm-0": adopted}, on_launch=launched.append)
    sup.start()
    await until(lambda: sup.children[0].state == "ready")
    assert sup.children[0].process is adopted and spawner.spawned == [] and launched == []
    assert launcher.probes == 0                      # nothing to wait for: it already serves
    adopted.exit(1)
    await until(lambda: len(spawner.spawned) == 1)
    assert launched == ["vllm-0"] and sup.children[0].restarts == 1   # its identity changes hands now
    assert [s for _, s in states] == ["ready", "restarting", "starting"]   # never "starting" while it served
    launcher.is_ready = True
    await until(lambda: sup.children[0].state == "ready")
    await sup.stop()
    assert adopted.signals == [] and spawner.spawned[0].signals == ["TERM"]


async def test_stop_stops_an_adopted_engine_too() -> None:
    clock, spawner, launcher, states = FakeClock(), FakeSpawner(), FakeLauncher(), []
    adopted = FakeProcess(7)
    sup = Supervisor([launcher], on_state=lambda b, s: states.append((b, s)), clock=clock, spawner=spawner,
                     adopted={"vllm-0": adopted})
    sup.start()
    await until(lambda: sup.children[0].state == "ready")
    await sup.stop()
    assert adopted.signals == ["TERM"] and spawner.spawned == [] and states[-1] == ("vllm-0", "stopped")


async def test_each_exit_is_reported_in_words() -> None:
    clock, spawner, launcher, states = FakeClock(), FakeSpawner(), FakeLauncher(), []
    exits: list[tuple[str, str]] = []
    sup = Supervisor([launcher], on_state=lambda b, s: states.append((b, s)), clock=clock, spawner=spawner,
                     backoff_min_s=1.0, on_exit=lambda b, why: exits.append((b, why)))
    sup.start()
    await until(lambda: len(spawner.spawned) == 2)   # never ready: stopped at the start timeout
    launcher.is_ready = True
    await until(lambda: sup.children[0].state == "ready")
    await crash(spawner, 137)   # the guard's status when SIGKILL took the engine
    await until(lambda: sup.children[0].state == "ready")
    await crash(spawner, 127)
    await until(lambda: sup.children[0].state == "ready")
    await crash(spawner, 3)
    assert [why for _, why in exits] == [
        "not ready within its start timeout (10 s): stopped",
        "exited with status 137 (killed by SIGKILL)",
        "exited with status 127 (the launch program was not found or could not start)",
        "exited with status 3",
    ]
    assert {b for b, _ in exits} == {"vllm-0"} and sup.children[0].last_exit == "exited with status 3"
    await sup.stop()
    assert len(exits) == 4   # a stop the gateway asked for is no exit to report


class OutlivingLauncher(FakeLauncher):
    """A `kind: engine` backend with replicas: its guard is launched to outlive the gateway."""

    def plan(self) -> LaunchPlan:
        return replace(super().plan(), outlive_parent=True)


@pytest.mark.parametrize("outlives", [True, False])
async def test_leave_leaves_running_only_what_outlives_the_gateway(outlives: bool) -> None:
    """A leader handing its engines over: they run on, and an exit afterwards launches nothing; a process
    not launched to outlive it (a `kind: openai` command) is stopped as before."""
    clock, spawner, states = FakeClock(), FakeSpawner(), []
    launcher = OutlivingLauncher() if outlives else FakeLauncher()
    sup = supervisor_of(launcher, clock, spawner, states)
    sup.start()
    launcher.is_ready = True
    await until(lambda: ("vllm-0", "ready") in states)
    await sup.leave()
    (process,) = spawner.spawned
    if not outlives:
        assert process.signals == ["TERM"] and states[-1] == ("vllm-0", "stopped")
        return
    assert process.signals == [] and process.returncode is None
    process.exit(0)
    for _ in range(100):
        await asyncio.sleep(0)
    assert len(spawner.spawned) == 1 and states[-1] == ("vllm-0", "ready")
