"""structlog set-up: one JSON object per line on stderr, for our own events and for every library's.

Our loggers (structlog) render straight to bytes with orjson: the per-request line is on the hot path.
Libraries that log through the standard `logging` module (aiohttp, httpx, grpc's Python layer,
warnings) reach the same renderer through a `ProcessorFormatter` on the root handler, so a log
collector reads one format. grpc's C core writes its own lines to stderr; it is quiet below errors.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson
import structlog

# Libraries that log every request at INFO: kept to warnings unless debugging.
_CHATTY = ("httpx", "httpcore", "aiohttp.access")


def _dumps(obj: Any, **kwargs: Any) -> bytes:
    return orjson.dumps(obj, default=str)


def _dumps_str(obj: Any, **kwargs: Any) -> str:
    return orjson.dumps(obj, default=str).decode()


def configure_logging(level: str = "info") -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_dumps_str),
        ],
    ))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)
    for name in _CHATTY:
        logging.getLogger(name).setLevel(numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING))
    logging.captureWarnings(True)
    structlog.configure(
        processors=[
            *shared, structlog.processors.format_exc_info, structlog.processors.JSONRenderer(serializer=_dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.BytesLoggerFactory(file=sys.stderr.buffer),
        cache_logger_on_first_use=True,
    )
