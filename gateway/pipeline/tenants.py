"""Tenants on the request path: each request's tenant, its rate limits and budget, its usage.

The door finds the tenant from the API key (`KeyRing.check`) and puts its name on the job. The pipeline
takes a `Ticket` for it before anything waits (`Tenants.ticket`); a tenant with limits is charged at
once (`Tenants.charge`): one request against its requests per minute, and the most tokens it can take
(the prompt's estimate + `max_tokens` for each of its `n` choices, as OpenAI's limits count them) against
its tokens per minute and per day; a max_tokens the client left to the gateway is lowered to what the
limits leave (`fitted`). A limit the charge would pass refuses the request with 429, `Retry-After` (the
end of the window) and OpenAI's error shape; nothing of a refused request is counted, and other tenants
are not touched. When the request ends, whatever the outcome, `RequestLog.finish` hands the ticket its
real usage (`Ticket.finish`): what it did not use is refunded (only into the window it was charged in; a
prompt longer than its estimate is charged), and the tenant's counters are updated. Charging the bound
keeps concurrent requests from passing a limit together: charged only their prompts, ten requests of 300
tokens each took 1,290 tokens of a 300-token minute.

Windows are fixed: the whole minute, the UTC day. A window's count resets when the next one starts, so a
tenant may send up to twice its limit across one window boundary; within any one window what its
requests use holds to the limit (a prompt's tokens beyond the gateway's estimate excepted). The counters
live in a `LimitStore`: in this process (`MemoryLimitStore`) or, with `--redis-url`, in Redis for every
replica at once (`gateway.replicas.tenant_limits`). A store that cannot answer raises
`LimitStoreUnavailable`, and `gateway.tenants.on_redis_error` decides: `open` admits uncounted, `closed`
answers 503.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import structlog
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.config.tenants import TenantPolicy, TenantsConfig
from gateway.pipeline.admission import Flow, Share
from gateway.pipeline.request_metrics import CounterTable
from gateway.requests.errors import LimiterUnavailable, RateLimited
from gateway.requests.job import DEFAULT_TENANT, GenerationJob

log = structlog.get_logger("tenants")

Reason = Literal["requests_per_minute", "tokens_per_minute", "tokens_per_day"]
MINUTE_S, DAY_S = 60, 86_400
_WORDS = {"requests_per_minute": "requests per minute", "tokens_per_minute": "tokens per minute",
          "tokens_per_day": "tokens per day"}


@dataclass(frozen=True, slots=True)
class Limit:
    reason: Reason
    period_s: int
    limit: int

    @property
    def tokens(self) -> bool:
        return self.reason != "requests_per_minute"


@dataclass(frozen=True, slots=True)
class Charge:
    """A store's answer: admitted, with the window each limit was charged in; or refused by
    `limits[refused]`, whose window holds `used` and ends in `retry_after_s`."""

    admitted: bool
    windows: tuple[int, ...] = ()
    refused: int = -1
    used: int = 0
    retry_after_s: float = 0.0


@dataclass(frozen=True, slots=True)
class WindowUsage:
    used: int
    resets_in_s: float


class LimitStoreUnavailable(Exception):
    """The store could not answer in time (Redis away); the caller applies `on_redis_error`."""


class LimitStore(Protocol):
    """Fixed-window counters per tenant and limit. `charge` is atomic over a tenant's limits: all are
    charged or none. `adjust` adds `deltas` to the windows charged (`windows`): into the current window
    when it is that one, a positive delta into the current one otherwise, a negative one then dropped."""

    async def charge(self, tenant: str, limits: Sequence[Limit], amounts: Sequence[int]) -> Charge: ...

    def adjust(self, tenant: str, limits: Sequence[Limit], windows: Sequence[int], deltas: Sequence[int]) -> None: ...

    async def read(self, tenant: str, limits: Sequence[Limit]) -> list[WindowUsage]: ...


class MemoryLimitStore:
    """The counters in this process. `clock`: wall-clock seconds (windows start on whole minutes and
    UTC days)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._counts: dict[tuple[str, Reason], tuple[int, int]] = {}   # -> (window, count)

    def _count(self, tenant: str, limit: Limit, window: int) -> int:
        stored = self._counts.get((tenant, limit.reason))
        return stored[1] if stored is not None and stored[0] == window else 0

    async def charge(self, tenant: str, limits: Sequence[Limit], amounts: Sequence[int]) -> Charge:
        now = self._clock()
        windows = tuple(int(now // lim.period_s) for lim in limits)
        counts = [self._count(tenant, lim, w) for lim, w in zip(limits, windows, strict=True)]
        for i, (lim, amount, count) in enumerate(zip(limits, amounts, counts, strict=True)):
            if count + amount > lim.limit:
                return Charge(False, refused=i, used=count, retry_after_s=(windows[i] + 1) * lim.period_s - now)
        for lim, w, amount, count in zip(limits, windows, amounts, counts, strict=True):
            self._counts[tenant, lim.reason] = (w, count + amount)
        return Charge(True, windows)

    def adjust(self, tenant: str, limits: Sequence[Limit], windows: Sequence[int], deltas: Sequence[int]) -> None:
        now = self._clock()
        for lim, charged, delta in zip(limits, windows, deltas, strict=True):
            w = int(now // lim.period_s)
            if delta > 0 or (delta and w == charged):
                self._counts[tenant, lim.reason] = (w, max(0, self._count(tenant, lim, w) + delta))

    async def read(self, tenant: str, limits: Sequence[Limit]) -> list[WindowUsage]:
        now = self._clock()
        out = []
        for lim in limits:
            w = int(now // lim.period_s)
            out.append(WindowUsage(self._count(tenant, lim, w), (w + 1) * lim.period_s - now))
        return out


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    policy: TenantPolicy
    limits: tuple[Limit, ...]
    flow: Flow   # its place in the admission queue

    @classmethod
    def build(cls, name: str, policy: TenantPolicy) -> Tenant:
        given: tuple[tuple[Reason, int, int | None], ...] = (
            ("requests_per_minute", MINUTE_S, policy.requests_per_minute),
            ("tokens_per_minute", MINUTE_S, policy.tokens_per_minute),
            ("tokens_per_day", DAY_S, policy.tokens_per_day))
        limits = tuple(Limit(reason, period, n) for reason, period, n in given if n is not None)
        return cls(name, policy, limits, Flow(name, policy.priority, policy.weight, policy.min_in_flight))


class Ticket:
    """One request of a tenant, from its admission to its end: what it was charged, to be corrected."""

    __slots__ = ("amounts", "bound", "owner", "prompt", "share", "tenant", "windows")

    def __init__(self, owner: Tenants, tenant: Tenant, prompt: int, bound: int) -> None:
        self.owner, self.tenant, self.prompt, self.bound = owner, tenant, prompt, bound
        self.share = Share(tenant.flow, bound)
        self.windows: tuple[int, ...] = ()   # the windows its limits were charged in (none: not charged)
        self.amounts: tuple[int, ...] = ()   # what each of its tenant's limits was charged

    @property
    def name(self) -> str:
        return self.tenant.name

    def finish(self, status: int, prompt_tokens: int, completion_tokens: int) -> None:
        """The request ended (any outcome) having taken these tokens: count them, correct the charges."""
        self.owner.finish(self, status, prompt_tokens, completion_tokens)


class Tenants:
    """Every tenant of the config (the `default` one included), their limits' store and their counters."""

    def __init__(self, config: TenantsConfig, store: LimitStore | None = None) -> None:
        self.by_name = {DEFAULT_TENANT: Tenant.build(DEFAULT_TENANT, config.default)} | {
            name: Tenant.build(name, spec) for name, spec in config.teams.items()}
        self.store: LimitStore = store or MemoryLimitStore()
        self.fail_closed = config.on_redis_error == "closed"
        self.requests = CounterTable("heterogate_tenant_requests", "Requests of each tenant that reached "
                                     "admission, by final status", ["tenant", "status"])
        self.prompt_tokens = CounterTable("heterogate_tenant_prompt_tokens", "Prompt tokens of each tenant's "
                                          "requests (engine usage)", ["tenant"])
        self.completion_tokens = CounterTable("heterogate_tenant_completion_tokens", "Completion tokens of each "
                                              "tenant's requests (engine usage)", ["tenant"])
        self.rate_limited = CounterTable("heterogate_tenant_rate_limited", "Requests refused with 429 (or 503 "
                                         "limiter_unavailable), by the limit that refused them", ["tenant", "reason"])
        self.limiter_errors = CounterTable("heterogate_tenant_limiter_errors", "Charges the limits' store could "
                                           "not answer (Redis away), by what was done: admitted or refused",
                                           ["outcome"])
        # Each series that can count exists from the start, at 0: an alert's rate() over a series that
        # appears with its first count misses that count (HeteroGateTenantLimitsUnchecked).
        limited = [tenant for tenant in self.by_name.values() if tenant.limits]
        if limited:
            self.limiter_errors.inc(("refused" if self.fail_closed else "admitted",), 0.0)
        for tenant in limited:
            reasons = {lim.reason for lim in tenant.limits} | ({"limiter_unavailable"} if self.fail_closed else set())
            for reason in sorted(reasons):
                self.rate_limited.inc((tenant.name, reason), 0.0)

    def fitted(self, job: GenerationJob) -> GenerationJob:
        """The job, its max_tokens lowered to what its tenant's token limits leave beside its prompt where
        the client left max_tokens to the gateway: the default means "as many as fit", and charged at its
        bound (`charge`) a default above a small limit would refuse every request of that tenant."""
        tenant = self.by_name.get(job.tenant) or self.by_name[DEFAULT_TENANT]
        if job.max_tokens_asked or not tenant.limits:
            return job
        room = min((lim.limit for lim in tenant.limits if lim.tokens), default=None)
        fit = None if room is None else (room - job.prompt_tokens - job.image_tokens) // job.choices
        return job if fit is None or fit < 1 or fit >= job.max_tokens else replace(job, max_tokens=fit)

    def ticket(self, job: GenerationJob) -> Ticket:
        """The job's ticket; not charged yet (`charge`, for a tenant with limits)."""
        tenant = self.by_name.get(job.tenant) or self.by_name[DEFAULT_TENANT]
        prompt = job.prompt_tokens + job.image_tokens
        return Ticket(self, tenant, prompt, prompt + job.choices * job.max_tokens)

    async def charge(self, ticket: Ticket) -> None:
        """Charge the ticket's tenant one request and its estimated tokens; RateLimited if a limit would
        pass (nothing charged), LimiterUnavailable if the store is away and `on_redis_error: closed`."""
        tenant = ticket.tenant
        limits = tenant.limits
        for lim in limits:
            if lim.tokens and ticket.bound > lim.limit:   # no window would ever take it: no Retry-After
                self.rate_limited.inc((tenant.name, lim.reason))
                raise RateLimited(f"Request too large for tenant {tenant.name!r} on {_WORDS[lim.reason]}: limit "
                                  f"{lim.limit}, requested {ticket.bound} (prompt + n × max_tokens)", kind="tokens",
                                  retry_after_s=None)
        amounts = [ticket.bound if lim.tokens else 1 for lim in limits]
        try:
            charge = await self.store.charge(tenant.name, limits, amounts)
        except LimitStoreUnavailable:   # the store logs what went wrong; the client learns no address
            if self.fail_closed:
                self.limiter_errors.inc(("refused",))
                self.rate_limited.inc((tenant.name, "limiter_unavailable"))
                raise LimiterUnavailable(f"the rate limits of tenant {tenant.name!r} cannot be checked right now; "
                                         "retry later") from None
            self.limiter_errors.inc(("admitted",))
            return
        if not charge.admitted:
            lim = limits[charge.refused]
            self.rate_limited.inc((tenant.name, lim.reason))
            wait_s = max(1, math.ceil(charge.retry_after_s))
            raise RateLimited(f"Rate limit reached for tenant {tenant.name!r} on {_WORDS[lim.reason]}: limit "
                              f"{lim.limit}, used {charge.used}, requested {amounts[charge.refused]}. Please try "
                              f"again in {wait_s} s.", kind="tokens" if lim.tokens else "requests",
                              retry_after_s=wait_s)
        ticket.windows, ticket.amounts = charge.windows, tuple(amounts)

    def refused_before_ticket(self, caller: str, status: int) -> None:
        """A request of `caller`'s refused before it had a ticket (a 400 for its body, a 404 for its model):
        counted among its tenant's requests by status, as its log line names the tenant."""
        tenant = self.by_name.get(caller) or self.by_name[DEFAULT_TENANT]
        self.requests.inc((tenant.name, str(status)))

    def finish(self, ticket: Ticket, status: int, prompt_tokens: int, completion_tokens: int) -> None:
        name = ticket.tenant.name
        self.requests.inc((name, str(status)))
        if prompt_tokens or completion_tokens:
            self.prompt_tokens.inc((name,), prompt_tokens)
            self.completion_tokens.inc((name,), completion_tokens)
        used = prompt_tokens + completion_tokens
        ticket.share.end(used)
        if ticket.windows:
            limits = ticket.tenant.limits
            deltas = [used - amount if lim.tokens else 0 for lim, amount in zip(limits, ticket.amounts, strict=True)]
            if any(deltas):
                self.store.adjust(name, limits, ticket.windows, deltas)
            ticket.windows = ()

    async def usage(self) -> list[dict[str, Any]]:
        """Per tenant: its policy, its current windows (every replica's, with Redis), and this process's
        requests (waiting in admission, under way, ended by status), tokens and refusals since start;
        `windows_available` is False where the store could not be read."""
        out = []
        for name, tenant in self.by_name.items():
            windows: dict[str, Any] = {}
            try:
                read = await self.store.read(name, tenant.limits)
                windows = {lim.reason: {"limit": lim.limit, "used": u.used, "resets_in_s": round(u.resets_in_s, 3)}
                           for lim, u in zip(tenant.limits, read, strict=True)}
                available = True
            except LimitStoreUnavailable:
                available = False
            statuses = {labels[1]: int(n) for labels, n in self.requests.items() if labels[0] == name}
            out.append({
                "tenant": name, "priority": tenant.policy.priority, "weight": tenant.policy.weight,
                "limits": {lim.reason: lim.limit for lim in tenant.limits}, "windows": windows,
                "windows_available": available, "waiting": len(tenant.flow.waiters),
                "in_flight": tenant.flow.in_flight,
                "requests": sum(statuses.values()), "requests_by_status": statuses,
                "prompt_tokens": int(self.prompt_tokens.value((name,))),
                "completion_tokens": int(self.completion_tokens.value((name,))),
                "rate_limited": {labels[1]: int(n) for labels, n in self.rate_limited.items() if labels[0] == name},
            })
        return out


class TenantCollector(Collector):
    """/metrics: the tenants' counters, and their requests waiting in the admission queue and under way."""

    def __init__(self, tenants: Tenants) -> None:
        self._tenants = tenants

    def collect(self) -> Iterator[Metric]:
        t = self._tenants
        for table in (t.requests, t.prompt_tokens, t.completion_tokens, t.rate_limited, t.limiter_errors):
            yield table.family()
        waiting = GaugeMetricFamily("heterogate_tenant_admission_waiting", "Requests of the tenant waiting "
                                    "in the admission queue", labels=["tenant"])
        in_flight = GaugeMetricFamily("heterogate_tenant_in_flight", "Requests of the tenant admitted and not "
                                      "ended", labels=["tenant"])
        for name, tenant in t.by_name.items():
            waiting.add_metric([name], len(tenant.flow.waiters))
            in_flight.add_metric([name], tenant.flow.in_flight)
        yield waiting
        yield in_flight
