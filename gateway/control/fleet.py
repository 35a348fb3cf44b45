"""The fleet changed at runtime: backends added, drained and removed while the gateway serves.

Three changes, each checked whole before anything moves (an invalid one is refused and the running
fleet stays as it was):

- **add**: one entry of backends.yaml's `backends:` (managed or external), validated against the
  running file with that entry appended (schema, catalog GPU, the model's encoder, api_key_env, torch
  weights), so whatever start-up refuses is refused here with the same words. It is registered in
  the state table, gets its client, its watcher (kind: openai scraped or launched) and, when managed,
  its launcher under the running supervisor.
- **drain**: the backend stops being a routing candidate at once (`StateTable.drain`); the requests
  it holds finish (it stays healthy for them), for at most `gateway.drain_timeout_s`; then a managed
  backend's engine is stopped. A drained backend stays listed (`draining: true`) until removed, or
  until a reload finds it in the file. A drain that would leave no backend serving language work is
  refused (409: the request is sound, the fleet's state does not allow it), as such a removal is.
- **remove**: drain, then the backend leaves the table, its client and its watcher are closed. A
  removal that would leave no backend taking language work is refused (409).

The admin routes (`POST /admin/backends`, `POST /admin/backends/{id}/drain`, `DELETE
/admin/backends/{id}`, gateway/doors/routes.py) call `add`, `drain` and `remove`; SIGHUP calls
`reload`, which reads the backends file again and applies the difference between its `backends:` and
the running fleet (a changed entry is removed, drained, then added again; a drained one still in the
file is taken out and added again, so it serves once more; where no other backend would serve language
work while they restart, the serving ones among the changed are replaced one at a time, each once the
one before serves again). Only `backends:` is reloaded: the
gateway's settings are read at start-up.

Changes are applied one at a time, in the order they come (`Fleet.exclusive`): a reload, an admin call
and an autoscaler step each hold the fleet while they are computed and applied, a reload also while the
backends it replaces drain, so each is computed against the fleet as the previous one left it. SIGHUPs
that come while a reload waits for its turn are that reload's (it reads the file after them).

With replicas (`--redis-url`) each replica holds the fleet in its own table and the shared counts are
laid out per backend at start-up, so changes at runtime are refused there (restart the replicas with
the new file); a reload of a file whose `backends:` are the running ones changes nothing, so it is no
refusal there either.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import structlog
from pydantic import ValidationError

from common.errors import ConfigError
from gateway.config.autoscaling import POOL_ROLES
from gateway.config.cluster import BackendSpec, ClusterConfig, CommandLaunchSpec, command_port, load_cluster
from gateway.control.engine_identities import EngineIdentities
from gateway.control.launchers import (
    CommandLauncher,
    LaunchContext,
    Launcher,
    check_launchable,
    free_port,
    managed_address,
)
from gateway.control.supervisor import Supervisor
from gateway.control.upstream_monitor import UpstreamMonitor
from gateway.requests.errors import InvalidRequest, RequestError
from gateway.runtime import Runtime, has_encoders, index_backend, register_backend, upstream_of

log = structlog.get_logger("fleet")


class BackendNotFound(RequestError):
    status = 404
    type = "invalid_request_error"
    code = "backend_not_found"


class FleetConflict(RequestError):
    """A well-formed change that the fleet's state does not allow (an id in use, a removal under way, the
    last backend serving language work, a model's last backend, replicas): 409, as the request itself is
    sound and may succeed once the fleet has changed."""

    status = 409
    type = "invalid_request_error"
    code = "fleet_conflict"


def parse_backend(body: object) -> BackendSpec:
    """One entry of `backends:`; InvalidRequest naming each wrong field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object: one entry of backends.yaml's `backends:`",
                             code="invalid_backend")
    try:
        return BackendSpec.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'backend'}: {e['msg']}" for e in exc.errors())
        raise InvalidRequest(f"invalid backend: {problems}", code="invalid_backend") from None


def _as_change(message: str) -> str:
    """A file's error as a change's: `backends.2 (x1).gpu` names an index in the running fleet, which the
    client never wrote; `backend x1: gpu` names what it sent."""
    return re.sub(r"backends\.\d+ \(([^)]+)\)(\.?)", lambda m: f"backend {m[1]}" + (": " if m[2] else ""), message)


class Fleet:
    def __init__(
        self, runtime: Runtime, launch: LaunchContext, launchers: Sequence[Launcher],
        supervisor: Callable[[], Supervisor | None], monitor: UpstreamMonitor, identities: EngineIdentities,
        *, drain_timeout_s: float, refused: str | None = None, poll_s: float = 0.05,
        own_ports: frozenset[int] = frozenset(),
    ) -> None:
        """`supervisor()`: the running supervisor of the managed backends (None while there is none);
        `refused`: why this gateway takes no change at runtime (None: it does); `own_ports`: the gateway's,
        which no backend may take (`check_launchable`)."""
        self._runtime = runtime
        self.config = runtime.config
        self._launch = launch
        self._launchers = {launcher.backend_id: launcher for launcher in launchers}
        self._supervisor = supervisor
        self._monitor = monitor
        self._identities = identities
        self._drain_timeout_s = drain_timeout_s
        self._refused = refused
        self._poll_s = poll_s
        self._own_ports = own_ports
        self._weights = runtime.config.torch_weights   # the tokenizer the runtime loaded at start-up
        self._drains: dict[str, asyncio.Task[None]] = {}
        self._removals: dict[str, asyncio.Task[None]] = {}
        # removed by a reload to be added again as the file now says: their entry stays in the running file
        # until its successor takes its place (without it, the one language backend's file is invalid)
        self._replacing: set[str] = set()
        # added by the autoscaler (`add(scaled=True)`): the scaler's, not the file's, so a reload keeps them
        self._scaled: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()
        self._holder: asyncio.Task[Any] | None = None   # the task applying a change now (`exclusive`)
        self._reload_queued = False   # a reload waits for its turn and has not read the file yet

    def launchers(self) -> list[Launcher]:
        """The launchers of the managed backends in the fleet now (a new supervisor starts these)."""
        return list(self._launchers.values())

    # -- the changes -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the fleet for one change (`add`, `drain`, `remove`, an autoscaler step; `reload` takes it
        itself), waiting for the change under way. Changes applied side by side were each computed against
        a fleet the other was changing: two reloads both replaced one backend, launching two engines under
        its id (the one whose identity was drawn first refused for good)."""
        async with self._lock:
            self._holder = asyncio.current_task()
            try:
                yield
            finally:
                self._holder = None

    def add(self, body: object, *, scaled: bool = False) -> str:
        """Add one backend (its id returned); refused whole when invalid. As `drain` and `remove`, called
        with the fleet held (`exclusive`). `scaled`: the autoscaler's engine, which a reload keeps."""
        self._allowed()
        spec = parse_backend(body)
        if any(b.id == spec.id for b in self.config.raw.backends):
            leaving = " (being removed: add it again once it is gone)" if spec.id in self._removals else ""
            raise FleetConflict(f"backend {spec.id!r} is already in the fleet{leaving}")
        config = self._validated([*self.config.raw.backends, spec])
        # the running engines' ports, the file's or one chosen free (`_validated` runs no validator of the file's,
        # which refuses a port given twice at start-up)
        port = command_port(spec)
        holder = port and next((i for i, launcher in self._launchers.items()
                                if isinstance(launcher, CommandLauncher) and launcher.port == port), None)
        if holder:
            raise InvalidRequest(f"launch.port {port} is taken twice ({holder}, {spec.id}): the second engine could "
                                 "not listen, and its probe would be answered by the first", code="invalid_backend")
        self._apply_add(config, spec)
        if scaled:
            self._scaled.add(spec.id)
        return spec.id

    def drain(self, backend_id: str) -> None:
        """No new requests for the backend from now on; its own finish, then a managed one is stopped.
        Refused where no backend taking language work would be left serving (the gateway could serve
        nothing), or only backends kept for higher priority classes (the lowest class could be served
        nowhere); one model of several may be left without (it is named degraded in /ready)."""
        self._allowed()
        self._known(backend_id)
        if backend_id not in self._drains:
            self._keeps_serving(backend_id, "draining")
            self._keeps_lowest_class(backend_id, "draining")
            self._drain_task(backend_id)

    def remove(self, backend_id: str) -> None:
        """Drain the backend, then take it out of the fleet (in the background). Refused where the fleet
        left would be an invalid file (a model without a backend taking language work, drained or not),
        or on the grounds a drain is."""
        self._allowed()
        self._known(backend_id)
        if backend_id not in self._removals:
            try:
                self._validated([b for b in self.config.raw.backends
                                 if b.id != backend_id and b.id not in self._removals])
            except InvalidRequest as exc:   # what the running entries lack is the one removed: the fleet's state
                raise FleetConflict(exc.message) from None
            if backend_id not in self._drains:
                self._keeps_serving(backend_id, "removing")
            self._keeps_lowest_class(backend_id, "removing")
            self._start_removal(backend_id)

    def _keeps_serving(self, backend_id: str, change: str) -> None:
        """FleetConflict where taking `backend_id` out of service would leave no backend serving language
        work at all (the gateway could serve nothing); one model of several may be left without (it is
        named degraded in /ready)."""
        leaving = {backend_id, *self._drains, *self._removals}
        table = self._runtime.table
        left = [b.id for b in self.config.raw.backends if b.role in POOL_ROLES["language"] and b.id not in leaving]
        serving = [i for i in left if (e := table.get(i)) is not None and table.is_healthy(e)]
        me = table.get(backend_id)
        if not left or (not serving and me is not None and table.is_healthy(me)):   # a starting one does not serve
            raise FleetConflict(f"{change} {backend_id!r} would leave no backend serving language work "
                                "(role language or both): the gateway could serve nothing; add one first"
                                + (f" (or wait: {', '.join(left)} not serving yet)" if left else ""))

    def _keeps_lowest_class(self, backend_id: str, change: str) -> None:
        """FleetConflict where taking `backend_id` out of service would leave the lowest tenant class
        (`gateway.tenants`) no language backend open to it (not kept for higher classes, `min_priority`)
        where it has one now. A file that serves that class nowhere (every backend kept) is the operator's."""
        lowest = self.config.settings.tenants.classes[0]
        out = {*self._drains, *self._removals}

        def open_to(without: set[str]) -> list[bool]:   # per language backend left: open to the lowest class
            return [b.min_priority is None or b.min_priority <= lowest for b in self.config.raw.backends
                    if b.id not in without and b.role in POOL_ROLES["language"]]

        left = open_to(out | {backend_id})   # none left at all: the language pool's own refusal says so
        if any(open_to(out)) and left and not any(left):
            raise FleetConflict(f"{change} {backend_id!r} would leave only backends kept for higher priority "
                                f"classes (min_priority): tenants of class {lowest} could be served nowhere")

    def reload_soon(self) -> None:
        """SIGHUP: `reload` in the background, after the change under way. A SIGHUP while a reload waits for
        its turn asks for nothing more: that reload has not read the file yet."""
        if not self._reload_queued:
            self._reload_queued = True
            self._keep(asyncio.create_task(self.reload(), name="fleet-reload"))

    async def reload(self) -> None:
        """Apply the difference between the backends file and the running fleet; a file that start-up
        would refuse, or any invalid change, is logged and changes nothing, and so does a file whose
        `backends:` are the running ones (quietly: that is no refusal, even where changes are refused)."""
        async with self.exclusive():
            self._reload_queued = False   # the file is read from here on: a SIGHUP now asks for one more reload
            await self._reload()

    async def _reload(self) -> None:
        path = self.config.path
        try:
            wanted = load_cluster(path, self.config.catalog)
            named = {b.id for b in wanted.raw.backends}
            scaled = [b for b in self.config.raw.backends if b.id in self._scaled and b.id not in named]
            target = self._validated([*wanted.raw.backends, *scaled])   # the scaler's engines stay
        except (ConfigError, RequestError) as exc:
            log.error("config_reload_refused", path=str(path), error=str(exc))
            return
        if wanted.raw.model_dump(exclude={"backends"}) != self.config.raw.model_dump(exclude={"backends"}):
            log.warning("config_reload_backends_only", path=str(path),
                        detail="only `backends:` is applied at runtime; the rest of the file is read at start-up")
        running = {b.id: b for b in self.config.raw.backends}
        specs = {b.id: b for b in target.raw.backends}
        gone = [i for i in running if i not in specs]
        changed = [i for i in running if i in specs and specs[i] != running[i]]
        # drained (not being removed) and still in the file: out and in again, serving as the file says
        restored = [i for i in running if i in specs and i not in changed and i in self._drains
                    and i not in self._removals]
        new = [i for i in specs if i not in running]
        if not (gone or changed or restored or new):
            log.info("config_reload_unchanged", path=str(path), detail="the file's backends are the fleet's: nothing "
                     "to change")
            return
        if self._refused is not None:
            log.error("config_reload_refused", path=str(path), error=self._refused)
            return
        rolling = self._rolling([*changed, *restored], {*gone, *changed, *restored})
        log.info("config_reload", path=str(path), added=new, removed=gone, replaced=changed, restored=restored,
                 one_at_a_time=rolling)
        changed += restored
        self._replacing.update(changed)
        at_once = [i for i in changed if i not in rolling]
        leaving = {backend_id: self._removals.get(backend_id) or self._start_removal(backend_id)
                   for backend_id in (*gone, *at_once)}
        for backend_id in new:
            self._apply_add(target, specs[backend_id])
        for backend_id in at_once:
            await leaving[backend_id]
            self._apply_add(target, specs[backend_id])
        for k, backend_id in enumerate(rolling):
            await (self._removals.get(backend_id) or self._start_removal(backend_id))
            self._apply_add(target, specs[backend_id])
            if k + 1 < len(rolling) and not await self._serves_again(backend_id):
                log.warning("config_reload_replacement_not_serving", backend=backend_id,
                            detail="not serving within its start timeout; the next one is replaced anyway")
        if len(rolling) == 1 and not self._serving_language(set()):
            log.warning("config_reload_gap", backend=rolling[0],
                        detail="the only backend serving language work was replaced: nothing serves until it is back")

    def _serving_language(self, leaving: set[str]) -> list[str]:
        """The backends serving language work now (heard from, or an upstream that answers), less `leaving`
        and those already draining or being removed."""
        table, out = self._runtime.table, {*leaving, *self._drains, *self._removals}
        return [b.id for b in self.config.raw.backends if b.role in POOL_ROLES["language"] and b.id not in out
                and (e := table.get(b.id)) is not None and (table.is_healthy(e) or table.answers_unheard(e))]

    def _rolling(self, changed: list[str], leaving: set[str]) -> list[str]:
        """The changed backends a reload replaces one at a time, each once its predecessor serves again: the
        serving language backends among them where no other would serve while they restart (all at once,
        the gateway would answer 503 until the first came back), else none."""
        if self._serving_language(leaving):
            return []
        serving = set(self._serving_language(set()))
        return [i for i in changed if i in serving]

    async def _serves_again(self, backend_id: str) -> bool:
        """Wait until a backend just added serves language work, for at most its engine's start timeout
        (managed), else the drain timeout; whether it does."""
        launcher = self._launchers.get(backend_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (launcher.start_timeout_s if launcher is not None else self._drain_timeout_s)
        while backend_id not in self._serving_language(set()):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(self._poll_s)
        return True

    async def close(self) -> None:
        """Stop the changes under way (the gateway is stopping)."""
        tasks = [*self._background, *self._removals.values(), *self._drains.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- how they are applied ----------------------------------------------------------------

    def _allowed(self) -> None:
        """The change may go on: it holds the fleet (`exclusive`) and this gateway takes changes."""
        if self._holder is None or self._holder is not asyncio.current_task():
            raise RuntimeError("a fleet change must hold the fleet: `async with fleet.exclusive()`")
        if self._refused is not None:
            raise FleetConflict(self._refused)

    def _known(self, backend_id: str) -> None:
        if not any(b.id == backend_id for b in self.config.raw.backends):
            raise BackendNotFound(f"no backend {backend_id!r} in the fleet")

    def _validated(self, backends: Sequence[BackendSpec]) -> ClusterConfig:
        """The running file with these backends, checked as start-up checks a file."""
        seen: set[str] = set()
        for b in backends:
            if b.id in seen:
                raise FleetConflict(f"duplicate backend id {b.id!r}")
            seen.add(b.id)
        raw = self.config.raw.model_copy(update={"backends": list(backends)})
        try:
            config = ClusterConfig(self.config.path, raw, self.config.catalog)
            check_launchable(config, self._own_ports)
        except ConfigError as exc:   # the words start-up would use, less the file's name (the change is not in it)
            raise InvalidRequest(_as_change(str(exc).removeprefix(f"{self.config.path}: ")),
                                 code="invalid_backend") from None
        if config.torch_weights is not None and config.torch_weights != self._weights:
            raise InvalidRequest("torch engines with other weights than the running ones (model_path / seed) need "
                                 "a restart: the gateway tokenises for the weights it started with",
                                 code="invalid_backend")
        return config

    def _apply_add(self, config: ClusterConfig, spec: BackendSpec) -> None:
        """`config`: a validated file holding `spec` (its GPU, upstream key and model are read there)."""
        runtime = self._runtime
        port, address = None, spec.address
        if isinstance(spec.launch, CommandLaunchSpec):
            port = spec.launch.port or free_port()
            address = managed_address(port)
        register_backend(runtime.table, config, spec, address)
        runtime.metrics.backend_added(spec.id)
        if spec.kind == "openai":
            runtime.upstreams[spec.id] = upstream_of(config, spec)
        if address is not None:
            runtime.clients.ensure(spec.id, address)
        index = runtime.pipeline.prefixes
        entry = runtime.table.get(spec.id)
        if index is not None and entry is not None:
            index_backend(index, runtime.table, config, entry)
        self._monitor.watch(config, spec, address if port is not None else None)
        if spec.launch is not None:   # every engine the gateway launches, as at start-up (managed_ids)
            self._identities.draw(spec.id)
        launcher = self._launch.launcher(config, spec, port)
        if launcher is not None:
            self._launchers[spec.id] = launcher
            if (supervisor := self._supervisor()) is not None:
                supervisor.add(launcher)
        self._set_backends([*(b for b in self.config.raw.backends if b.id != spec.id), spec])
        self._replacing.discard(spec.id)
        log.info("backend_added", backend=spec.id, kind=spec.kind, role=spec.role, gpu=spec.gpu,
                 managed=spec.launch is not None)

    def _set_backends(self, backends: list[BackendSpec]) -> None:
        self.config = self._runtime.config = self._validated(backends)
        self._runtime.had_encoders = self._runtime.had_encoders | has_encoders(self.config)

    def _drain_task(self, backend_id: str) -> asyncio.Task[None]:
        task = self._drains.get(backend_id)
        if task is None:
            self._runtime.table.drain(backend_id)
            task = self._drains[backend_id] = asyncio.create_task(self._drain(backend_id), name=f"drain-{backend_id}")
        return task

    async def _drain(self, backend_id: str) -> None:
        table = self._runtime.table
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._drain_timeout_s
        log.info("backend_draining", backend=backend_id)
        while (entry := table.get(backend_id)) is not None and (entry.in_flight or entry.vision_in_flight_tokens):
            if loop.time() >= deadline:
                log.warning("backend_drain_timeout", backend=backend_id, in_flight=entry.in_flight,
                            encoding_image_tokens=entry.vision_in_flight_tokens, timeout_s=self._drain_timeout_s)
                if backend_id in self._launchers or backend_id in self._removals:   # stopped or let go now
                    table.cut(backend_id)
                break
            await asyncio.sleep(self._poll_s)
        if self._launchers.pop(backend_id, None) is not None and (supervisor := self._supervisor()) is not None:
            await supervisor.remove(backend_id)
        log.info("backend_drained", backend=backend_id)

    def _busy(self, backend_id: str) -> bool:
        entry = self._runtime.table.get(backend_id)
        return entry is not None and bool(entry.in_flight or entry.vision_in_flight_tokens)

    def _start_removal(self, backend_id: str) -> asyncio.Task[None]:
        self._runtime.table.drain(backend_id)   # leaving from now on, not once the task runs: the next change sees it
        task = self._removals[backend_id] = asyncio.create_task(self._remove(backend_id), name=f"remove-{backend_id}")
        return task

    async def _remove(self, backend_id: str) -> None:
        try:
            drained = self._drains.get(backend_id)
            if drained is not None and drained.done() and self._busy(backend_id):
                # an earlier drain's time ran out and left its streams running: the removal gives them a
                # drain of their own, which cuts them (`backend_drained`) when its time runs out too
                del self._drains[backend_id]
            await self._drain_task(backend_id)
            await self._monitor.unwatch(backend_id)
            self._runtime.table.unregister(backend_id)
            if (index := self._runtime.pipeline.prefixes) is not None:
                index.remove_backend(backend_id)
            self._runtime.clients.put(backend_id, None)
            self._runtime.upstreams.pop(backend_id, None)
            self._runtime.metrics.forget_backend(backend_id)
            self._identities.forget(backend_id)   # its engine is stopped: the leader stops announcing it
            if backend_id not in self._replacing:   # else `_apply_add` puts its successor in its place
                self._set_backends([b for b in self.config.raw.backends if b.id != backend_id])
            log.info("backend_removed", backend=backend_id)
        finally:
            self._removals.pop(backend_id, None)
            self._drains.pop(backend_id, None)
            self._scaled.discard(backend_id)

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)
