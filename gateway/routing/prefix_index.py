"""The gateway's prefix index: what each backend's prefix cache holds, as far as routing can tell.

For every request it routes, the gateway remembers the prompt's chained block hashes
(`common.prefix_blocks`: blocks of `block_tokens` token ids where the gateway has them, else of
`block_tokens` · 4 bytes of the rendered prompt) on the backend it chose, in an LRU per backend
bounded by that backend's KV capacity in blocks (keep_i · K_i / block_tokens, at most
`max_blocks_per_backend`; keep_i below) and evicted least-recently-used first, as the engine evicts.
A lookup gives, per backend, the prompt tokens whose KV it is predicted to hold: the longest run of
the prompt's leading blocks routed there and not evicted since, never the whole prompt (the last
token is always computed).

Session affinity: a request that names a session (the OpenAI `user` field, or the `x-session-id`
header) also touches a key for the session in its backend's LRU, holding its prompt's length; a later
request of the session is predicted to find that many tokens there (or more, by its blocks). So a
conversation whose text the gateway cannot match (a rewritten history, a template that changes early
tokens) still sticks, and it yields under load by the same cost as any hit.

Engine reports. An engine that reports vLLM's `prefix_cache_queries` / `prefix_cache_hits` counters
(heartbeats of the managed engines, scraped `vllm:` metrics) corrects the index's one unknown, how
much of K_i really holds cached prefixes (running requests' KV takes its share, other clients' traffic
too): the index keeps keep_i · K_i blocks for backend i, and at each reading that moved the counters,
over a decaying window (DECAY a reading),

    keep_i ← clamp(keep_i · (reported hit rate / predicted hit rate)^KEEP_GAIN, MIN_KEEP, 1)

so it forgets the oldest blocks first, as the engine did, until it predicts the hit rate the engine
reports; an engine that reports no hit where the index predicted some (MIN_REPORTED_TOKENS of them: it
caches nothing) gets keep_i = 0: no prediction. Readings with no hit predicted and none reported (cold
caches) move nothing: taken as "caches nothing", the first misses of a cold start set keep_i to 0 on
every backend, whose LRU then regrew by 2^KEEP_GAIN a reading, so each one's recovery, and the
evictions its shrunken LRU counted in ρ_i, depended on how often it was routed to early on.
`source` says which: "estimate" (keep_i = 1) until an engine reports, then "engine". Counters that
go back (a restarted engine) empty the backend's LRU: its cache is empty too.

KV events. A backend whose engine publishes its KV cache events (`kv_events:`, vLLM's and SGLang's
format; `engine_events`) has its LRU follow them: the index blocks the engine stored join it as the most
recent, whoever sent the prompt, those it evicted leave it (into its ghost list), AllBlocksCleared
empties it. Events name only blocks of token ids (gateway/routing/engine_blocks.py says which), so
while most prompt tokens routed to the backend lately are such (`PrefixQuery.named`), keep_i stays at 1
(`source` "events") and the LRU's bound is EVENTS_ROOM · K_i, the engine's evictions doing the evicting;
where most are prompts hashed from text, which no event removes, the counters go on correcting keep_i.

Blocks of 64 tokens by default (`gateway.routing.prefix_cache.block_tokens`), four of an engine's
16-token blocks: a hit is counted in whole blocks of the index, so up to 63 tokens of a cached prefix
go uncounted (under 3% of a 2,500-token prompt), and the hashing, the walk and the LRU touches are a
quarter of what 16-token blocks cost (routing cost in docs/ROUTING.md). An engine that reports its own
KV block size (`Reported.kv_block_tokens`) is credited the whole blocks of it a hit fills, as it caches
them: a backend of 128-token blocks saves 256 tokens of a 320-token hit, not 320.

Cost: the prompt is hashed once a request (its retries reuse the hashes); a lookup walks the
prompt's blocks once, keeping the backends that hold every block so far as a bit mask (one dict
read and an AND a block, stopping when no backend is left), then O(backends with a hit): O(prompt
blocks + N). Recording is O(prompt blocks) on one backend's LRU. Memory: at most
Σ_i min(K_i / block_tokens, max_blocks_per_backend) LRU entries and at most as many in the holders
map, about 100 bytes a block held by one backend, both together (tests/unit/test_prefix_index.py
bounds it at 250): with 64-token blocks, 8 backends of 50k tokens are 6,250 blocks, ~0.6 MB, and 64
backends of 500k tokens 500k blocks, ~50 MB; the default cap, 2^20 blocks a backend, bounds any
backend at ~100 MB. Once a backend evicts, its ghost list (below) holds up to as many hashes again,
about 100 bytes each: at most about twice those figures.

Eviction reuse (ρ_i). Placing a prompt on a backend whose cache is full evicts as many of its least
recent blocks as the prompt adds; what that costs depends on whether those blocks are asked for
again. The index keeps, per backend, the hashes of its last evicted blocks (as many as it holds:
ARC's "ghost" list) and counts how many of them a later prompt brings back (routed anywhere: a
prompt that would have hit there): ρ_i = wanted / evicted over a window of the last ~2 · K_i blocks
evicted (both counts halve past it). A backend whose cache is full and whose ρ_i is above 0 is listed
in every query's `reuse` (a live view), and `marginal_delay` charges a placement there the
recomputation it causes elsewhere in the backend's future, w_evict · ρ_i · L_i · p_i seconds
(docs/ROUTING.md): a fast tier that is evicting live conversations stops taking new ones that could
go where the cache turns over slowly. ρ_i ages while backend i evicts nothing: it halves each time
the cluster takes in K_i new blocks elsewhere since i's last eviction (ρ_i · 2^(−placed / K_i),
brought up to date every AGE_EVERY blocks placed), as the blocks i would evict next grow that much
older than those it was measured on. Without it a backend that ρ_i priced out took no placement,
so it never evicted again and its ρ_i never moved: once its tenants' prompts changed it was shut out
for good (the live multi-turn benchmark's gateway sent an H100 14 requests in a run after 226 in
the one before, docs/ROUTING.md); with it the backend takes new prompts again once the cluster has
moved on, and the ghosts of what it then evicts measure ρ_i afresh.

Images: a request's images take their places in its chain, named by their content
(`common.prefix_blocks.prompt_blocks`): the same image with the same text is a hit, another image is
not, and a system prompt ahead of different images is a shared prefix (its full blocks).

Replicas (`share`, with `--redis-url`): each replica publishes what it routed and applies what the
others routed (gateway.replicas.shared_state, every refresh), so every replica predicts from what all
of them sent to each backend, a refresh late, and counts their requests in the predicted counters that
keep_i compares with the engine's (which count them all); text is then hashed the same in every process.

Limits: the index knows only what the gateways routed (a replica learns its peers' routing a refresh
late); it counts a request's blocks as cached from the moment it is routed, before the engine has
computed them; what an engine drops it sees only through keep_i, one figure per backend (the index
drops that backend's oldest blocks, the engine may have dropped others); responses are not indexed
(the next turn's copy of an answer is a miss until it has been routed once as a prompt).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from common.kv_events import AllBlocksCleared, KvEvent
from common.prefix_blocks import BlockLru, cached_tokens, prompt_blocks, salt_seed, session_key
from gateway.routing.backend_entry import BackendEntry
from gateway.routing.engine_blocks import EngineBlocks

INDEX_BLOCK_TOKENS = 64       # tokens a block of the index stands for (gateway.routing.prefix_cache.block_tokens)
DECAY = 0.98                  # weight of the window per engine reading that moved the counters
MIN_REPORTED_TOKENS = 4096    # reported query tokens in the window before keep_i moves
KEEP_GAIN = 0.05              # keep_i moves by (reported / predicted hit rate)^KEEP_GAIN a reading
MIN_KEEP = 1 / 64             # keep_i of an engine that hits at all
REUSE_WINDOW = 2              # ρ_i counts over the last ~REUSE_WINDOW · K_i blocks evicted from backend i
AGE_EVERY = 64                # blocks placed (anywhere) between updates of the listed backends' aged ρ_i
MIN_REUSE = 0.01              # an aged ρ_i below this is not listed (priced at 0)
MIN_EVICTED_SHARE = 0.25      # no ρ_i before a quarter of K_i has been evicted
EVENTS_ROOM = 2               # with KV events, the LRU's bound in K_i (the engine's evictions, not it, evict)
Source = Literal["estimate", "engine", "events"]
Routed = tuple[str, Sequence[int], int | None, int]   # (backend, blocks, session key, prompt tokens)


@dataclass(slots=True)
class PrefixQuery:
    """One request's view of the index: its blocks, its session key and the predicted cached tokens
    per backend (only backends with a hit). Treated as immutable, but not declared frozen: one is built
    per request, and a frozen dataclass's __init__ sets each field through object.__setattr__."""

    blocks: Sequence[int]
    session: int | None
    prompt_tokens: int
    cached: Mapping[str, int]
    reuse: Mapping[str, float]    # ρ_i of the backends whose cache is full (a live view: read it at once)
    # The blocks' own prediction where a session raised `cached` (None: the same): a session predicts its
    # last prompt's length however much of the text changed, which the engine's counters cannot confirm,
    # so only the blocks' prediction is compared with them (keep_i).
    by_blocks: Mapping[str, int] | None = None
    named: bool = False   # its blocks come from token ids, with no salt or image: an engine's KV events can name them


@dataclass(slots=True)
class _Backend:
    id: str
    bit: int
    lru: BlockLru
    kv_blocks: int                      # K_i in blocks (at most max_blocks_per_backend)
    keep: float = 1.0                   # keep_i: the share of them the index counts as cached
    predicted_queries: int = 0          # prompt tokens this gateway routed here
    predicted_hits: int = 0             # of them, predicted cached
    reported_queries: int = 0           # the engine's counters, summed since the first reading
    reported_hits: int = 0
    last: tuple[int, int] | None = None  # the engine's counters as last read
    mark: tuple[int, int] = (0, 0)      # predicted totals at the last reading
    window: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])   # decayed pq, ph, rq, rh
    ghosts: deque[int] = field(default_factory=deque)   # its last evicted blocks, oldest first
    evicted: float = 0.0                # blocks evicted, over the window
    wanted: float = 0.0                 # of them, brought back by a later prompt
    evicted_at: int = 0                 # the index's blocks placed (anywhere) at its last eviction
    granule: int = 0                    # tokens a block of the engine's KV holds, as it reports (0: not said)
    events: EngineBlocks | None = None  # the engine's KV events, once one arrived (gateway.control.kv_event_listener)
    event_gaps: int = 0                 # batches of events lost on the way (sequence numbers skipped)
    events_replayed: int = 0            # batches brought by the engine's replay socket
    replays_failed: int = 0             # replays that did not end in time (or not as a replay should)
    events_refused: int = 0             # messages that were no batch of events
    named_tokens: float = 0.0           # prompt tokens routed here whose blocks events can name (decayed a reading)
    unnamed_tokens: float = 0.0         # and those they cannot (hashed from text, salted, with images)
    last_refused: str | None = None     # why the last of them was refused

    @property
    def governed(self) -> bool:
        """Its engine's KV events say which blocks it holds, for most of what is routed here: they,
        not keep_i, take blocks out (where most prompts are ones events cannot name, the counters go on
        correcting keep_i)."""
        return self.events is not None and self.unnamed_tokens <= self.named_tokens

    @property
    def source(self) -> Source:
        if self.governed:
            return "events"
        return "engine" if self.reported_queries else "estimate"

    @property
    def reuse(self) -> float:
        """ρ_i: of the blocks it evicted lately, the share later prompts asked for again."""
        return min(1.0, self.wanted / self.evicted) if self.evicted else 0.0


class PrefixIndex:
    def __init__(self, block_tokens: int = INDEX_BLOCK_TOKENS, max_blocks_per_backend: int = 1 << 20) -> None:
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks_per_backend
        self._backends: dict[str, _Backend] = {}
        self._by_bit: list[_Backend] = []
        self._holders: dict[int, int] = {}   # block hash -> bit mask of the backends whose LRU holds it
        self._ghosts: dict[int, int] = {}    # block hash -> bit mask of the backends that evicted it lately
        self._reuse: dict[str, float] = {}   # ρ_i of the backends whose cache is full, where above 0
        self._reuse_view = MappingProxyType(self._reuse)
        self._all = 0
        self._free_bits: list[int] = []      # bits of removed backends, for the next added
        self._placed = 0                     # blocks taken into any backend's LRU, ever (ρ_i's age)
        self._aged_at = 0                    # _placed when the listed ρ_i were last aged
        self.stable = False                  # hashes the same in every process (`share`)
        self._routed: deque[Routed] | None = None   # this process's records not yet shared

    def share(self, max_pending: int) -> None:
        """Replicas share what each backend holds (gateway.replicas.shared_state): from now on text is
        hashed the same in every process, and each record is kept for the next publication (at most
        `max_pending`, the oldest dropped first)."""
        self.stable = True
        self._routed = deque(maxlen=max_pending)

    def take_routed(self) -> list[Routed]:
        """The records since the last call (for the other replicas): (backend, blocks, session key or
        None, prompt tokens)."""
        routed = self._routed
        if not routed:
            return []
        out = list(routed)
        routed.clear()
        return out

    def peer_routed(self, backend_id: str, blocks: Sequence[int], session: int | None, prompt_tokens: int) -> None:
        """Another replica routed a prompt of these blocks to `backend_id`: it holds them next, as if
        routed here. Its tokens and the hits this index predicts for it there (by blocks, as `record`
        counts them) join the predicted counters: the engine's counters, which keep_i compares them
        with, count every replica's requests."""
        b = self._backends.get(backend_id)
        if b is None:
            return
        held_by, bit, matched = self._holders.get, 1 << b.bit, 0
        for block in blocks:
            if not held_by(block, 0) & bit:
                break
            matched += 1
        b.predicted_queries += prompt_tokens
        b.predicted_hits += cached_tokens(matched * self.block_tokens, prompt_tokens)
        self._touch(b, blocks, session, prompt_tokens)

    def add_backend(self, backend_id: str, capacity_tokens: int) -> None:
        bit = self._free_bits.pop() if self._free_bits else len(self._by_bit)
        blocks = self._blocks(capacity_tokens)
        b = _Backend(backend_id, bit, BlockLru(blocks), blocks)
        self._backends[backend_id] = b
        if bit == len(self._by_bit):
            self._by_bit.append(b)
        else:
            self._by_bit[bit] = b
        self._all |= 1 << bit

    def remove_backend(self, backend_id: str) -> None:
        """The backend left the fleet: its blocks, ghosts and ρ_i are forgotten and its bit is free for
        the next backend added (one re-added under the same id starts empty, as its new engine does)."""
        b = self._backends.pop(backend_id, None)
        if b is None:
            return
        self._drop(b, b.lru.resize(0))
        ghosts, keep = self._ghosts, ~(1 << b.bit)
        for block in b.ghosts:
            if mask := ghosts.get(block, 0) & keep:
                ghosts[block] = mask
            else:
                ghosts.pop(block, None)
        b.ghosts.clear()
        self._reuse.pop(backend_id, None)
        self._all &= keep
        self._free_bits.append(b.bit)

    def _blocks(self, capacity_tokens: int) -> int:
        return min(self.max_blocks, max(0, capacity_tokens) // self.block_tokens)

    def hashes(self, prompt: str, token_ids: Sequence[int], prompt_tokens: int,
               images: Sequence[tuple[int, int, int]] = (), salt: str = "") -> list[int]:
        """The prompt's block hashes (token ids where given), at most the blocks its tokens fill;
        `images` (content digest, tokens, bytes of the prompt before it) take their places in the chain
        (`common.prefix_blocks.prompt_blocks`), so a repeated image with the same text is a hit, another
        image is not, and the text before an image is a prefix of its own. `salt`: the request's cache
        salt, as the engines key it (`common.prefix_blocks.salt_seed`): no hit across salts."""
        return prompt_blocks(prompt, token_ids, prompt_tokens, images, block_tokens=self.block_tokens,
                             stable=self.stable, salt=salt_seed(salt))

    def lookup(self, blocks: Sequence[int], session: str, prompt_tokens: int, named: bool = False) -> PrefixQuery:
        """Predicted cached prompt tokens per backend for a prompt of these blocks (and this session,
        "" for none). `named`: the blocks are hashed from token ids with no salt or image, as an engine's
        KV events name its blocks."""
        cached: dict[str, int] = {}
        held_by, by_bit, size = self._holders.get, self._by_bit, self.block_tokens
        alive = self._all
        matched = 0
        for block in blocks:
            held = held_by(block, 0) & alive
            if held != alive:
                if matched:   # the backends that held every block so far and not this one
                    _credit(cached, alive & ~held, by_bit, matched * size, prompt_tokens)
                alive = held
                if not alive:
                    break
            matched += 1
        else:
            if matched:
                _credit(cached, alive, by_bit, matched * size, prompt_tokens)
        key = by_blocks = None
        if session:
            key = session_key(session, stable=self.stable)
            for b in _members(held_by(key, 0), by_bit):
                hit = cached_tokens(b.lru.get(key) or 0, prompt_tokens)
                if b.granule > 1:
                    hit -= hit % b.granule
                if hit > cached.get(b.id, 0):
                    if by_blocks is None:
                        by_blocks = dict(cached)
                    cached[b.id] = hit
        return PrefixQuery(blocks, key, prompt_tokens, cached, self._reuse_view, by_blocks, named)

    def record(self, query: PrefixQuery, backend_id: str, capacity_tokens: int) -> None:
        """`query`'s request was routed to `backend_id`, whose KV holds `capacity_tokens` (0: unknown,
        the LRU keeps its size)."""
        b = self._backends.get(backend_id)
        if b is None:
            return
        if capacity_tokens and (blocks := self._blocks(capacity_tokens)) != b.kv_blocks:   # else it fits already
            b.kv_blocks = blocks
            self._fit(b)
        self._touch(b, query.blocks, query.session, query.prompt_tokens)
        b.predicted_queries += query.prompt_tokens
        if query.named:
            b.named_tokens += query.prompt_tokens
        else:
            b.unnamed_tokens += query.prompt_tokens
        b.predicted_hits += (query.cached if query.by_blocks is None else query.by_blocks).get(backend_id, 0)
        if self._routed is not None:
            self._routed.append((backend_id, query.blocks, query.session, query.prompt_tokens))

    def _touch(self, b: _Backend, blocks: Sequence[int], session: int | None, prompt_tokens: int) -> None:
        if blocks:   # a prompt shorter than a block has none
            added, evicted = b.lru.touch(blocks)
            if added:
                self._placed += len(added)
                self._hold(b, added)
            self._forget(b, evicted)
        if session is not None:
            added, evicted = b.lru.touch((session,), prompt_tokens)
            self._hold(b, added)
            self._forget(b, evicted)
        if self._reuse and self._placed - self._aged_at >= AGE_EVERY:
            self._aged_at = self._placed
            for listed in list(self._reuse):
                self._rate(self._backends[listed])

    def _fit(self, b: _Backend) -> None:
        """The backend's LRU at keep_i · K_i blocks (its oldest blocks forgotten); with KV events at
        EVENTS_ROOM · K_i, a bound only: the engine's own evictions take blocks out (its hits publish
        nothing, so the LRU's order is not the engine's), and routed prompts whose blocks it never
        stored age out past it."""
        capacity = int(b.kv_blocks * b.keep) * (EVENTS_ROOM if b.governed else 1)
        if capacity != b.lru.capacity:
            self._forget(b, b.lru.resize(capacity))
            self._rate(b)

    def _hold(self, b: _Backend, blocks: Iterable[int]) -> None:
        """`blocks` are new in b's LRU; those another backend (or b) evicted lately count as wanted there."""
        holders, held_by, ghosts, bit = self._holders, self._holders.get, self._ghosts, 1 << b.bit
        wanted_by = 0
        for block in blocks:
            holders[block] = held_by(block, 0) | bit
            if ghosts and (evicted_by := ghosts.pop(block, 0)):
                wanted_by |= evicted_by
                for c in _members(evicted_by, self._by_bit):
                    c.wanted += 1
        if wanted_by:
            for c in _members(wanted_by, self._by_bit):   # each rated once, on its counts after the prompt
                self._rate(c)

    def _drop(self, b: _Backend, blocks: list[int]) -> None:
        """`blocks` left b's LRU: out of the holders map."""
        holders, held_by, keep = self._holders, self._holders.get, ~(1 << b.bit)
        for block in blocks:
            if mask := held_by(block, 0) & keep:
                holders[block] = mask
            else:
                holders.pop(block, None)

    def _forget(self, b: _Backend, blocks: list[int]) -> None:
        """`blocks` left b's LRU: out of the holders map, into b's ghost list (as long as its LRU)."""
        if not blocks:
            return
        self._drop(b, blocks)
        ghosts, bit = self._ghosts, 1 << b.bit
        keep = ~bit
        for block in blocks:
            ghosts[block] = ghosts.get(block, 0) | bit
        listed = b.ghosts
        listed.extend(blocks)
        while len(listed) > b.lru.capacity:
            old = listed.popleft()
            if mask := ghosts.get(old, 0) & keep:
                ghosts[old] = mask
            else:
                ghosts.pop(old, None)
        b.evicted += len(blocks)
        b.evicted_at = self._placed
        if b.evicted > REUSE_WINDOW * b.kv_blocks:
            b.evicted, b.wanted = b.evicted / 2, b.wanted / 2
        self._rate(b)

    def _rate(self, b: _Backend) -> None:
        """ρ_i listed while b's cache is full (a new prompt there evicts as much as it adds)."""
        if (full := int(b.kv_blocks * b.keep)) and len(b.lru) >= full and b.evicted >= MIN_EVICTED_SHARE * b.kv_blocks:
            if (rho := self._aged(b)) >= MIN_REUSE:
                self._reuse[b.id] = rho
                return
        self._reuse.pop(b.id, None)

    def _aged(self, b: _Backend) -> float:
        """ρ_i, halved for every K_i blocks the cluster took in since i last evicted."""
        rho = b.reuse
        if rho and (since := self._placed - b.evicted_at):
            rho *= 2.0 ** (-since / max(1, b.kv_blocks))
        return rho

    def evicted_reuse(self, backend_id: str) -> float:
        """ρ_i: of the blocks backend i evicted lately, the share later prompts asked for again, aged by
        what the cluster took in since."""
        return self._aged(self._backends[backend_id])

    def read(self, entry: BackendEntry) -> None:
        """`observe` the counters of the backend's latest report; none before its first (they read 0
        then, and are not its engine's: a gateway started beside a running engine would count the
        engine's whole history as its first reading)."""
        if entry.last_heartbeat is not None:
            self.observe(entry.id, entry.reported.prefix_cache_queries, entry.reported.prefix_cache_hits)
            if (b := self._backends.get(entry.id)) is not None:
                b.granule = entry.reported.kv_block_tokens

    def observe(self, backend_id: str, queries: int, hits: int) -> None:
        """The engine's prefix-cache counters as last reported (cumulative tokens; 0, 0: none yet, or it
        counts none). Only an engine's own report: before one, its counters read 0 and are not its."""
        b = self._backends.get(backend_id)
        if b is None or b.last == (queries, hits):
            return
        if not queries:   # none yet (or an engine that counts none): where its first ones will count from
            if b.last is not None and b.last[0]:   # it counted before: restarted, its cache empty
                self._emptied(b)
            b.last, b.mark = (0, 0), (b.predicted_queries, b.predicted_hits)
            return
        marks = (b.predicted_queries, b.predicted_hits)
        last, b.last = b.last, (queries, hits)
        if last is None or queries < last[0] or hits < last[1]:   # first reading, or the engine restarted
            b.mark = marks
            if last is not None:
                self._emptied(b)
            return
        dq, dh = queries - last[0], hits - last[1]
        b.reported_queries += dq
        b.reported_hits += dh
        w = b.window
        for k, delta in enumerate((marks[0] - b.mark[0], marks[1] - b.mark[1], dq, dh)):
            w[k] = w[k] * DECAY + delta
        b.mark = marks
        b.named_tokens *= DECAY
        b.unnamed_tokens *= DECAY
        if b.governed:   # its events say which blocks it holds: keep_i stays at 1
            if b.keep != 1.0:
                b.keep = 1.0
                self._fit(b)
            return
        if w[2] < MIN_REPORTED_TOKENS:
            return
        if not w[3]:
            if w[1] < MIN_REPORTED_TOKENS:   # nothing predicted, nothing found (a cold cache): no news
                return
            b.keep = 0.0             # hits predicted, none found: the engine caches nothing
        elif not w[1]:               # hits the index did not predict: it forgot too much
            b.keep = min(1.0, max(b.keep, MIN_KEEP) * 2 ** KEEP_GAIN)
        else:
            ratio = (w[3] / w[2]) / (w[1] / w[0])
            b.keep = min(1.0, max(MIN_KEEP, b.keep * ratio ** KEEP_GAIN))
        self._fit(b)

    def _emptied(self, b: _Backend) -> None:
        """b's engine restarted with an empty cache: so is b's LRU here (its blocks go to no ghost list,
        as no placement evicted them)."""
        capacity = b.lru.capacity
        self._drop(b, b.lru.resize(0))
        b.lru.resize(capacity)
        self._rate(b)

    def engine_events(self, backend_id: str, events: Sequence[KvEvent]) -> None:
        """The engine's KV events (vLLM's and SGLang's, `common.kv_events`), in the order it published
        them: the index blocks it stored join its LRU as the most recent (they are in its cache, whoever
        routed them), those it evicted leave it (into its ghost list: an eviction the engine made), and
        AllBlocksCleared empties it. From the first one, keep_i stays where it is: the events, not the
        counters, say what the engine dropped."""
        b = self._backends.get(backend_id)
        if b is None:
            return
        if b.events is None:   # room for twice its KV in engine blocks (16 tokens where it does not say)
            per_block = max(1, self.block_tokens // (b.granule or 16))
            b.events = EngineBlocks(self.block_tokens, max(1 << 16, 2 * b.kv_blocks * per_block))
            if b.governed:
                b.keep = 1.0
            self._fit(b)
        for event in events:
            stored, lost = b.events.apply(event)
            if stored:
                self._touch(b, stored, None, 0)
            elif lost:
                self._forget(b, [block for block in lost if b.lru.discard(block)])
            elif isinstance(event, AllBlocksCleared):
                self._emptied(b)

    def engine_events_lost(self, backend_id: str, batches: int) -> None:
        """`batches` of the engine's events never arrived: the blocks they stored or evicted are unknown.
        The index keeps its blocks (they age out of its LRU); the chain of the engine's blocks is
        forgotten, so a prefix stored before is matched again once the engine stores it afresh."""
        b = self._backends.get(backend_id)
        if b is not None and b.events is not None:
            b.event_gaps += batches
            b.events.forget()

    def engine_events_replayed(self, backend_id: str, batches: int, answered: bool) -> None:
        """A replay brought `batches` missed batches (applied already); `answered`: it ended in time."""
        if (b := self._backends.get(backend_id)) is not None:
            b.events_replayed += batches
            b.replays_failed += not answered

    def engine_events_refused(self, backend_id: str, error: str) -> None:
        """A message from the engine's event endpoint that is no batch of events (`error` says why)."""
        if (b := self._backends.get(backend_id)) is not None:
            b.events_refused += 1
            b.last_refused = error

    def describe(self, backend_id: str) -> dict[str, Any]:
        """For /admin/backends: the index's source, size and predicted vs reported hit rate."""
        b = self._backends[backend_id]
        return {
            "source": b.source,
            "blocks": len(b.lru),
            "capacity_blocks": b.lru.capacity,
            "keep": b.keep,
            "engine_block_tokens": b.granule or None,   # the engine's KV block, which hits are counted in
            "evicted_reuse": self.evicted_reuse(backend_id),
            "predicted_query_tokens": b.predicted_queries,
            "predicted_hit_tokens": b.predicted_hits,
            "predicted_hit_rate": b.predicted_hits / b.predicted_queries if b.predicted_queries else None,
            "reported_query_tokens": b.reported_queries,
            "reported_hit_tokens": b.reported_hits,
            "reported_hit_rate": b.reported_hits / b.reported_queries if b.reported_queries else None,
            "events": None if b.events is None and not b.events_refused and not b.replays_failed else {
                **(b.events.describe() if b.events is not None else {}), "lost_batches": b.event_gaps,
                "replayed_batches": b.events_replayed, "failed_replays": b.replays_failed,
                "refused_messages": b.events_refused, "last_refused": b.last_refused},
        }

    def __contains__(self, backend_id: object) -> bool:
        return backend_id in self._backends

    def held_blocks(self) -> int:
        """Distinct block hashes held by any backend (the holders map's size)."""
        return len(self._holders)


def _credit(cached: dict[str, int], mask: int, by_bit: list[_Backend], tokens: int, prompt_tokens: int) -> None:
    """The backends of `mask` hold the prompt's first `tokens` tokens: each saves as many of them as
    fill whole blocks of its engine's KV (the engine keeps whole blocks only)."""
    hit = cached_tokens(tokens, prompt_tokens)
    if hit:
        for b in _members(mask, by_bit):
            granule = b.granule
            if granule > 1:
                if saved := hit - hit % granule:
                    cached[b.id] = saved
            else:
                cached[b.id] = hit


def _members(mask: int, by_bit: list[_Backend]) -> Iterable[_Backend]:
    while mask:
        low = mask & -mask
        yield by_bit[low.bit_length() - 1]
        mask ^= low
