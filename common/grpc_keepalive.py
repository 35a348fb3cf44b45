"""The gRPC keepalive policy that the gateway (client) and the engines (servers) agree on.

The gateway keeps one Session stream open to every engine for as long as it runs, and pings it so
that a dead connection is noticed without waiting for a request to fail. A gRPC server with the
default ping policy takes a ping that arrives less than 5 minutes after the previous one, with no
data in between, as abuse: after two such strikes it answers GOAWAY "too_many_pings" and the stream
in flight fails. So both ends take their settings from here:

- the client pings every `ping_ms` (also with no call open) and drops the connection when a ping
  goes unanswered for `timeout_ms`;
- the server accepts pings with no call open and no data in between as often as every half of
  `ping_ms` (a client's timer may fire a little early; half leaves room for that).

`HETEROGATE_GRPC_KEEPALIVE_MS` overrides `ping_ms` (default 20,000) in every process that reads it:
a gateway passes its environment on to the engines it launches; an engine started by hand must be
given the same value as the gateway it serves (or a smaller one).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from common.errors import ConfigError

ENV_KEEPALIVE_MS = "HETEROGATE_GRPC_KEEPALIVE_MS"
DEFAULT_PING_MS = 20_000
DEFAULT_TIMEOUT_MS = 10_000
MIN_PING_MS = 100        # below this a ping is load, not liveness

Options = list[tuple[str, int]]


@dataclass(frozen=True, slots=True)
class KeepAlive:
    ping_ms: int = DEFAULT_PING_MS
    timeout_ms: int = DEFAULT_TIMEOUT_MS

    @property
    def min_recv_ping_ms(self) -> int:
        """The shortest gap between pings without data that a server takes without a strike."""
        return self.ping_ms // 2

    def client_options(self) -> Options:
        return [
            ("grpc.keepalive_time_ms", self.ping_ms),
            ("grpc.keepalive_timeout_ms", self.timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),   # keep pinging an idle stream: that is the point
        ]

    def server_options(self) -> Options:
        return [
            ("grpc.keepalive_permit_without_calls", 1),
            # the server-side name of the minimum gap between pings received without data
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_recv_ping_ms),
        ]


def keepalive(environ: Mapping[str, str] | None = None) -> KeepAlive:
    """The policy of this process: the default, or `HETEROGATE_GRPC_KEEPALIVE_MS` (ConfigError if bad)."""
    raw = (os.environ if environ is None else environ).get(ENV_KEEPALIVE_MS, "").strip()
    if not raw:
        return KeepAlive()
    try:
        ping_ms = int(raw)
    except ValueError:
        raise ConfigError(f"{ENV_KEEPALIVE_MS} must be a whole number of milliseconds, not {raw!r}") from None
    if ping_ms < MIN_PING_MS:
        raise ConfigError(f"{ENV_KEEPALIVE_MS} must be at least {MIN_PING_MS} ms, not {ping_ms}")
    return KeepAlive(ping_ms=ping_ms, timeout_ms=min(DEFAULT_TIMEOUT_MS, ping_ms))
