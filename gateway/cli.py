"""`gateway --backends backends.yaml`: the command line.

`gateway check-config FILE` validates a backends.yaml without starting anything, so a deployment can
reject a bad file before it replaces a running gateway."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import __version__
from common.errors import ConfigError
from common.event_loop import run
from common.logs import configure_logging
from gateway.config.cluster import DEFAULT_BACKENDS, ClusterConfig, load_cluster
from gateway.daemon import PortUnavailable, ServeOptions, serve
from gateway.replicas.workers import run_workers
from gateway.routing.policies import REGISTRY

CHECK_CONFIG = "check-config"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gateway",
                                description="HeteroGate: the front door of a heterogeneous GPU cluster",
                                epilog=f"`gateway {CHECK_CONFIG} FILE` validates a backends.yaml and exits")
    p.add_argument("--version", action="version", version=f"heterogate {__version__}")
    p.add_argument("--backends", type=Path, default=DEFAULT_BACKENDS,
                   help="backends.yaml (default: the embedded demo cluster, configs/backends.yaml)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--grpc-host", default="127.0.0.1", help="control gRPC listen address (backends heartbeat here)")
    p.add_argument("--grpc-port", type=int, default=50061, help="control gRPC port (0 = any free port)")
    p.add_argument("--policy", choices=sorted(REGISTRY), help="routing policy (default: the config's)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--engine-log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--redis-url", help="share cluster state with other replicas through this Redis "
                   "(default: gateway.redis.url; none: one process, state in memory)")
    p.add_argument("--workers", type=positive_int, default=1, help="gateway processes on this host (> 1 needs Redis)")
    p.add_argument("--reuse-port", action="store_true", help="bind both doors with SO_REUSEPORT (set by --workers)")
    return p.parse_args(argv)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def parse_check_config_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"gateway {CHECK_CONFIG}",
                                description="validate a backends.yaml without starting the gateway")
    p.add_argument("file", type=Path, help="the backends.yaml to validate")
    return p.parse_args(argv)


def load_or_exit(path: Path) -> ClusterConfig:
    """Exit status 2 with the ConfigError (which names the file and field) on stderr: no traceback for a
    configuration mistake."""
    try:
        return load_cluster(path)
    except ConfigError as exc:
        print(f"gateway: invalid configuration\n{exc}", file=sys.stderr)
        raise SystemExit(2) from None


def check_config(argv: list[str]) -> None:
    """Runs the same validation as start-up, so an OK here means the gateway will accept the file."""
    config = load_or_exit(parse_check_config_args(argv).file)
    print(f"{config.path}: OK (model {config.raw.model}, {len(config.raw.backends)} backends)")


def main(argv: list[str] | None = None) -> None:
    # The subcommand is peeled off before argparse so that `gateway --backends X` keeps parsing exactly as before.
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [CHECK_CONFIG]:
        check_config(argv[1:])
        return
    args = parse_args(argv)
    configure_logging(args.log_level)
    config = load_or_exit(args.backends)
    redis_url = args.redis_url or config.settings.redis.url
    if args.workers > 1:
        check_workers(args.workers, redis_url, args.port, args.grpc_port)
        run(run_workers(argv, args.workers))
        return
    options = ServeOptions(
        host=args.host, port=args.port, grpc_host=args.grpc_host, grpc_port=args.grpc_port,
        policy=args.policy, log_level=args.log_level, engine_log_level=args.engine_log_level,
        redis_url=redis_url, reuse_port=args.reuse_port,
    )
    try:
        run(serve(config, options))
    except PortUnavailable as exc:   # nothing was launched: the ports are bound first
        print(f"gateway: cannot start: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except ConfigError as exc:   # a secret or certificate the config names, read at start-up
        print(f"gateway: invalid configuration\n{exc}", file=sys.stderr)
        raise SystemExit(2) from None


def check_workers(workers: int, redis_url: str | None, port: int, grpc_port: int) -> None:
    """Workers share state only through Redis and share ports only when the ports are fixed."""
    problem = None
    if redis_url is None:
        problem = (f"--workers {workers} needs Redis (--redis-url or gateway.redis.url): "
                   "worker processes share cluster state only through it")
    elif port == 0 or grpc_port == 0:
        problem = "--workers needs fixed --port and --grpc-port (the workers share them with SO_REUSEPORT)"
    if problem:
        print(f"gateway: {problem}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
