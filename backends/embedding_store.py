"""Where a language engine keeps embeddings that vision engines deliver, keyed by request id.

A delivery may arrive before or after the Generate call that needs it; `wait` returns once every
image index is present. Deliveries nobody claims are dropped after `ttl_s` (the request was
cancelled or re-routed), so a lost request cannot leak megabytes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from common.wire import engine_pb2


class EmbeddingTimeout(Exception):
    pass


@dataclass
class _Slot:
    parts: dict[int, engine_pb2.Embedding] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.monotonic)


class EmbeddingStore:
    def __init__(self, ttl_s: float = 60.0) -> None:
        self._slots: dict[str, _Slot] = {}
        self._ttl_s = ttl_s
        self.bytes_received = 0

    def put(self, emb: engine_pb2.Embedding) -> None:
        self._expire()
        slot = self._slots.setdefault(emb.request_id, _Slot())
        if emb.image_index not in slot.parts:   # a re-encode after a vision failure may repeat one
            self.bytes_received += len(emb.data)
        slot.parts[emb.image_index] = emb
        slot.changed.set()

    async def wait(self, request_id: str, count: int, timeout_s: float) -> list[engine_pb2.Embedding]:
        slot = self._slots.setdefault(request_id, _Slot())
        try:
            async with asyncio.timeout(timeout_s):
                while len(slot.parts) < count:
                    slot.changed.clear()
                    await slot.changed.wait()
        except TimeoutError:
            raise EmbeddingTimeout(
                f"request {request_id}: {len(slot.parts)} of {count} image embeddings arrived within {timeout_s:g} s"
            ) from None
        finally:
            self._slots.pop(request_id, None)
        return [slot.parts[i] for i in sorted(slot.parts)]

    def _expire(self) -> None:
        cutoff = time.monotonic() - self._ttl_s
        for rid in [rid for rid, s in self._slots.items() if s.created < cutoff]:
            del self._slots[rid]
