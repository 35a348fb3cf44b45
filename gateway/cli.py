"""`gateway --backends backends.yaml`: the command line."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from gateway.config import DEFAULT_BACKENDS, load_cluster
from gateway.errors import ConfigError
from gateway.logs import configure_logging
from gateway.policies import REGISTRY
from gateway.server import ServeOptions, serve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gateway", description="HeteroGate: the front door of a heterogeneous GPU cluster")
    p.add_argument("--backends", type=Path, default=DEFAULT_BACKENDS,
                   help="backends.yaml (default: the embedded demo cluster, configs/backends.yaml)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--grpc-host", default="127.0.0.1", help="control gRPC listen address (backends heartbeat here)")
    p.add_argument("--grpc-port", type=int, default=50061, help="control gRPC port (0 = any free port)")
    p.add_argument("--policy", choices=sorted(REGISTRY), help="routing policy (default: the config's)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--engine-log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = load_cluster(args.backends)
    except ConfigError as exc:
        print(f"gateway: invalid configuration\n{exc}", file=sys.stderr)
        raise SystemExit(2) from None
    options = ServeOptions(
        host=args.host, port=args.port, grpc_host=args.grpc_host, grpc_port=args.grpc_port,
        policy=args.policy, log_level=args.log_level, engine_log_level=args.engine_log_level,
    )
    run(serve(config, options))


def run(main_coro: object) -> None:
    """asyncio.run on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coro)  # type: ignore[arg-type]
    else:
        uvloop.run(main_coro)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
