"""`gateway --backends backends.yaml`: the command line.

`gateway check-config FILE [OPTIONS]` runs every check start-up makes for that file and those options
(the same function, `validate`) without starting anything, so a deployment can reject a bad file or
a missing secret before it replaces a running gateway."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common import __version__
from common.errors import ConfigError
from common.one_line_parser import OneLineParser, port, positive_int

# `gateway --version` answers before the gateway's modules are imported (they take seconds to load):
# each function below imports what it needs.
if TYPE_CHECKING:
    from gateway.config.cluster import ClusterConfig
    from gateway.config.sections import RedisConfig
    from gateway.daemon import ServeOptions, StartupChecks

CHECK_CONFIG = "check-config"
PLAN = "plan"   # which GPUs in which roles for a workload: loadtest/planner/cli.py
DEMO_UPSTREAM = "demo-upstream"   # a mock OpenAI-compatible engine: gateway/demo_upstream.py


def add_gateway_options(p: argparse.ArgumentParser, backends_default: Path | None) -> None:
    """The options of `gateway`, which `gateway check-config` takes too: its checks depend on them."""
    from gateway.config.cluster import shipped_clusters
    from gateway.routing.policies import REGISTRY

    p.add_argument("--backends", type=cluster_file, default=backends_default, metavar="FILE|NAME",
                   help="backends.yaml, or the name of a cluster the package ships: "
                        f"{', '.join(shipped_clusters())} (default: backends, the embedded demo cluster)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default: %(default)s)")
    p.add_argument("--port", type=port, default=8000, help="HTTP port (default: %(default)s)")
    p.add_argument("--grpc-host", default="127.0.0.1",
                   help="control gRPC listen address (backends heartbeat here; default: %(default)s)")
    p.add_argument("--grpc-port", type=port, default=50061,
                   help="control gRPC port (0 = any free port; default: %(default)s)")
    p.add_argument("--policy", choices=sorted(REGISTRY), help="routing policy (default: the config's)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="(default: %(default)s)")
    p.add_argument("--engine-log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="managed engines' log level (default: %(default)s)")
    p.add_argument("--redis-url", help="share cluster state with other replicas through this Redis "
                   "(default: gateway.redis.url; none: one process, state in memory)")
    p.add_argument("--workers", type=positive_int, default=1, help="gateway processes on this host (> 1 needs Redis)")
    p.add_argument("--reuse-port", action="store_true", help="bind both doors with SO_REUSEPORT (set by --workers)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # No abbreviations: a worker's command line is the parent's less `--workers`, and `--worker 2` (argparse
    # read it as --workers) stayed in it, so every worker started workers of its own, without end.
    p = OneLineParser(prog="gateway", allow_abbrev=False,
                      description="HeteroGate: the front door of a heterogeneous GPU cluster",
                      epilog=f"`gateway {CHECK_CONFIG} FILE [OPTIONS]` runs start-up's checks and exits; "
                             f"`gateway {PLAN} --help`: which GPUs in which roles for a workload; "
                             f"`gateway {DEMO_UPSTREAM} --help`: a mock OpenAI-compatible engine to "
                             "try the gateway in front of")
    p.add_argument("--version", action="version", version=f"heterogate {__version__}")
    from gateway.config.cluster import DEFAULT_BACKENDS

    add_gateway_options(p, DEFAULT_BACKENDS)
    return p.parse_args(argv)


def cluster_file(text: str) -> Path:
    from gateway.config.cluster import find_cluster

    try:
        return find_cluster(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_redis_url(config: RedisConfig, url: str) -> None:
    """ConfigError unless start-up's client takes `url` (scheme, host, port); no connection is made."""
    from gateway.replicas.shared_state import connect, redacted

    try:
        connect(config, url)   # a client object only: it connects on its first command
    except ValueError as exc:
        raise ConfigError(f"--redis-url (or gateway.redis.url): {redacted(url)!r} is no Redis URL redis-py reads "
                          f"({exc}); it looks like redis://[user:password@]host:port/db, rediss://... or "
                          "unix:///path") from None


def parse_check_config_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(
        prog=f"gateway {CHECK_CONFIG}",
        description="run every check start-up makes (the file, its secrets and certificates, the control "
                    "port's token for these options) without starting anything; the options are the gateway's")
    p.add_argument("file", type=cluster_file, nargs="?", metavar="FILE|NAME",
                   help="the backends.yaml to check, or a shipped cluster's name (or --backends FILE|NAME)")
    add_gateway_options(p, None)
    args = p.parse_args(argv)
    if (args.file is None) == (args.backends is None):
        p.error("give the file to check once: as FILE or as --backends FILE")
    args.backends = args.backends or args.file
    return args


@dataclass(frozen=True)
class Validated:
    config: ClusterConfig
    options: ServeOptions
    checks: StartupChecks


def validate(args: argparse.Namespace) -> Validated:
    """Start-up's checks for these arguments; `gateway check-config` runs this same function, so an OK
    there means the gateway starts. Exit status 2 with the ConfigError (which names the file and
    setting) on stderr: no traceback for a configuration mistake."""
    from gateway.config.cluster import load_cluster
    from gateway.daemon import ServeOptions, check_startup

    try:
        config = load_cluster(args.backends)
        redis_url = args.redis_url or config.settings.redis.url
        if redis_url is not None:
            check_redis_url(config.settings.redis, redis_url)
        check_workers(args.workers, redis_url, args.port, args.grpc_port)
        options = ServeOptions(
            host=args.host, port=args.port, grpc_host=args.grpc_host, grpc_port=args.grpc_port,
            policy=args.policy, log_level=args.log_level, engine_log_level=args.engine_log_level,
            redis_url=redis_url, reuse_port=args.reuse_port,
        )
        return Validated(config, options, check_startup(config, options))
    except ConfigError as exc:
        print(f"gateway: invalid configuration\n{exc}", file=sys.stderr)
        raise SystemExit(2) from None


def check_config(argv: list[str]) -> None:
    checked = validate(parse_check_config_args(argv))
    for warning in checked.checks.warnings:
        print(f"gateway: warning: {warning}", file=sys.stderr)
    config = checked.config
    models = ", ".join(config.models.models)
    print(f"{config.path}: OK ({'models' if len(config.models) > 1 else 'model'} {models}, "
          f"{len(config.raw.backends)} backend{'' if len(config.raw.backends) == 1 else 's'})")


def main(argv: list[str] | None = None) -> None:
    """The console script. Ctrl-C before the gateway's own signal handling is in place (imports, the
    checks, a second of start-up) ends it with one line and status 130, not a traceback; past that,
    SIGINT is a graceful stop like SIGTERM."""
    try:
        _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        print("gateway: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


@contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Ctrl-C while the gateway's modules load is noted and raised once they have: a KeyboardInterrupt
    inside an extension module's initialisation (grpc's Cython core) comes out as an ImportError with a
    traceback that `main` cannot tell from a broken install. An ignored SIGINT (a background job) stays so."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    pressed: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


def _main(argv: list[str]) -> None:
    # The subcommand is peeled off before argparse so that `gateway --backends X` keeps parsing exactly as before.
    if argv[:1] == ["--version"]:   # before anything heavy is imported
        print(f"heterogate {__version__}")
        return
    if argv[:1] == [CHECK_CONFIG]:
        check_config(argv[1:])
        return
    if argv[:1] == [PLAN]:
        with ctrl_c_deferred():
            from loadtest.planner.cli import main as plan  # the simulator and numpy: loaded for this subcommand only

        raise SystemExit(plan(argv[1:]))
    if argv[:1] == [DEMO_UPSTREAM]:
        with ctrl_c_deferred():
            from gateway import demo_upstream  # only this subcommand needs it

        demo_upstream.main(argv[1:])
        return
    with ctrl_c_deferred():
        from common.event_loop import run
        from common.logs import configure_logging
        from gateway.daemon import CannotStart, serve
        from gateway.replicas.workers import CANNOT_START, WORKER_ENV, run_workers

    args = parse_args(argv)
    configure_logging(args.log_level)
    checked = validate(args)
    if args.workers > 1:   # each worker runs these checks again, and `serve`
        if code := run(run_workers(argv, args.workers)):
            raise SystemExit(code)
        return
    try:
        run(serve(checked.config, checked.options, checked.checks))
    except CannotStart as exc:   # nothing was launched: the ports are bound and Redis reached first
        print(f"gateway: cannot start: {exc}", file=sys.stderr)
        raise SystemExit(CANNOT_START if os.environ.get(WORKER_ENV) else 1) from None


def check_workers(workers: int, redis_url: str | None, port: int, grpc_port: int) -> None:
    """Workers share state only through Redis and share ports only when the ports are fixed; a worker
    starts none of its own."""
    from gateway.replicas.workers import WORKER_ENV

    if workers > 1 and os.environ.get(WORKER_ENV):
        raise ConfigError(f"--workers {workers} in a worker: a worker starts no workers of its own")
    if workers > 1 and redis_url is None:
        raise ConfigError(f"--workers {workers} needs Redis (--redis-url or gateway.redis.url): "
                          "worker processes share cluster state only through it")
    if workers > 1 and (port == 0 or grpc_port == 0):
        raise ConfigError("--workers needs fixed --port and --grpc-port (the workers share them with SO_REUSEPORT)")


if __name__ == "__main__":
    main()
