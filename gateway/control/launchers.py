"""How each kind of managed backend is started and known to be ready: one `Launcher` per backend kind.

- `EngineLauncher` (kind: engine): `python -m backends.engine ...` pointed at the gateway's control
  port; ready once it has heartbeated (the table forgets the last heartbeat when it is relaunched).
  With replicas (`orphan_timeout_s`) it outlives the gateway that launched it (the next leader adopts
  it, gateway/control/adoption.py) and exits by itself once no replica has heard it for that long.
- `CommandLauncher` (kind: openai): the entry's own command (`vllm serve ...`,
  `python -m sglang.launch_server ...`), `{port}` replaced by its port, `devices` as
  CUDA_VISIBLE_DEVICES; ready once `GET ready_path` answers 200.

The supervisor knows nothing of either: it asks a launcher for a `LaunchPlan`, starts it, and polls
`ready()` until the launcher's start timeout.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from common.errors import ConfigError
from gateway.config.cluster import BackendSpec, ClusterConfig, CommandLaunchSpec, LaunchSpec, catalog_dir
from gateway.control.control_auth import is_loopback
from gateway.routing.state_table import StateTable

Probe = Callable[[str], Awaitable[bool]]   # GET url → answered 200 in time


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)   # added to the gateway's own environment
    outlive_parent: bool = False   # keeps running if the gateway dies (replicas adopt it)


class Launcher(Protocol):
    backend_id: str
    start_timeout_s: float
    probe_interval_s: float

    def plan(self) -> LaunchPlan: ...

    async def ready(self) -> bool: ...


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EngineLauncher:
    def __init__(
        self, config: ClusterConfig, spec: BackendSpec, control_address: str, table: StateTable, log_level: str,
        env: dict[str, str] | None = None, orphan_timeout_s: float | None = None,
    ) -> None:
        assert isinstance(spec.launch, LaunchSpec)
        self.backend_id = spec.id
        self.start_timeout_s = config.settings.engine_start_timeout_s
        self.probe_interval_s = config.settings.heartbeat_interval_ms / 1000 / 4
        # env: the engine's identity towards the control port, the cluster token, the CA (gateway.control.control_auth)
        argv = engine_argv(config, spec, control_address, log_level)
        if orphan_timeout_s is not None:
            argv += ["--orphan-timeout-s", str(orphan_timeout_s)]
        self._plan = LaunchPlan(argv, env or {}, outlive_parent=orphan_timeout_s is not None)
        self._table = table

    def plan(self) -> LaunchPlan:
        return self._plan

    async def ready(self) -> bool:
        entry = self._table.get(self.backend_id)
        return entry is not None and entry.last_heartbeat is not None


class CommandLauncher:
    def __init__(self, spec: BackendSpec, port: int, probe: Probe) -> None:
        assert isinstance(spec.launch, CommandLaunchSpec)
        launch = spec.launch
        self.backend_id = spec.id
        self.start_timeout_s = launch.start_timeout_s
        self.probe_interval_s = launch.probe_interval_s
        self.port = port
        self.address = managed_address(port)
        self.ready_url = self.address + launch.ready_path
        env = dict(launch.env)
        if launch.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in launch.devices)
        self._plan = LaunchPlan([arg.replace("{port}", str(port)) for arg in launch.command], env)
        self._probe = probe

    def plan(self) -> LaunchPlan:
        return self._plan

    async def ready(self) -> bool:
        return await self._probe(self.ready_url)


def managed_address(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def check_launchable(config: ClusterConfig, own_ports: Collection[int]) -> None:
    """ConfigError naming the entry where a backend cannot be what the file says on this host: a managed
    engine told to listen on one of the gateway's own ports (`own_ports`: it fails to bind, and the
    gateway itself answered its readiness probe), an upstream that is this gateway's own HTTP door (a
    request forwarded to itself, and again), or a launch command whose program is not there (it exited
    127 and was restarted for ever, `state: restarting` and no word why)."""
    for i, spec in enumerate(config.raw.backends):
        where = f"{config.path}: backends.{i} ({spec.id})"
        launch = spec.launch
        if isinstance(launch, CommandLaunchSpec):
            if launch.port in own_ports:
                raise ConfigError(f"{where}.launch.port: {launch.port} is one of this gateway's own ports")
            program = launch.command[0]
            path = launch.env.get("PATH", os.environ.get("PATH", os.defpath))
            if shutil.which(program, path=path) is None:
                raise ConfigError(f"{where}.launch.command: {program!r} is not an executable program here "
                                  "(not found, or not executable, on the PATH the engine gets)")
        elif spec.kind == "openai" and spec.address is not None:
            parts = urlsplit(spec.address)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            host = parts.hostname or ""
            if port in own_ports and (is_loopback(host) or host in ("0.0.0.0", "::")):
                raise ConfigError(f"{where}.address: {spec.address} is this gateway's own HTTP door")


def managed_ports(config: ClusterConfig) -> dict[str, int]:
    """The port of every managed kind: openai engine: its own, or a free one picked now."""
    return {
        spec.id: spec.launch.port or free_port()
        for spec in config.raw.backends
        if isinstance(spec.launch, CommandLaunchSpec)
    }


@dataclass(frozen=True)
class LaunchContext:
    """What every launcher of one gateway shares: where engines heartbeat (several addresses,
    comma-separated, fail over), the table, the readiness probe, the engines' log level and environment
    (their identity), and, with replicas only, `orphan_timeout_s` (kind: engine backends outlive their
    launcher, see EngineLauncher). Launchers are made at start-up and for backends added at runtime
    (gateway/control/fleet.py)."""

    control_address: str
    table: StateTable
    probe: Probe
    log_level: str
    engine_env: Callable[[str], dict[str, str]] = lambda backend_id: {}
    orphan_timeout_s: float | None = None

    def launcher(self, config: ClusterConfig, spec: BackendSpec, port: int | None) -> Launcher | None:
        """The launcher of a managed entry (`port`: a managed kind: openai engine's); None for an external one."""
        if isinstance(spec.launch, CommandLaunchSpec):
            assert port is not None
            return CommandLauncher(spec, port, self.probe)
        if isinstance(spec.launch, LaunchSpec):
            return EngineLauncher(config, spec, self.control_address, self.table, self.log_level,
                                  self.engine_env(spec.id), self.orphan_timeout_s)
        return None


def build_launchers(config: ClusterConfig, ports: dict[str, int], context: LaunchContext) -> list[Launcher]:
    """The launchers of every managed entry of the file (`ports`: those of managed kind: openai engines)."""
    return [launcher for spec in config.raw.backends
            if (launcher := context.launcher(config, spec, ports.get(spec.id))) is not None]


def engine_argv(config: ClusterConfig, spec: BackendSpec, control_address: str, log_level: str) -> list[str]:
    launch = spec.launch
    assert isinstance(launch, LaunchSpec)
    return [
        sys.executable, "-m", "backends.engine",
        "--backend-id", spec.id,
        "--role", spec.role,
        "--gpu", spec.gpu,
        *(["--catalog", str(folder)] if (folder := catalog_dir(config.path, config.raw)) is not None else []),
        "--model", config.model_of(spec.id).catalog,
        "--gateway", control_address,
        "--time-scale", str(launch.time_scale),
        "--max-batch", str(launch.max_batch),
        "--memory-utilization", str(launch.memory_utilization),
        "--heartbeat-ms", str(config.settings.heartbeat_interval_ms),
        "--vision-batch", str(launch.vision_batch),
        "--vision-batch-timeout-ms", str(launch.vision_batch_timeout_ms),
        "--steal-episode-ms", str(launch.steal_episode_ms),
        "--log-level", log_level,
        *(["--steal"] if spec.steal else []),
        *torch_argv(launch),
        *launch.extra_args,
    ]


def torch_argv(launch: LaunchSpec) -> list[str]:
    if launch.executor != "torch":
        return []
    return [
        "--executor", "torch", "--device", launch.device, "--dtype", launch.dtype, "--seed", str(launch.seed),
        *(["--model-path", launch.model_path] if launch.model_path is not None else ["--random-weights"]),
        *(["--max-model-len", str(launch.max_model_len)] if launch.max_model_len is not None else []),
    ]
