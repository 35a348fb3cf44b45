"""Tenants' limits in one process: fixed windows on an injected wall clock (whole minutes, UTC days),
charges all-or-nothing over a tenant's limits, usage reconciled at the end, the 429 a client gets, and
the counters of each tenant."""

from __future__ import annotations

import pytest

from gateway.config.tenants import TenantsConfig
from gateway.pipeline.tenants import DAY_S, MINUTE_S, Limit, MemoryLimitStore, Tenants
from gateway.requests.errors import RateLimited, openai_error_body
from gateway.requests.job import GenerationJob

RPM = Limit("requests_per_minute", MINUTE_S, 3)
TPM = Limit("tokens_per_minute", MINUTE_S, 100)
TPD = Limit("tokens_per_day", DAY_S, 250)
T0 = 1_800_000_020.0   # 20 s into a minute (wall-clock seconds)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_a_minute_window_holds_its_limit_and_the_next_minute_starts_afresh() -> None:
    clock = Clock(T0)   # 20 s into its minute
    store = MemoryLimitStore(clock)
    for _ in range(3):
        assert (await store.charge("a", [RPM], [1])).admitted
    refused = await store.charge("a", [RPM], [1])
    assert not refused.admitted and refused.used == 3 and refused.retry_after_s == pytest.approx(40.0)
    clock.now += 39.9
    assert not (await store.charge("a", [RPM], [1])).admitted
    clock.now += 0.1   # the next whole minute
    assert (await store.charge("a", [RPM], [1])).admitted
    assert [u.used for u in await store.read("a", [RPM])] == [1]
    assert (await store.charge("b", [RPM], [1])).admitted   # another tenant's counter


async def test_a_charge_is_all_or_nothing_over_the_tenants_limits() -> None:
    clock = Clock(T0)
    store = MemoryLimitStore(clock)
    assert (await store.charge("a", [RPM, TPM, TPD], [1, 90, 90])).admitted
    refused = await store.charge("a", [RPM, TPM, TPD], [1, 20, 20])   # 110 tokens this minute: over
    assert (refused.admitted, refused.refused, refused.used) == (False, 1, 90)
    assert [u.used for u in await store.read("a", [RPM, TPM, TPD])] == [1, 90, 90]   # nothing charged


async def test_the_daily_budget_is_the_utc_day() -> None:
    clock = Clock(T0)
    store = MemoryLimitStore(clock)
    assert (await store.charge("a", [TPD], [200])).admitted
    refused = await store.charge("a", [TPD], [100])
    midnight = (T0 // DAY_S + 1) * DAY_S
    assert not refused.admitted and refused.retry_after_s == pytest.approx(midnight - T0)
    clock.now = midnight
    assert (await store.charge("a", [TPD], [100])).admitted


async def test_usage_is_reconciled_into_the_window_it_was_charged_to() -> None:
    clock = Clock(T0)
    store = MemoryLimitStore(clock)
    charge = await store.charge("a", [TPM], [50])
    store.adjust("a", [TPM], charge.windows, [30])      # the request took 80 tokens, not 50
    assert [u.used for u in await store.read("a", [TPM])] == [80]
    store.adjust("a", [TPM], charge.windows, [-60])     # a refund, in the same window
    assert [u.used for u in await store.read("a", [TPM])] == [20]
    clock.now += 60
    store.adjust("a", [TPM], charge.windows, [-20])     # the window has passed: no credit in the next
    assert [u.used for u in await store.read("a", [TPM])] == [0]
    store.adjust("a", [TPM], charge.windows, [25])      # usage that ran into the next window counts there
    assert [u.used for u in await store.read("a", [TPM])] == [25]


def tenants(clock: Clock, **teams: dict[str, object]) -> Tenants:
    config = TenantsConfig.model_validate({"teams": {n: {"api_keys_env": "UNUSED", **t} for n, t in teams.items()}})
    return Tenants(config, MemoryLimitStore(clock))


def job(tenant: str, prompt_tokens: int = 10, max_tokens: int = 5) -> GenerationJob:
    return GenerationJob("r", "hi", prompt_tokens, max_tokens, tenant=tenant)


async def test_over_a_limit_is_openais_429_and_other_tenants_are_untouched() -> None:
    t = tenants(Clock(T0), a={"requests_per_minute": 2}, b={"requests_per_minute": 2})
    for _ in range(2):
        await t.charge(t.ticket(job("a")))
    with pytest.raises(RateLimited) as err:
        await t.charge(t.ticket(job("a")))
    exc = err.value
    assert exc.status == 429 and exc.retry_after_s == 40
    body = openai_error_body(exc)["error"]
    assert body["type"] == "requests" and body["code"] == "rate_limit_exceeded"
    assert "tenant 'a' on requests per minute: limit 2, used 2, requested 1" in body["message"]
    await t.charge(t.ticket(job("b")))
    assert t.rate_limited.items() == [(("a", "requests_per_minute"), 1.0), (("b", "requests_per_minute"), 0.0)]


async def test_tokens_are_charged_at_their_bound_and_corrected_by_usage_at_the_end() -> None:
    """Admission charges prompt + max_tokens (the most the request can take, as OpenAI's limits count);
    the end refunds what it did not use."""
    clock = Clock(T0)
    t = tenants(clock, a={"tokens_per_minute": 100})
    first = t.ticket(job("a", prompt_tokens=40, max_tokens=55))
    await t.charge(first)   # 95 charged
    with pytest.raises(RateLimited) as err:   # 95 + 15 > 100 while the first is under way
        await t.charge(t.ticket(job("a", prompt_tokens=10)))
    assert err.value.type == "tokens" and err.value.retry_after_s == 40
    first.finish(200, 40, 50)   # it took 90: 5 back
    second = t.ticket(job("a", prompt_tokens=5, max_tokens=5))
    await t.charge(second)   # 90 + 10
    second.finish(429, 0, 0)   # refused later on (queue full): its charge is given back
    assert [u.used for u in await t.store.read("a", t.by_name["a"].limits)] == [90]
    assert t.prompt_tokens.value(("a",)) == 40 and t.completion_tokens.value(("a",)) == 50
    assert t.requests.items() == [(("a", "200"), 1.0), (("a", "429"), 1.0)]


async def test_concurrent_requests_cannot_pass_a_token_limit_together() -> None:
    """Ten requests of 300 tokens at once against 300 tokens a minute: one is admitted, and what the
    admitted ones use stays within the limit."""
    t = tenants(Clock(T0), a={"tokens_per_minute": 300})
    admitted = []
    for _ in range(10):
        ticket = t.ticket(job("a", prompt_tokens=29, max_tokens=271))
        try:
            await t.charge(ticket)
            admitted.append(ticket)
        except RateLimited:
            pass
    assert len(admitted) == 1
    for ticket in admitted:
        ticket.finish(200, 29, 271)
    assert [u.used for u in await t.store.read("a", t.by_name["a"].limits)] == [300]


async def test_a_request_larger_than_a_token_limit_is_refused_without_retry_after() -> None:
    t = tenants(Clock(T0), a={"tokens_per_minute": 100})
    with pytest.raises(RateLimited, match=r"Request too large for tenant 'a' on tokens per minute: limit 100, "
                                          r"requested 101 \(prompt \+ n × max_tokens\)") as err:
        await t.charge(t.ticket(job("a", prompt_tokens=96)))   # 96 + 5
    assert err.value.retry_after_s is None


async def test_a_max_tokens_left_to_the_gateway_is_lowered_to_what_the_limit_leaves() -> None:
    """The gateway's default of 256 beside a 20-token prompt under 200 tokens a minute: lowered to 180, so
    the request runs (charged at its bound, 200) and can take no more than the limit; one the client
    asked for is left as asked (and refused: it could pass the limit by itself)."""
    t = tenants(Clock(T0), a={"tokens_per_minute": 200})
    left = GenerationJob("r", "hi", 20, 256, tenant="a", max_tokens_asked=False)
    fitted = t.fitted(left)
    assert fitted.max_tokens == 180
    ticket = t.ticket(fitted)
    await t.charge(ticket)
    ticket.finish(200, 20, 30)
    assert [u.used for u in await t.store.read("a", t.by_name["a"].limits)] == [50]
    asked = job("a", prompt_tokens=20, max_tokens=256)
    assert t.fitted(asked) is asked
    with pytest.raises(RateLimited, match="Request too large"):
        await t.charge(t.ticket(asked))
    assert t.fitted(GenerationJob("r", "hi", 20, 256, tenant="b", max_tokens_asked=False)).max_tokens == 256


async def test_each_of_n_choices_is_charged_its_max_tokens() -> None:
    """A kind: openai upstream makes n completions of up to max_tokens each: one request of n = 8 could take
    8 times what its max_tokens says, so the bound charged, the refusal of a request too large and the
    max_tokens fitted to a limit all count n."""
    t = tenants(Clock(T0), a={"tokens_per_minute": 300})
    with pytest.raises(RateLimited, match=r"requested 2008 \(prompt \+ n × max_tokens\)"):
        await t.charge(t.ticket(GenerationJob("r", "hi", 8, 250, tenant="a", choices=8)))
    left = t.fitted(GenerationJob("r", "hi", 20, 256, tenant="a", max_tokens_asked=False, choices=4))
    assert left.max_tokens == 70           # (300 - 20) // 4
    ticket = t.ticket(left)
    await t.charge(ticket)
    assert [u.used for u in await t.store.read("a", t.by_name["a"].limits)] == [300]


def test_a_key_of_no_tenant_is_the_default_tenants() -> None:
    t = tenants(Clock(T0), a={"weight": 3, "priority": 2})
    assert t.ticket(job("default")).name == "default"
    ticket = t.ticket(job("a", prompt_tokens=10, max_tokens=5))
    assert (ticket.share.flow.weight, ticket.share.flow.priority, ticket.share.cost) == (3, 2, 15)


def test_the_refusal_series_exist_at_zero_before_the_first_refusal() -> None:
    """An alert's rate() misses the count a series appears with: each series a tenant's limits can
    count is there, at 0, from the start (and none for a tenant without limits)."""
    t = tenants(Clock(T0), a={"requests_per_minute": 2, "tokens_per_day": 1000}, b={})
    assert sorted(t.rate_limited.items()) == [(("a", "requests_per_minute"), 0.0), (("a", "tokens_per_day"), 0.0)]
    assert t.limiter_errors.items() == [(("admitted",), 0.0)]   # on_redis_error: open, the default
    closed = Tenants(TenantsConfig.model_validate({"on_redis_error": "closed", "teams": {
        "a": {"api_keys_env": "UNUSED", "requests_per_minute": 2}}}), MemoryLimitStore(Clock(T0)))
    assert sorted(closed.rate_limited.items()) == [(("a", "limiter_unavailable"), 0.0),
                                                   (("a", "requests_per_minute"), 0.0)]
    assert closed.limiter_errors.items() == [(("refused",), 0.0)]
