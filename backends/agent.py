"""Heartbeat agent for an engine the gateway does not launch (vLLM, SGLang, TensorRT-LLM).

    heterogate-agent --engine vllm --address http://127.0.0.1:8001 --backend-id h100-ext-0 \
        --gpu H100 --model llava-1.5-7b --gateway 127.0.0.1:50061 [--metrics-url URL] [--interval-ms 200] \
        [--token-file /etc/heterogate/cluster-token] [--ca-file /etc/heterogate/ca.crt]

The cluster token comes from --token-file, else from $HETEROGATE_CLUSTER_TOKEN; --ca-file (or
$HETEROGATE_CONTROL_CA) makes the control stream TLS, trusting that CA.

Polls the engine's Prometheus endpoint every interval and pushes the result on the gateway's Control
stream (`common.engine_scraper`), with the context length the engine lists in `GET /v1/models`.
The heartbeat's `address` is the engine's base URL (scheme included): the gateway forwards OpenAI HTTP
there.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

import httpx
import structlog

from common.catalog import CONFIG_DIR, GpuProfile, ModelProfile, load_catalog
from common.control_credentials import ControlCredentials, read_secret_file
from common.engine_scraper import AgentConfig, MetricsAgent, make_client
from common.errors import ConfigError
from common.logs import configure_logging
from common.metric_tables import TABLES
from common.one_line_parser import OneLineParser, positive_float, positive_int, targets

log = structlog.get_logger("agent")


# -- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="heterogate-agent", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--engine", required=True, choices=sorted(TABLES))
    p.add_argument("--address", required=True, help="engine base URL the gateway forwards to, e.g. http://10.0.0.5:8000")
    p.add_argument("--metrics-url", help="Prometheus endpoint (default: address + the engine's metrics path)")
    p.add_argument("--backend-id", required=True)
    p.add_argument("--gpu", required=True, help="GPU catalog name, e.g. H100")
    p.add_argument("--catalog", type=Path, default=CONFIG_DIR,
                   help="catalog folder (gpus.yaml, models.yaml) of the GPU and model (default: the built-in one)")
    p.add_argument("--model", required=True, help="model catalog name, e.g. llava-1.5-7b")
    p.add_argument("--gateway", required=True, type=targets,
                   help="host:port of the gateway's control (gRPC) service; several, comma-separated, fail over")
    p.add_argument("--role", choices=["language", "vision", "both"], default="language")
    p.add_argument("--interval-ms", type=int, default=200, help="scrape interval (the gateway sets the heartbeat's)")
    p.add_argument("--kv-total-tokens", type=positive_int,
                   help="KV capacity in tokens where the engine's metrics give none (else a model estimate)")
    p.add_argument("--upstream-model", help="model whose max_model_len in /v1/models counts (default: the first)")
    p.add_argument("--scrape-timeout-s", type=positive_float, default=2.0)
    p.add_argument("--token-file", type=Path, help="cluster token (default: $HETEROGATE_CLUSTER_TOKEN)")
    p.add_argument("--ca-file", type=Path, help="CA of a TLS control port (default: $HETEROGATE_CONTROL_CA)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    if httpx.URL(args.address).scheme not in ("http", "https"):
        p.error(f"--address must be an http(s) URL, got {args.address!r}")
    if args.interval_ms <= 0:
        p.error("--interval-ms must be positive")
    return args


def credentials_from_args(args: argparse.Namespace) -> ControlCredentials:
    """ConfigError (naming the flag or variable) for a token or CA file that cannot be read."""
    env = ControlCredentials.from_env()
    token = read_secret_file(args.token_file, "--token-file") if args.token_file else env.token
    ca = env.ca_pem
    if args.ca_file is not None:
        try:
            ca = args.ca_file.read_bytes()
        except OSError as exc:
            raise ConfigError(f"--ca-file: cannot read {args.ca_file}: {exc.strerror}") from None
    return ControlCredentials(token=token, ca_pem=ca)


def config_from_args(args: argparse.Namespace, credentials: ControlCredentials | None = None) -> AgentConfig:
    table = TABLES[args.engine]
    address = args.address.rstrip("/")
    return AgentConfig(
        backend_id=args.backend_id,
        table=table,
        address=address,
        metrics_url=args.metrics_url or address + table.metrics_path,
        gateway=args.gateway,
        role=args.role,
        interval_s=args.interval_ms / 1000,
        kv_total_tokens=args.kv_total_tokens,
        scrape_timeout_s=args.scrape_timeout_s,
        upstream_model=args.upstream_model,
        credentials=credentials or ControlCredentials(),
    )


async def serve(config: AgentConfig, model: ModelProfile, gpu: GpuProfile) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with make_client(config.scrape_timeout_s) as client:
        agent = MetricsAgent(config, model, gpu, client)
        log.info("agent_started", backend=config.backend_id, engine=config.table.name,
                 metrics_url=config.metrics_url, gateway=config.gateway)
        await agent.run(stop)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one INFO line per scrape otherwise
    try:
        catalog = load_catalog(args.catalog)
        model, gpu = catalog.model(args.model), catalog.gpu(args.gpu)
        credentials = credentials_from_args(args)
    except ConfigError as exc:
        print(f"heterogate-agent: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    asyncio.run(serve(config_from_args(args, credentials), model, gpu))


if __name__ == "__main__":
    main()
