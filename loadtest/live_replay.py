"""Open-loop replay of a request trace against a running gateway, timed at the client.

Each request is sent at its own scheduled time whatever happened to the earlier ones (open loop:
a slow gateway builds a queue instead of slowing the arrivals), streamed over SSE so that the time
of the first token is the moment the client reads it, and counted token by token.

Simulated engines stop a completion at a length drawn from its request id (`natural_length`) unless
`max_tokens` comes first, and the gateway honours `x-request-id`; `request_id_for` picks an id whose
natural length is the wanted one, so a replayed request emits exactly the trace's output tokens
while its KV reservation (prompt + max_tokens) stays the trace's own.

`warm_up` runs before the replay on the same client: it opens connections and channels, and gives
every engine one measured T̄_service, so the replay does not start on cold paths or mixed units.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import httpx

from backends.sim_executor import NATURAL_MAX_TOKENS, NATURAL_MIN_TOKENS, natural_length
from gateway.requests.tokens import BYTES_PER_TOKEN

START_DELAY_S = 0.2     # lead time before the first arrival, so that arrival 0 is not already late
LAG_PROBE_S = 0.01      # the client's clock probe: how late a sleep this long wakes up (CPU contention)


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    request_id: str
    at_s: float             # send time, seconds after the replay's origin
    prompt_tokens: int      # what the gateway's estimate (bytes / 4) will count
    max_tokens: int


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    sent_s: float           # seconds after the replay's origin
    first_token_s: float    # NaN when no token arrived
    finish_s: float
    tokens: int             # token events read from the stream
    prompt_tokens: int      # prompt_tokens of the final usage event (-1 if none came)
    backend: str            # x-heterogate-backend
    error: str              # "" when the stream ended with [DONE] and no error event


def request_id_for(output_tokens: int, prefix: str) -> str:
    """The first id `prefix-k` whose simulated natural completion is exactly `output_tokens` long."""
    if not NATURAL_MIN_TOKENS <= output_tokens <= NATURAL_MAX_TOKENS:
        raise ValueError(
            f"a simulated engine ends a completion after {NATURAL_MIN_TOKENS}..{NATURAL_MAX_TOKENS} tokens; "
            f"{output_tokens} cannot be replayed"
        )
    k = 0
    while natural_length(f"{prefix}-{k}") != output_tokens:
        k += 1
    return f"{prefix}-{k}"


def prompt_text(tokens: int, tag: str) -> str:
    """A prompt of exactly `tokens` estimated tokens (gateway.requests.tokens.count_text_tokens) that starts
    with `tag` (ASCII, the request's own id): no two requests share a prefix block, so no engine's prefix
    cache turns a replayed trace (which shares nothing) into one that does."""
    size = tokens * BYTES_PER_TOKEN     # ASCII: BYTES_PER_TOKEN bytes per token
    return (tag + " " + ("a" * (BYTES_PER_TOKEN - 1) + " ") * tokens)[:size]


def replay_client(url: str, connections: int, request_timeout_s: float) -> httpx.AsyncClient:
    """One client for the warm-up and the replay, so the replay starts on open connections."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=connections)
    timeout = httpx.Timeout(connect=5.0, read=request_timeout_s, write=5.0, pool=5.0)
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits)


async def warm_up(
    client: httpx.AsyncClient, model: str, backends: int, prompt_tokens: int, output_tokens: int, timeout_s: float
) -> None:
    """Complete one request on every backend, then wait until all are idle again.

    `backends` concurrent requests reach `backends` different engines, because the router counts a
    request in flight the moment it dispatches it. Besides opening connections and channels, this
    replaces each engine's T̄_service prior with one measured request of the prior's own shape.
    """
    ids = [request_id_for(output_tokens, f"warm-{k}") for k in range(backends)]
    warm = [ReplayRequest(rid, 0.0, prompt_tokens, output_tokens) for rid in ids]
    outcomes = await asyncio.gather(*(_one(client, model, r, time.monotonic()) for r in warm))
    failed = [o.error for o in outcomes if o.error]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")
    deadline = time.monotonic() + timeout_s
    while True:
        rows = (await client.get("/admin/backends")).raise_for_status().json()["data"]
        if all(b["requests_completed"] >= 1 and b["queue_depth"] == 0 and b["in_flight"] == 0 for b in rows):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"backends not warm and idle after {timeout_s} s: {rows}")
        await asyncio.sleep(0.05)


async def replay(
    client: httpx.AsyncClient, model: str, requests: list[ReplayRequest]
) -> tuple[list[ReplayOutcome], list[float]]:
    """Send every request at its `at_s`, stream them all to the end.

    Returns the outcomes in request order and the client loop's oversleeps (seconds late on each
    LAG_PROBE_S sleep during the replay): how much CPU contention the processes suffered.
    """
    origin = time.monotonic() + START_DELAY_S
    lags: list[float] = []
    probe = asyncio.create_task(_probe_lag(lags))
    tasks: list[asyncio.Task[ReplayOutcome]] = []
    try:
        for r in requests:
            delay = origin + r.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, model, r, origin)))
        outcomes = list(await asyncio.gather(*tasks))
    finally:
        probe.cancel()
    return outcomes, lags


async def _probe_lag(lags: list[float]) -> None:
    while True:
        t = time.monotonic()
        await asyncio.sleep(LAG_PROBE_S)
        lags.append(time.monotonic() - t - LAG_PROBE_S)


async def _one(client: httpx.AsyncClient, model: str, r: ReplayRequest, origin: float) -> ReplayOutcome:
    body = {"model": model, "prompt": prompt_text(r.prompt_tokens, r.request_id), "max_tokens": r.max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    stream, backend = _Stream(), ""
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"x-request-id": r.request_id}) as resp:
            backend = resp.headers.get("x-heterogate-backend", "")
            if resp.status_code == 200:
                await stream.read(resp)
            else:
                stream.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
    except httpx.HTTPError as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    return ReplayOutcome(sent - origin, stream.first - origin, time.monotonic() - origin, stream.tokens,
                         stream.usage.get("prompt_tokens", -1), backend, stream.error)


@dataclass(slots=True)
class _Stream:
    """What one SSE stream delivered: first-token time, token events, the usage event, an error."""

    first: float = math.nan
    tokens: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    error: str = ""

    async def read(self, resp: httpx.Response) -> None:
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                return
            event = json.loads(payload)
            if "error" in event:
                self.error = str(event["error"].get("message", event["error"]))
            elif event.get("choices"):
                self.tokens += 1
                if self.tokens == 1:
                    self.first = time.monotonic()
            elif event.get("usage"):
                self.usage = event["usage"]
        self.error = self.error or "stream ended without [DONE]"
