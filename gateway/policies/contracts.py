"""The router's contracts: what a policy reads (snapshots, a request profile) and what it returns.

Policies are synchronous and pure: they read immutable snapshots, take `now` as an argument, never
await and never do I/O, so the live gateway and the simulator run the very same objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

Role = Literal["language", "vision", "both"]


@dataclass(frozen=True, slots=True)
class BackendSnapshot:
    """One backend as a policy sees it; rebuilt by the state table whenever a signal changes."""

    id: str
    role: Role
    gpu: str
    tflops: float
    bandwidth_gbs: float
    price_per_hour: float
    queue_depth: int              # Q_i: max(gateway in-flight, engine waiting + running)
    in_flight: int                # dispatched by this gateway (all replicas with Redis), not completed
    kv_free_bytes: int
    kv_total_bytes: int
    kv_bytes_per_token: int
    vision_backlog: int           # image tokens waiting to be encoded
    mean_service_s: float         # T̄_service(i)
    prefill_s_per_token: float    # 2·P / F_i, from the performance model
    weight_bytes: int             # decoder weights, streamed from HBM on every decode step
    encode_s_per_token: float = 0.0   # vision encoder seconds per image token, from the performance model
    steal: bool = False
    max_context: int = 0          # prompt + completion tokens it serves (0: unknown, no limit applied)

    def fits(self, tokens: int) -> bool:
        """Whether a request needing `tokens` of context (prompt + max_tokens) fits this backend."""
        return not self.max_context or tokens <= self.max_context

    @property
    def kv_free_tokens(self) -> int:
        return self.kv_free_bytes // self.kv_bytes_per_token if self.kv_bytes_per_token else 0


@dataclass(frozen=True, slots=True)
class RequestProfile:
    request_id: str
    input_tokens: int             # L_r: text tokens + image tokens
    max_output_tokens: int = 256
    image_tokens: int = 0


class CostTerms(NamedTuple):
    """Per-candidate cost breakdown. Policies that do not use a term leave it at 0."""

    backend_id: str
    prefill: float
    queue: float
    oom: float
    total: float


@dataclass(frozen=True, slots=True)
class Decision:
    backend: BackendSnapshot
    policy: str
    costs: tuple[CostTerms, ...]

    @property
    def cost(self) -> float:
        for c in self.costs:
            if c.backend_id == self.backend.id:
                return c.total
        return 0.0

    @property
    def vetoed(self) -> tuple[str, ...]:
        return tuple(c.backend_id for c in self.costs if c.oom > 0)


class Policy(Protocol):
    """Chooses one of `candidates` (never empty, all healthy) for `request`."""

    name: str

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision: ...
