"""The router's contracts: what a policy reads (snapshots, a request profile) and what it returns.

Policies are synchronous and pure: they read immutable snapshots, take `now` as an argument, never
await and never do I/O, so the live gateway and the simulator run the very same objects. The live
gateway passes `gateway.routing.policies.candidates.Candidates` (a tuple of snapshots that also carries them
as columns); a policy may compute on those columns, and must accept any sequence of snapshots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

Role = Literal["language", "vision", "both"]
NO_CACHED_TOKENS: Mapping[str, int] = MappingProxyType({})
NO_EVICTED_REUSE: Mapping[str, float] = MappingProxyType({})


@dataclass(slots=True)
class BackendSnapshot:
    """One backend as a policy sees it; rebuilt by the state table whenever a signal changes.

    Treated as immutable (`dataclasses.replace` makes a changed copy; `Candidates` handed out share
    them), but not declared frozen: the state table builds one for every changed row before a
    decision, and a frozen dataclass's __init__ (one object.__setattr__ call per field) took 2.4 µs
    against 1.0 µs here.
    """

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
    # Learned speed (common.speed_estimator) and this router's own leases; 0 where not known.
    learned_prefill_s_per_token: float = 0.0   # p̂: what the engine delivers, not 2·P / F_i
    decode_step_s: float = 0.0                 # ŝ: mean inter-token time it delivers
    prefilling: int = 0                        # dispatched here, first token not seen yet
    prefill_backlog_tokens: int = 0            # their prompt tokens, and other clients' waiting there (estimated)
    kv_reserved_tokens: int = 0                # prompt + max tokens of every request in flight here
    # The smallest inter-token slacks of the requests in flight here (common.itl_slack), smallest
    # first: the prefill stall (s) each can still take before its mean inter-token time passes the target.
    itl_slack_s: tuple[float, ...] = ()
    # The backend's calibrated decode-time model (common.calibration; its prior until fitted): what a
    # prompt's prefill stalls the requests decoding there, κ · L · p̂ + c.
    stall_factor: float = 1.0
    stall_per_prompt_s: float = 0.0
    # Other clients' requests running there as its last report counts them (the engine's beyond every
    # replica's own): stalled by a prefill there as this gateway's are, and decoding ahead of its first token.
    foreign_running: int = 0

    def fits(self, tokens: int) -> bool:
        """Whether a request needing `tokens` of context (prompt + max_tokens) fits this backend."""
        return not self.max_context or tokens <= self.max_context

    @property
    def kv_free_tokens(self) -> int:
        return self.kv_free_bytes // self.kv_bytes_per_token if self.kv_bytes_per_token else 0


@dataclass(slots=True)
class RequestProfile:
    """What a policy knows of a request. Treated as immutable, as `BackendSnapshot` is, but not declared
    frozen: one is built per request, and a frozen dataclass's __init__ took twice as long."""

    request_id: str
    input_tokens: int             # L_r: text tokens + image tokens
    max_output_tokens: int = 256
    image_tokens: int = 0
    # Per backend id, the prompt tokens its prefix cache is predicted to hold (gateway.routing.prefix_index):
    # those it would not prefill. Absent: none. Always below input_tokens.
    cached_tokens: Mapping[str, int] = field(default_factory=lambda: NO_CACHED_TOKENS)
    # Per vision backend id, the image tokens of r whose embeddings it is predicted to hold
    # (gateway.routing.encoder_index): those it would not encode. Absent: none.
    cached_image_tokens: Mapping[str, int] = field(default_factory=lambda: NO_CACHED_TOKENS)
    # Per backend id whose prefix cache is full, ρ_i: the share of the blocks it evicted lately that later
    # prompts asked for again (gateway.routing.prefix_index). Absent: 0 (placing r there costs no one).
    evicted_reuse: Mapping[str, float] = field(default_factory=lambda: NO_EVICTED_REUSE)


class CostTerms(NamedTuple):
    """Per-candidate cost breakdown. Policies that do not use a term leave it at 0."""

    backend_id: str
    prefill: float
    queue: float
    oom: float
    total: float


class CostColumns(NamedTuple):
    """A cost breakdown kept as arrays (one entry per candidate, in order), made into `CostTerms`
    only when read: a decision over N candidates allocates nothing per candidate. `oom` None: all 0."""

    backend_ids: Sequence[str]    # the candidates'
    prefill: npt.NDArray[np.float64]
    queue: npt.NDArray[np.float64]
    oom: npt.NDArray[np.float64] | None
    total: npt.NDArray[np.float64]
    chosen: int

    def terms(self) -> tuple[CostTerms, ...]:
        oom = [0.0] * len(self.total) if self.oom is None else self.oom.tolist()
        columns = (self.prefill.tolist(), self.queue.tolist(), oom, self.total.tolist())
        return tuple(map(CostTerms._make, zip(self.backend_ids, *columns, strict=True)))

    def vetoed(self) -> tuple[str, ...]:
        if self.oom is None:
            return ()
        ids = self.backend_ids   # oom is 0 or a veto cost ≥ 0, so its nonzero rows are those with oom > 0
        return tuple([ids[k] for k in self.oom.nonzero()[0].tolist()])


class Decision:
    """The chosen backend, the policy's name and the cost of every candidate.

    `costs` is given as a tuple of `CostTerms`, or as `CostColumns` that become that tuple on first
    read (debug logs, admin, tests); `cost` and `vetoed` read the columns directly.
    """

    __slots__ = ("_columns", "_costs", "backend", "policy")

    def __init__(self, backend: BackendSnapshot, policy: str, costs: tuple[CostTerms, ...] | CostColumns) -> None:
        self.backend = backend
        self.policy = policy
        self._columns = costs if isinstance(costs, CostColumns) else None
        self._costs = None if isinstance(costs, CostColumns) else costs

    @property
    def costs(self) -> tuple[CostTerms, ...]:
        if self._costs is None:
            assert self._columns is not None
            self._costs = self._columns.terms()
        return self._costs

    @property
    def cost(self) -> float:
        if self._columns is not None:
            return float(self._columns.total[self._columns.chosen])
        for c in self.costs:
            if c.backend_id == self.backend.id:
                return c.total
        return 0.0

    @property
    def vetoed(self) -> tuple[str, ...]:
        if self._columns is not None:
            return self._columns.vetoed()
        return tuple([c.backend_id for c in self.costs if c.oom > 0])   # a list first: cheaper for a few

    def _key(self) -> tuple[BackendSnapshot, str, tuple[CostTerms, ...]]:
        return self.backend, self.policy, self.costs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Decision) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Decision(backend={self.backend!r}, policy={self.policy!r}, costs={self.costs!r})"


class Policy(Protocol):
    """Chooses one of `candidates` (never empty, all healthy) for `request`."""

    name: str

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision: ...
