"""Pushes an engine's state to the gateway's Control stream.

One message every interval, plus one soon after each admission/completion burst (`poke`), coalesced
so a burst of 100 completions costs one message. Reconnects with capped exponential backoff when
the gateway is away. Sequence numbers start at the process start time in µs, so a restarted engine
never looks older than the one it replaced. The stream carries the sender's `ControlCredentials`
(cluster token, engine identity, TLS); a gateway that refuses them answers UNAUTHENTICATED or
PERMISSION_DENIED with the reason (NOT_FOUND for a backend it does not have, ALREADY_EXISTS for one
another live agent reports), logged as an error once until the reason changes, and retried with
backoff: a gateway restarted with the right token, or given the backend, accepts the sender again. A
plaintext sender turned away by a TLS port is told so (`hint` on `gateway_unreachable`).

`gateway_address` may list several replicas' control addresses, comma-separated: the sender keeps
one stream to the first that answers and moves on to the next one when that stream breaks (replicas
share what they receive through Redis, so any one of them will do).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from common.catalog import GpuProfile
from common.control_credentials import ControlCredentials
from common.wire import control_pb2, control_pb2_grpc

log = structlog.get_logger("heartbeat_sender")
WARN_UNREACHABLE_S = 5.0   # a gateway unreachable this long is logged as a warning (gRPC's reason), then as often
_REFUSED = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.ALREADY_EXISTS)
# what a plaintext client reads from a TLS listener that drops its handshake
_TLS_SIGNS = ("Socket closed", "WRONG_VERSION_NUMBER", "Connection reset by peer")

# After a poke, wait this long for more changes before sending (coalescing window).
POKE_COALESCE_S = 0.005


def gpu_message(gpu: GpuProfile) -> control_pb2.GpuProfile:
    return control_pb2.GpuProfile(
        name=gpu.name, tflops=gpu.tflops, bandwidth_gbs=gpu.bandwidth_gbs, hbm_gb=gpu.hbm_gb,
        price_per_hour=gpu.price_per_hour,
    )


class HeartbeatSender:
    def __init__(
        self,
        gateway_address: str,
        build_state: Callable[[], control_pb2.BackendState],
        interval_s: float = 0.2,
        reconnect_max_s: float = 2.0,
        credentials: ControlCredentials | None = None,
    ) -> None:
        self.addresses = [a.strip() for a in gateway_address.split(",") if a.strip()]
        self.current = 0          # index of the address in use
        self._credentials = credentials or ControlCredentials()
        self._build_state = build_state
        self.interval_s = interval_s
        self._reconnect_max_s = reconnect_max_s
        self._seq = time.time_ns() // 1000
        self._poked = asyncio.Event()
        self.connected = asyncio.Event()

    def poke(self) -> None:
        self._poked.set()

    async def run(self) -> None:
        if not self.addresses:
            raise ValueError("no gateway control address given")
        backoff = 0.05
        unreachable_since: float | None = None   # when the streak of failed connects began
        warned_at: float | None = None            # its last warning
        refused: tuple[str, str] | None = None    # the last refusal, said once until it changes or a stream lands
        metadata = self._credentials.metadata()
        async with contextlib.AsyncExitStack() as stack:
            channels = [await stack.enter_async_context(self._credentials.channel(a)) for a in self.addresses]
            while True:
                try:
                    call = control_pb2_grpc.ControlStub(channels[self.current]).Connect(
                        self._messages(), metadata=metadata)
                    async for ack in call:
                        self.connected.set()
                        backoff, unreachable_since, warned_at, refused = 0.05, None, None, None
                        if ack.heartbeat_interval_ms:
                            self.interval_s = ack.heartbeat_interval_ms / 1000
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in _REFUSED:   # retried (a gateway may be given the backend or the token)
                        said = (exc.code().name, exc.details() or "")
                        (log.error if said != refused else log.debug)(
                            "gateway_rejected_backend", code=said[0], detail=said[1])
                        refused = said
                    else:   # a gateway restarting is normal; one unreachable for long (a TLS name, a port) is not
                        now = time.monotonic()
                        unreachable_since = unreachable_since or now
                        warn = now - (warned_at or unreachable_since) >= WARN_UNREACHABLE_S
                        detail = exc.details() or ""
                        hint = ("a TLS control port? give its CA (--ca-file)" if self._credentials.ca_pem is None
                                and any(sign in detail for sign in _TLS_SIGNS) else None)
                        (log.warning if warn else log.debug)(
                            "gateway_unreachable", address=self.addresses[self.current], code=exc.code().name,
                            detail=detail, for_s=round(now - unreachable_since, 1),
                            **({"hint": hint} if hint else {}))
                        if warn:
                            warned_at = now   # the next warning after as long again
                self.connected.clear()
                self.current = (self.current + 1) % len(self.addresses)
                if self.current == 0:   # every address tried once: back off before the next round
                    await asyncio.sleep(backoff)
                    backoff = min(self._reconnect_max_s, backoff * 2)

    async def _messages(self) -> AsyncIterator[control_pb2.BackendState]:
        while True:
            self._seq += 1
            state = self._build_state()
            state.seq = self._seq
            yield state
            try:
                await asyncio.wait_for(self._poked.wait(), timeout=self.interval_s)
                await asyncio.sleep(POKE_COALESCE_S)
            except TimeoutError:
                pass
            self._poked.clear()
