"""Decoders for gRPC services that answer bytes that are no message with INVALID_ARGUMENT.

grpcio's generated registration decodes a request with the message's `FromString`, which raises on
bytes that are no such message: the call ends with UNKNOWN and grpcio logs the exception with its
traceback, before the servicer (and its authentication) ever runs, so a stranger could fill the error
log. A lenient decoder hands the servicer None instead, and the servicer refuses it in its own words.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

M = TypeVar("M", covariant=True)


class Parses(Protocol[M]):
    def FromString(self, raw: bytes) -> M: ...


def lenient(message: Parses[M]) -> Callable[[bytes], M | None]:
    """`message.FromString`, or None for bytes that are no such message."""
    def decode(raw: bytes) -> M | None:
        try:
            return message.FromString(raw)
        except DecodeError:
            return None
    return decode


def register(server: grpc.aio.Server, service: str, handlers: dict[str, Any]) -> None:
    """Register `handlers` (method name → grpcio method handler) for the service of full name `service`,
    as the generated `add_*Servicer_to_server` functions do."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
