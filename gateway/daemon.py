"""Runs one gateway process: gRPC server (control + front door), managed engines, HTTP door; stops them in order.

Both ports are bound before any engine is launched, and neither is shared (no SO_REUSEPORT): a
second gateway pointed at a taken port exits with an error naming it, launches nothing, and leaves
the first one serving. The exception is `--workers` (gateway/replicas/workers.py): its processes bind both
ports with SO_REUSEPORT on purpose. With Redis (`--redis-url`) the process joins its replicas
(gateway/replicas/replica.py) and runs the managed engines only while it holds the leader lease; the
replicas on one host also share one more control port, for the managed engines only (SO_REUSEPORT,
its number agreed through Redis; `--workers` share theirs already), so that an engine whose replica
dies heartbeats to another at once and outlives it (gateway/control/adoption.py).
"""

from __future__ import annotations

import asyncio
import gc
import signal
import socket
import ssl
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import grpc
import httpx
import structlog
from redis.exceptions import AuthenticationError, RedisError, ResponseError

from common import tracing
from common.errors import HeteroGateError
from common.grpc_keepalive import keepalive
from gateway.config.auth import KeyRing
from gateway.config.autoscaling import POOL_ROLES
from gateway.config.cluster import ClusterConfig, LaunchSpec
from gateway.control.adoption import find_adoptable
from gateway.control.autoscaler import Autoscaler
from gateway.control.control_auth import ControlAuth, is_loopback
from gateway.control.fleet import Fleet
from gateway.control.heartbeat_service import ControlService, add_control_service
from gateway.control.launchers import (
    LaunchContext,
    build_launchers,
    check_launchable,
    managed_address,
    managed_ports,
)
from gateway.control.supervisor import Supervisor
from gateway.control.upstream_monitor import PROBE_TIMEOUT_S, UpstreamMonitor, make_probe
from gateway.doors.grpc_door import InferenceService, add_front_door
from gateway.doors.routes import create_server
from gateway.doors.tls import GrpcTls, http_ssl_context, load_grpc_tls
from gateway.replicas.leadership import Supervision
from gateway.replicas.replica import Replication, join
from gateway.replicas.shared_state import redacted
from gateway.replicas.workers import reuse_port_socket
from gateway.runtime import Runtime, build_runtime, needs_vision_pool

# The youngest generation is collected once 10,000 more objects were allocated than freed, not 700: what
# a collection walks is mostly the requests in flight, however long the wait before it, so fewer
# collections cost less in all (kind: openai in front of fast engines, c=64: 4% of the CPU a request).
GC_THRESHOLDS = (10_000, 20, 20)

log = structlog.get_logger("gateway")


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50061
    policy: str | None = None
    log_level: str = "info"
    engine_log_level: str = "warning"
    redis_url: str | None = None     # replicas share state through this Redis
    reuse_port: bool = False         # SO_REUSEPORT on both doors (`--workers`)


class CannotStart(HeteroGateError):
    """Start-up stops before any engine is launched: the gateway exits with this message."""


class PortUnavailable(CannotStart):
    """A port the gateway must listen on cannot be bound (taken, or not allowed)."""


class RedisUnreachable(CannotStart):
    """`--redis-url` given and Redis does not answer at start-up: a replica that cannot reach it could
    never lead or launch the engines, and would serve nothing while looking alive."""


REDIS_START_WAIT_S = 10.0   # how long start-up tries to reach Redis (it may be starting beside the gateway)


def bind_http(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    try:
        return reuse_port_socket(host, port) if reuse_port else socket.create_server((host, port), backlog=2048)
    except OSError as exc:
        raise PortUnavailable(f"cannot bind the HTTP port {host}:{port}: {exc.strerror or exc}") from None


async def start_control(
    runtime: Runtime, host: str, port: int, auth: ControlAuth | None = None, tls: GrpcTls | None = None,
    reuse_port: bool = False, front_door: bool = True,
) -> tuple[grpc.aio.Server, int, InferenceService | None]:
    # The gRPC door's request cap is the HTTP door's body cap (gRPC's own default is 4 MiB).
    # No SO_REUSEPORT (but for --workers): with it, a second gateway would bind the same port and take
    # half the heartbeats.
    # Clients that keep a stream open and ping it (common/grpc_keepalive.py) are not cut off as abusers.
    max_bytes = runtime.limits.max_body_bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_bytes),
                                      ("grpc.so_reuseport", int(reuse_port)), *keepalive().server_options()])
    service = ControlService(runtime.signals, auth=auth)
    add_control_service(server, service)
    door = await add_front_door(server, runtime) if front_door else None
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    except RuntimeError:   # grpcio ≥ 1.60 raises instead of returning 0
        bound = 0
    if bound == 0:
        await server.stop(None)
        raise PortUnavailable(f"cannot bind the control gRPC port {host}:{port}: address in use or not allowed")
    await server.start()
    return server, bound, door


def local_control_host(grpc_host: str) -> str:
    """Where engines on this host dial the control port: loopback when it listens on every interface."""
    return "127.0.0.1" if grpc_host in ("0.0.0.0", "::", "[::]", "") else grpc_host


def engines_silent(runtime: Runtime, ids: list[str]) -> Callable[[Collection[str]], bool]:
    """None of the managed backends but the adopted ones heartbeats (a new leader waits for this
    before launching)."""
    table = runtime.table
    return lambda adopted: not any(
        (e := table.get(i)) is not None and table.is_healthy(e) for i in ids if i not in adopted)


async def start_engines_port(
    runtime: Runtime, replication: Replication, host: str, auth: ControlAuth, tls: GrpcTls | None,
) -> tuple[grpc.aio.Server, str] | None:
    """The control port that every replica on this host binds for the managed engines (SO_REUSEPORT,
    Control service only), and its address; None, with a warning, when it cannot be agreed or bound
    (the engines then heartbeat to their leader only, and stop with it as a single gateway's do)."""
    try:
        port = await replication.engines_port(host)
        server, _, _ = await start_control(runtime, host, port, auth, tls, reuse_port=True, front_door=False)
    except (RedisError, OSError, TimeoutError, PortUnavailable) as exc:
        log.warning("engines_port_unavailable", error=str(exc) or repr(exc),
                    detail="managed engines heartbeat to their leader only and stop when it dies")
        return None
    return server, f"{host}:{port}"


def managed_ids(config: ClusterConfig) -> list[str]:
    """The backends the gateway launches (`launch:`)."""
    return [s.id for s in config.raw.backends if s.launch is not None]


@dataclass(frozen=True)
class StartupChecks:
    """What start-up reads from the configuration and the environment before it binds a port."""

    grpc_tls: GrpcTls | None
    ssl_context: ssl.SSLContext | None
    auth: ControlAuth
    warnings: tuple[str, ...]   # allowed, but worth an operator's attention


def check_startup(config: ClusterConfig, options: ServeOptions) -> StartupChecks:
    """Every check start-up makes before it binds a port (API keys, certificates, the control port's
    token for these options); ConfigError naming the setting. `gateway check-config` runs this same
    function, so its OK means that start-up accepts the file with these options."""
    settings = config.settings
    tracing.check()   # the OTEL_* variables (common/tracing.py): a bad exporter or sampler stops start-up
    check_launchable(config, own_ports(options))
    keys = KeyRing.load(settings.auth, settings.tenants)
    grpc_tls = load_grpc_tls(settings.tls)
    ssl_context = http_ssl_context(settings.tls)
    # A replica launches the engines only once it leads; a single gateway from the start.
    auth = ControlAuth.load(
        settings.auth, managed=managed_ids(config), api_keys_on=keys.enabled, control_host=options.grpc_host,
        ca_file=grpc_tls.ca_file if grpc_tls else None, launching=options.redis_url is None,
        agents=[s.id for s in config.raw.backends if s.agent],
    )
    warnings = []
    if not keys.enabled and not is_loopback(options.host):
        warnings.append(f"the HTTP door listens on {options.host}, beyond loopback, with no API keys: whoever "
                        "reaches it may send requests, read /admin and /metrics, and add, drain and remove backends "
                        "(gateway.auth.api_keys_file or api_keys_env turns keys on, admin_keys_file or "
                        "admin_keys_env guards the admin routes)")
    if keys.enabled and not keys.admin:
        warnings.append("API keys are on (gateway.auth or gateway.tenants) and no admin key is set: every key gets "
                        "403 on /metrics, /admin/* and /dashboard, so nothing can scrape or change this gateway "
                        "(gateway.auth.admin_keys_file or admin_keys_env sets admin keys)")
    warnings += autoscaling_warnings(config) + image_warnings(config)
    if settings.autoscaling.mode == "manage" and options.redis_url is not None:
        warnings.append("gateway.autoscaling.mode is manage, but with replicas (--redis-url or gateway.redis.url) "
                        "the fleet is fixed: the scaler adds and removes no engine, it only exports its counts "
                        "on /metrics, as mode export does")
    return StartupChecks(grpc_tls, ssl_context, auth, tuple(warnings))


def own_ports(options: ServeOptions) -> frozenset[int]:
    """The ports this gateway listens on that a backend must not take (0: any free one, none to keep)."""
    return frozenset(p for p in (options.port, options.grpc_port) if p)


def autoscaling_warnings(config: ClusterConfig) -> list[str]:
    """Pools a managing scaler can never bring to their `max` (each new engine takes a GPU of the pool's
    inventory), or that start above it (it removes only the engines it added): valid, but likely not what
    was meant; `gateway check-config` prints them."""
    scaling = config.settings.autoscaling
    out = []
    for pool, bounds in scaling.scaled().items() if scaling.mode == "manage" else ():
        now = sum(1 for b in config.raw.backends if b.role in POOL_ROLES[pool])
        reachable = now + len(bounds.gpus)
        if reachable < bounds.max:
            out.append(f"gateway.autoscaling.pools.{pool}: max is {bounds.max}, but {now} engine(s) now and "
                       f"{len(bounds.gpus)} GPU(s) in its `gpus:` inventory make at most {reachable}")
        if now > bounds.max:
            out.append(f"gateway.autoscaling.pools.{pool}: {now} engines at start-up, above max {bounds.max}: "
                       "the scaler removes only engines it added, so the pool stays above max")
    return out


def image_warnings(config: ClusterConfig) -> list[str]:
    """Models that take images where no backend encodes them (their image requests get 400), and vision
    backends no language backend of their model sends images to (they encode nothing): valid, a fleet
    may serve a vision model text only, but likely not what was meant."""
    out = []
    for served in config.models.models.values():
        if served.profile.vision is None:
            continue
        if not config.encodes_images(served.name):
            out.append(f"model {served.name!r} takes images, but no backend encodes them for it (role vision or "
                       "both, or a kind: openai upstream without image_embeds): its image requests get 400")
        encoders = [b.id for b in config.raw.backends if b.role == "vision" and served in config.backend_models[b.id]]
        if encoders and not needs_vision_pool(config, model=served.name):
            out.append(f"vision backend(s) {', '.join(encoders)} of model {served.name!r} encode nothing: every "
                       "language backend of it takes images itself (role both, or a kind: openai upstream without "
                       "image_embeds)" + ("; those with steal: true still take language work" if any(
                           b.steal for b in config.raw.backends if b.id in encoders) else ""))
    return out


async def serve(config: ClusterConfig, options: ServeOptions, checks: StartupChecks | None = None) -> None:
    """Secrets and certificates are read (`check_startup`, unless given its result), and both ports
    bound, before any engine is launched."""
    checks = checks or check_startup(config, options)
    for warning in checks.warnings:
        log.warning("start_up_warning", detail=warning)
    grpc_tls, ssl_context, auth = checks.grpc_tls, checks.ssl_context, checks.auth
    ports = managed_ports(config)
    addresses = {backend_id: managed_address(port) for backend_id, port in ports.items()}
    runtime = build_runtime(config, options.policy, addresses)
    managed = managed_ids(config)
    replication: Replication | None = None
    try:
        replication = join(runtime, options.redis_url, auth.identities) if options.redis_url else None
        if replication is not None:   # on every line this process logs from now on, each request's included
            structlog.contextvars.bind_contextvars(replica=replication.replica_id)
            try:
                await replication.reachable(REDIS_START_WAIT_S)
            except (AuthenticationError, ResponseError) as exc:
                hint = (" (a Redis that asks for a password takes it in the URL: redis://:PASSWORD@HOST:PORT/0)"
                        if isinstance(exc, AuthenticationError) else "")
                raise RedisUnreachable(f"Redis at {redacted(options.redis_url or '')} refused this gateway: "
                                       f"{exc}{hint}") from None
            except (RedisError, OSError, TimeoutError) as exc:
                raise RedisUnreachable(f"cannot reach Redis at {redacted(options.redis_url or '')} within "
                                       f"{REDIS_START_WAIT_S:g} s: {str(exc) or repr(exc)}") from None
        # From here on Ctrl-C and SIGTERM are a graceful stop, the start-up finishing first. A Ctrl-C before
        # this (asyncio's own handler: the task is cancelled at its next await) is taken at the sleep, before
        # any server exists: landing in the gRPC server's start, it left the server to shut itself down in
        # the closing loop, an error with a traceback (one Ctrl-C in four in the second after start).
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await asyncio.sleep(0)
        http_socket = bind_http(options.host, options.port, options.reuse_port)
        try:
            control, grpc_port, grpc_door = await start_control(
                runtime, options.grpc_host, options.grpc_port, auth, grpc_tls, options.reuse_port)
        except BaseException:
            http_socket.close()
            raise
    except BaseException:
        if replication is not None:
            await replication.close()
        await runtime.close()
        raise
    control_address = f"{local_control_host(options.grpc_host)}:{grpc_port}"
    # Replicas: engines heartbeat to a port every replica here shares, then outlive their leader.
    shared = options.reuse_port and replication is not None   # --workers: the control port itself
    engines_door = None
    if replication is not None and not options.reuse_port:
        engines_door, engines_address = await start_engines_port(
            runtime, replication, local_control_host(options.grpc_host), auth, grpc_tls) or (None, "")
        if engines_door is not None:
            control_address, shared = f"{engines_address},{control_address}", True
    adoptable = [s.id for s in config.raw.backends if isinstance(s.launch, LaunchSpec)] if shared else []
    probes = httpx.AsyncClient(timeout=httpx.Timeout(PROBE_TIMEOUT_S), follow_redirects=True, trust_env=False)
    launch = LaunchContext(control_address, runtime.table, make_probe(probes), options.engine_log_level,
                           engine_env=auth.engine_env,
                           orphan_timeout_s=config.settings.redis.engine_orphan_s if shared else None)
    upstreams = UpstreamMonitor(config, runtime.table, addresses, probes, runtime.pipeline.prefixes)
    fleet = Fleet(runtime, launch, build_launchers(config, ports, launch),
                  lambda: s if isinstance(s := supervision.supervisor, Supervisor) else None, upstreams,
                  auth.identities, drain_timeout_s=config.settings.drain_timeout_s, own_ports=own_ports(options),
                  refused=None if replication is None else "the fleet cannot change at runtime while replicas share "
                  "state (--redis-url): restart the replicas with the new backends file")
    async def hand_over() -> bool:
        """Engines that outlive this replica, and another replica seen to adopt them (a rolling restart):
        their heartbeats move to it first (this replica's ports close, the requests drained: they reconnect
        to the engines' port it shares), as it adopts only engines it hears: a replica on this host. Not
        `--workers`, which stop together (the engines would outlive them all until `engine_orphan_s`)."""
        if options.reuse_port or not (adoptable and replication is not None and replication.shared.up
                                      and replication.shared.peers_on(socket.gethostname())):
            return False
        await asyncio.gather(*(door.stop(grace=1.0) for door in (engines_door, control) if door is not None))
        return True

    supervision = Supervision(
        lambda adopted: Supervisor(fleet.launchers(), on_state=runtime.table.set_lifecycle,
                                   stop_timeout_s=max(2.0, config.settings.engine_stop_timeout_s), adopted=adopted,
                                   on_launch=auth.identities.launched, on_exit=runtime.table.note_exit,
                                   on_spawn=runtime.table.note_process),
        replication.lease if replication else None, engines_silent(runtime, managed),
        takeover_wait_s=config.settings.engine_start_timeout_s, clock=time.monotonic,
        on_term=auth.identities.set_launching,
        adopt=lambda taken: find_adoptable(runtime.table, [b for b in adoptable if b not in taken],
                                           auth.identities.verify),
        hand_over=hand_over)
    # gateway.autoscaling: the pools' desired sizes on /metrics; applied through the fleet in manage mode
    # (not with replicas, whose fleet is fixed)
    scaling = config.settings.autoscaling
    autoscaler = None if scaling.mode == "off" else Autoscaler(runtime, None if replication else fleet, scaling)
    if autoscaler is not None:
        runtime.metrics.registry.register(autoscaler.collector())
    server = create_server(runtime, config.settings.keep_alive.client_idle_s, ssl_context, fleet)
    # Start-up objects live for the whole run: keep them out of every collection (GC was ~8% of CPU).
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    def reload() -> None:   # the API key files read again, and backends.yaml's `backends:` applied again
        runtime.reload_keys()
        fleet.reload_soon()

    loop.add_signal_handler(signal.SIGHUP, reload)
    log.info("gateway_starting", http=f"{options.host}:{options.port}", control=f"{options.grpc_host}:{grpc_port}",
             policy=runtime.pipeline.policy.name, backends=len(config.raw.backends), model=config.served_model_name,
             replica=replication.replica_id if replication else None)
    await server.start(http_socket)
    monitor = asyncio.create_task(upstreams.run(stop))
    drained = asyncio.Event()   # engines, the leader lease and shared counts outlive the drain
    supervising = asyncio.create_task(supervision.run(drained))
    sharing = asyncio.create_task(runtime.signals.run(drained))
    autoscaling = asyncio.create_task(autoscaler.run(stop)) if autoscaler else None
    try:
        await stop.wait()
    finally:
        log.info("gateway_stopping")
        stop.set()
        if autoscaling is not None:   # it may wait for the fleet behind a reload: no step is cut halfway (none awaits)
            autoscaling.cancel()
            await asyncio.gather(autoscaling, return_exceptions=True)
        drain_s = config.settings.drain_timeout_s   # both doors' requests finish, or are told why not
        await asyncio.gather(server.stop(drain_s), grpc_door.drain(drain_s) if grpc_door else asyncio.sleep(0))
        await fleet.close()
        await monitor
        # The engines' streams close from this side before the engines are stopped: an engine that
        # stops under an open Session stream logs the cancellation as an error.
        await runtime.clients.close()
        drained.set()
        await supervising
        await sharing
        await probes.aclose()
        await control.stop(grace=1.0)
        if engines_door is not None:
            await engines_door.stop(grace=1.0)
        if replication is not None:
            await replication.close()
        await runtime.close()
        log.info("gateway_stopped")
