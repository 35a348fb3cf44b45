"""One backend's record in the state table, and the lease a dispatch holds on it.

Plain data, shared by the table (state_table.py), its column pools (candidate_columns.py) and every
producer of signals; kept apart from the table so that the pools can name the record without importing
the table that owns them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from common.catalog import GpuProfile
from common.itl_slack import InterTokenSlack
from common.metric_tables import KvSource
from common.speed_estimator import BackendSpeed
from gateway.routing.policies.contracts import BackendSnapshot, Role

# Set by the supervisor for the backends it launched; None for the others. Only `ready` ones serve.
Lifecycle = Literal["starting", "ready", "restarting", "stopped"]
SERVING: tuple[Lifecycle | None, ...] = (None, "ready")


@dataclass(slots=True)
class Reported:
    """The last heartbeat's numbers."""

    seq: int = -1
    waiting: int = 0
    running: int = 0
    kv_free_bytes: int = 0
    kv_total_bytes: int = 0
    vision_backlog: int = 0
    mean_service_s: float = 0.0
    tokens_generated: int = 0
    requests_completed: int = 0
    images_encoded: int = 0
    pid: int = 0
    steal_episodes: int = 0
    tokens_stolen: int = 0
    embedding_bytes_sent: int = 0
    max_model_len: int = 0                    # 0: the engine does not say
    kv_source: KvSource | None = None         # None: the sender does not say
    prefix_cache_queries: int = 0             # cumulative prompt tokens (vLLM's counter); 0: not reported
    prefix_cache_hits: int = 0                # of them, found in the engine's prefix cache
    kv_block_tokens: int = 0                  # tokens a block of its KV (and prefix cache) holds; 0: not said
    embedding_cache_hits: int = 0             # vision: images found in the engine's embedding cache
    embedding_cache_images: int | None = None  # vision: embeddings its cache keeps at most; None: not said
    scrape_error: str = ""                    # a heartbeat agent: why its last scrape of the engine failed


class PeerLoad(NamedTuple):
    """The other replicas' load on one backend, as last shared through Redis (shared_state.py)."""

    in_flight: int = 0
    vision_tokens: int = 0
    prefilling: int = 0
    prefill_backlog_tokens: int = 0
    kv_reserved_tokens: int = 0


NO_PEER_LOAD = PeerLoad()


@dataclass(slots=True)
class BackendEntry:
    id: str
    role: Role
    gpu: GpuProfile
    address: str | None
    managed: bool
    speed: BackendSpeed                       # learned from this gateway's own requests
    slack: InterTokenSlack                    # this gateway's leases' inter-token deadlines
    steal: bool = False
    external: bool = False                    # kind: openai: reachable without heartbeats (see candidates)
    last_heartbeat: float | None = None       # monotonic seconds
    # seconds its reports stay fresh beyond the table's window: a backend scraped less often than the
    # heartbeat interval would otherwise go stale between two on-time scrapes
    grace_s: float = 0.0
    reported: Reported = field(default_factory=Reported)
    in_flight: int = 0
    vision_in_flight_tokens: int = 0          # image tokens sent to this encoder, not yet encoded
    peer: PeerLoad = NO_PEER_LOAD             # other replicas' load here, as last shared
    max_model_len: int | None = None          # configured: where the engine does not say
    kv_capacity_tokens: int | None = None     # configured: where the engine does not say
    prefilling: int = 0                       # leases without a first token
    prefill_backlog_tokens: int = 0           # their prompt tokens
    engine_requests: int = 0                  # the engine requests of its leases (a request of n choices is n)
    # Other clients' requests in the engine (StateTable._note_foreign): what it counted beyond every replica's
    # own at its last two reports (`foreign_seen`, the smaller of the two counts: a request this gateway let
    # go, which the engine drops a moment later, is in one report at most), this gateway's own engine
    # requests at its last report; of them, those waiting (their prompt tokens at the mean prompt this
    # gateway's requests prefill) and those running
    foreign_seen: tuple[int, int] = (0, 0)
    own_at_report: int = 0
    foreign_waiting: int = 0
    foreign_backlog_tokens: int = 0
    foreign_running: int = 0
    kv_reserved_tokens: int = 0               # prompt + max tokens of every lease
    lifecycle: Lifecycle | None = None
    models: frozenset[str] = frozenset()      # the model names it serves (empty: the table's only model)
    min_priority: int | None = None           # kept for requests of this priority class or higher (None: any)
    # kind: openai: why the gateway's last probe or scrape of it failed, one line (None: they succeeded);
    # for the operator's /admin/backends only, never read by routing
    last_error: str | None = None
    # managed: why its engine last stopped serving unasked (`gateway.control.supervisor.exit_reason`), kept
    # after it is back; for /admin/backends only
    last_exit: str | None = None
    restarts: int = 0   # managed: its engine's exits the supervisor relaunched it after (kept through a drain)
    # managed: the process the supervisor runs for it (0: none yet), for /admin/backends where the engine
    # does not report its own pid (a launched `kind: openai` engine, read by scraping)
    process_pid: int = 0
    cached: BackendSnapshot | None = field(default=None, repr=False)
    blind: BackendSnapshot | None = field(default=None, repr=False)   # the snapshot failing open (`_blind`)
    changes: set[str] | None = field(default=None, repr=False)   # the table's ids of dropped snapshots

    @property
    def peer_in_flight(self) -> int:
        return self.peer.in_flight

    @property
    def takes_language(self) -> bool:
        """It may prefill and decode: a language or monolithic backend, or a vision one that steals."""
        return self.role != "vision" or self.steal

    @property
    def snapshot(self) -> BackendSnapshot | None:
        """None = stale, rebuilt on next read; dropping it tells the table's column pools too."""
        return self.cached

    @snapshot.setter
    def snapshot(self, value: BackendSnapshot | None) -> None:
        self.cached = value
        if value is None:
            self.blind = None
            if self.changes is not None:
                self.changes.add(self.id)


def serves(entry: BackendEntry) -> bool:
    """Whether the entry may be routed to at all (a launched engine only once ready)."""
    return entry.lifecycle in SERVING


@dataclass(slots=True)
class Lease:
    """One dispatch to one backend, from `acquire` to `release`."""

    backend_id: str
    prompt_tokens: int                        # to prefill: the prompt less its predicted cached prefix
    reserve_tokens: int
    tokens_ahead: int                         # prompt tokens to prefill there before this one's first token
    #                                           (0 where most of its prompt was predicted cached: no p̂ sample)
    dispatched_s: float
    first_token_s: float | None = None
    itl_deadline: float | None = None         # in the backend's InterTokenSlack; None: a single token
    first_token_features: tuple[float, ...] = ()   # the first-token model's, at dispatch (common.calibration)
    stall_mark: tuple[float, int] | None = None    # the backend's stall clock at its first token
    entry: BackendEntry | None = None         # the entry it counts in (one of that id registered later: not it)
    max_tokens: int = 0
    engine_requests: int = 1                  # what the engine counts it as (n choices: n requests)
    awaiting_inputs: bool = False             # its images' embeddings are still to come: not prefilling yet
    mostly_cached: bool = False               # most of its prompt predicted cached there: no p̂ sample
