"""Emulated OpenAI-compatible engines of several GPU tiers, for the mixed-tier routing benchmark.

    python benchmarks/emulated_engine.py --engine h100-0:H100:PORT --engine l40s-0:L40S:PORT ... \
        [--time-scale 1]

One process serves every engine given, each on its own port (bare asyncio + httptools, like
benchmarks/mock_openai_engine.py, so that the engines cost little CPU). Each engine is a vLLM-like
continuous batcher in emulated time:

- admission: FIFO; a request is admitted when the KV blocks for prompt + max_tokens are free and the
  batch has fewer than `max_num_seqs` sequences (no preemption);
- a step decodes one token for every running sequence and spends what is left of the token budget
  (`max_batched_tokens`) on chunked prefill, oldest first; the step that ends a prompt's prefill
  yields its first token; or, for a tier with `prefill_first` (vLLM v0-like, the engine family's
  other scheduler, loadtest/sim/family.py), a step prefills whole admitted prompts (oldest first, up to
  the budget, at least one) while every running sequence waits, and decodes only when none is left;
- step time = base + per_seq · decoding + kv_read · context tokens + prefill · prefill tokens;
- with `--prefix-caching` (vLLM's automatic prefix caching, on by default in vLLM): a prompt's leading
  blocks still in the cache (held by running sequences, or cached in free KV blocks, evicted least
  recently used first) are not prefilled again (`common.prefix_blocks.EnginePrefixCache`; blocks of the
  prompt rendered as the gateway renders a chat, `role: text` lines); /metrics then carries
  `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (tokens), and `POST
  /reset_prefix_cache` (vLLM's) drops the cached blocks that no running sequence holds.

Tier speeds are of the order of a 7B model in vLLM on each GPU (measured MFU, not datasheet peaks:
the gateway's performance-model priors are 3-4x off on purpose) and KV sizes of that order too.
`--time-scale k` runs k emulated seconds per real second (thresholds scale by 1/k).

Endpoints: `POST /v1/chat/completions` (streamed SSE, one event per token, usage when asked; or one
JSON body), `POST /tokenize` (vLLM's: one id per 4 bytes of the rendered prompt; vllm-router's
cache_aware asks for it), `GET /v1/models` (with `max_model_len`), `GET /metrics` (vLLM names:
num_requests_running/waiting, kv_cache_usage_perc and gpu_cache_usage_perc, cache_config_info,
e2e_request_latency_seconds, generation_tokens_total), `GET /health`. Each SSE event names the engine
in `system_fingerprint`, so the client can count tier shares through any router.
Prompt tokens are counted as the gateway counts them (4 bytes a token, 4 per message).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import orjson

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script: the shared package from this checkout
    sys.path.insert(0, str(ROOT))

from common.prefix_blocks import EnginePrefixCache, block_hashes  # noqa: E402

MODEL = "llava-1.5-7b"
MAX_MODEL_LEN = 4096
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class TierSpeed:
    """One GPU tier, in emulated seconds."""

    name: str
    step_base_s: float          # weights streamed once per step
    per_seq_s: float            # per decoding sequence in the step
    kv_read_s: float            # per context token held by the running batch
    prefill_s_per_token: float
    kv_tokens: int
    max_num_seqs: int = 256
    max_batched_tokens: int = 512
    prefill_first: bool = False   # vLLM v0-like: whole prompts in a step of their own while decodes wait

    @property
    def num_blocks(self) -> int:
        return self.kv_tokens // BLOCK_SIZE


TIERS: dict[str, TierSpeed] = {
    "H100": TierSpeed("H100", 0.010, 0.00012, 2.0e-8, 0.00006, 60_000),
    "A100-80GB": TierSpeed("A100-80GB", 0.016, 0.00020, 4.0e-8, 0.00015, 50_000),
    "L40S": TierSpeed("L40S", 0.028, 0.00040, 8.0e-8, 0.00030, 24_000),
}


@dataclass(slots=True)
class Seq:
    prompt: int
    max_tokens: int
    arrived: float
    sink: Any = None                  # the protocol that writes this request's events
    prefilled: int = 0
    generated: int = 0
    aborted: bool = False
    hashes: list[int] = field(default_factory=list)   # its prompt's block hashes (prefix caching)
    cached: int = 0                   # prompt tokens found in the prefix cache at admission

    @property
    def blocks(self) -> int:
        return -(-(self.prompt + self.max_tokens) // BLOCK_SIZE)


@dataclass(slots=True)
class StepPlan:
    duration_s: float
    first: list[Seq]                  # sequences whose prefill ends with this step (first token)
    decoded: list[Seq]                # sequences that get one more token


@dataclass
class Batcher:
    """The pure continuous batcher (no I/O, no clock): plan a step, then apply it."""

    tier: TierSpeed
    waiting: deque[Seq] = field(default_factory=deque)
    running: list[Seq] = field(default_factory=list)
    free_blocks: int = 0
    cache: EnginePrefixCache | None = None   # prefix caching: prefill starts after the cached prefix

    def __post_init__(self) -> None:
        self.free_blocks = self.tier.num_blocks

    def fits(self, seq: Seq) -> bool:
        return seq.blocks <= self.tier.num_blocks

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.tier.max_num_seqs:
            head = self.waiting[0]
            if head.aborted:
                self.waiting.popleft()
                continue
            if head.blocks > self.free_blocks:
                return
            self.waiting.popleft()
            self.free_blocks -= head.blocks
            if self.cache is not None:
                head.cached = head.prefilled = self.cache.admit(head.hashes, head.prompt)
                self.cache.fit(self.free_blocks)
            self.running.append(head)

    def plan(self) -> StepPlan | None:
        self._admit()
        if not self.running:
            return None
        t = self.tier
        context = sum(s.prefilled + s.generated for s in self.running)
        if t.prefill_first:
            return self._prefill_first_plan(context)
        decoded = [s for s in self.running if s.prefilled >= s.prompt]
        budget = t.max_batched_tokens - len(decoded)
        first, prefill = [], 0
        for s in self.running:
            if s.prefilled < s.prompt and budget > 0:
                chunk = min(budget, s.prompt - s.prefilled)
                s.prefilled += chunk
                budget -= chunk
                prefill += chunk
                if s.prefilled >= s.prompt:
                    first.append(s)
        duration = t.step_base_s + t.per_seq_s * len(decoded) + t.kv_read_s * context + t.prefill_s_per_token * prefill
        return StepPlan(duration, first, decoded)

    def _prefill_first_plan(self, context: int) -> StepPlan:
        """Prefill-first: the prompts not yet prefilled, whole, oldest first up to the token budget (at
        least one), with no decode in the step; a decode step for every running sequence when none is."""
        t = self.tier
        first, prefill = [], 0
        for s in self.running:
            need = s.prompt - s.prefilled
            if need <= 0:
                continue
            if first and prefill + need > t.max_batched_tokens:
                break
            s.prefilled = s.prompt
            first.append(s)
            prefill += need
        if first:   # the KV attended is the new prompts' (as loadtest/sim/family.py has it): the decodes wait
            attended = sum(s.prompt for s in first)
            return StepPlan(t.step_base_s + t.kv_read_s * attended + t.prefill_s_per_token * prefill, first, [])
        decoded = list(self.running)
        return StepPlan(t.step_base_s + t.per_seq_s * len(decoded) + t.kv_read_s * context, [], decoded)

    def apply(self, plan: StepPlan) -> list[Seq]:
        """Hand out the step's tokens; returns the sequences that finished (their KV freed)."""
        for s in plan.first:
            s.generated = 1
        for s in plan.decoded:
            s.generated += 1
        done = [s for s in self.running if s.aborted or (s.prefilled >= s.prompt and s.generated >= s.max_tokens)]
        if done:
            gone = {id(s) for s in done}
            self.running = [s for s in self.running if id(s) not in gone]
            self.free_blocks += sum(s.blocks for s in done)
            if self.cache is not None:
                for s in done:
                    self.cache.release(s.hashes, self.free_blocks)
        return done

    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.tier.num_blocks


# -- HTTP ------------------------------------------------------------------------------------

def _head(status: bytes, ctype: bytes, length: int | None) -> bytes:
    size = b"transfer-encoding: chunked\r\n" if length is None else b"content-length: %d\r\n" % length
    return b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype + b"\r\n" + size + b"\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _json(status: bytes, obj: Any) -> bytes:
    data = orjson.dumps(obj)
    return _head(status, b"application/json", len(data)) + data


def _error(message: str) -> bytes:
    return _json(b"400 Bad Request", {"error": {"message": message, "type": "BadRequestError", "code": 400}})


def message_text(m: dict[str, Any]) -> str:
    content = m.get("content") or ""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    total = 0
    for m in messages:
        size = len(message_text(m).encode())
        total += (max(1, -(-size // 4)) if size else 0) + 4
    return total


def rendered(messages: list[dict[str, Any]]) -> str:
    """The prompt as the gateway renders a chat (`role: text` lines): what the prefix cache hashes."""
    return "\n".join(f"{m.get('role')}: {message_text(m)}" for m in messages)


class Engine:
    """One emulated engine: the batcher driven by the event loop's clock, its metrics and its HTTP side."""

    def __init__(self, engine_id: str, tier: TierSpeed, time_scale: float, prefix_caching: bool = False) -> None:
        self.id, self.tier, self.scale = engine_id, tier, time_scale
        self.batcher = Batcher(tier, cache=EnginePrefixCache(BLOCK_SIZE) if prefix_caching else None)
        self._wake = asyncio.Event()
        self.latency_sum = 0.0
        self.latency_count = 0
        self.generated = 0
        self._prefix = b'{"id":"chatcmpl-emu","object":"chat.completion.chunk","created":0,"model":"%s",' \
                       b'"system_fingerprint":"%s","choices":[' % (MODEL.encode(), engine_id.encode())
        self._token = self._prefix + b'{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}'

    def submit(self, seq: Seq) -> None:
        self.batcher.waiting.append(seq)
        self._wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            plan = self.batcher.plan()
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(plan.duration_s / self.scale)
            now = loop.time()
            done = self.batcher.apply(plan)
            self.generated += len(plan.first) + len(plan.decoded)
            for s in (*plan.first, *plan.decoded):
                if not s.aborted and s.sink is not None:
                    if s.generated >= s.max_tokens:
                        s.sink.finish(self, s)
                    else:
                        s.sink.token(self._token)
            for s in done:
                if not s.aborted:
                    self.latency_sum += now - s.arrived
                    self.latency_count += 1

    def final_events(self, s: Seq, usage: bool) -> bytes:
        out = [_chunk(b"data: " + self._prefix + b'{"index":0,"delta":{"content":"tok"},"finish_reason":"length"}]}'
                      + b"\n\n")]
        if usage:
            u = orjson.dumps({"prompt_tokens": s.prompt, "completion_tokens": s.generated,
                              "total_tokens": s.prompt + s.generated})
            out.append(_chunk(b"data: " + self._prefix + b'],"usage":' + u + b"}\n\n"))
        out.append(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return b"".join(out)

    def metrics(self) -> bytes:
        b, t = self.batcher, self.tier
        label = b'{engine="0",model_name="%s"}' % MODEL.encode()
        usage = b.kv_usage()
        lines = [
            b"# TYPE vllm:num_requests_running gauge", b"vllm:num_requests_running%s %d" % (label, len(b.running)),
            b"# TYPE vllm:num_requests_waiting gauge", b"vllm:num_requests_waiting%s %d" % (label, len(b.waiting)),
            b"# TYPE vllm:kv_cache_usage_perc gauge", b"vllm:kv_cache_usage_perc%s %f" % (label, usage),
            b"# TYPE vllm:gpu_cache_usage_perc gauge", b"vllm:gpu_cache_usage_perc%s %f" % (label, usage),
            b"# TYPE vllm:cache_config_info gauge",
            b'vllm:cache_config_info{block_size="%d",engine="0",num_gpu_blocks="%d"} 1.0' % (BLOCK_SIZE, t.num_blocks),
            b"# TYPE vllm:e2e_request_latency_seconds histogram",
            b"vllm:e2e_request_latency_seconds_sum%s %f" % (label, self.latency_sum),
            b"vllm:e2e_request_latency_seconds_count%s %d" % (label, self.latency_count),
            b"# TYPE vllm:generation_tokens_total counter",
            b"vllm:generation_tokens_total%s %d" % (label, self.generated),
        ]
        if b.cache is not None:
            lines += [b"# TYPE vllm:prefix_cache_queries counter",
                      b"vllm:prefix_cache_queries_total%s %d" % (label, b.cache.queries),
                      b"# TYPE vllm:prefix_cache_hits counter",
                      b"vllm:prefix_cache_hits_total%s %d" % (label, b.cache.hits)]
        return b"\n".join(lines) + b"\n"


class _Conn(asyncio.Protocol):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.transport: Any = None
        self.seq: Seq | None = None
        self.stream = False
        self.usage = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.seq is not None:
            self.seq.aborted = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, body = self.url.split(b"?", 1)[0], b"".join(self.body)
        self.body = []
        if url == b"/v1/chat/completions":
            self._complete(body)
        elif url == b"/tokenize":
            self.transport.write(self._tokenize(body))
        elif url.startswith(b"/v1/chat/completions/"):   # e.g. vLLM's /render, which this engine has not
            self.transport.write(_json(b"404 Not Found", {"error": {"message": "not found", "code": 404}}))
        elif url.startswith(b"/v1/models"):
            self.transport.write(_json(b"200 OK", {"object": "list", "data": [
                {"id": MODEL, "object": "model", "owned_by": "emulated", "max_model_len": MAX_MODEL_LEN}]}))
        elif url.startswith(b"/reset_prefix_cache"):   # vLLM's: drop every cached block no sequence holds
            cache = self.engine.batcher.cache
            if cache is not None:
                cache.fit(0)
                cache.fit(self.engine.batcher.free_blocks)
            self.transport.write(_json(b"200 OK", {}))
        elif url.startswith(b"/metrics"):
            text = self.engine.metrics()
            self.transport.write(_head(b"200 OK", b"text/plain; version=0.0.4", len(text)) + text)
        else:
            self.transport.write(_json(b"200 OK", {}))

    @staticmethod
    def _tokenize(body: bytes) -> bytes:
        """vLLM's `POST /tokenize` (messages or prompt): one id per 4 bytes of the prompt as rendered, so that
        prompts with a common prefix have common leading ids (what a router's token tree needs)."""
        try:
            req = orjson.loads(body)
            text = rendered(req["messages"]) if "messages" in req else str(req["prompt"])
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            return _error("malformed request")
        data = text.encode()
        tokens = [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)]
        return _json(b"200 OK", {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens,
                                 "token_strs": None})

    def _complete(self, body: bytes) -> None:
        try:
            req = orjson.loads(body)
            prompt = prompt_tokens(req["messages"])
            max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            self.transport.write(_error("malformed request"))
            return
        if prompt + max_tokens > MAX_MODEL_LEN or max_tokens < 1:
            self.transport.write(_error(f"prompt ({prompt}) + max_tokens ({max_tokens}) exceeds {MAX_MODEL_LEN}"))
            return
        seq = Seq(prompt, max_tokens, asyncio.get_running_loop().time(), self)
        if self.engine.batcher.cache is not None:
            seq.hashes = block_hashes(rendered(req["messages"]), max_blocks=prompt // BLOCK_SIZE)
        if not self.engine.batcher.fits(seq):
            self.transport.write(_error("request larger than the KV cache"))
            return
        self.seq, self.stream = seq, bool(req.get("stream"))
        self.usage = bool((req.get("stream_options") or {}).get("include_usage"))
        if self.stream:
            self.transport.write(_head(b"200 OK", b"text/event-stream", None))
        self.engine.submit(seq)

    def token(self, event: bytes) -> None:
        if self.stream:
            self.transport.write(_chunk(b"data: " + event + b"\n\n"))

    def finish(self, engine: Engine, s: Seq) -> None:
        self.seq = None
        if self.stream:
            self.transport.write(engine.final_events(s, self.usage))
            return
        self.transport.write(_json(b"200 OK", {
            "id": "chatcmpl-emu", "object": "chat.completion", "created": 0, "model": MODEL,
            "system_fingerprint": engine.id,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok" * s.generated},
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": s.prompt, "completion_tokens": s.generated,
                      "total_tokens": s.prompt + s.generated}}))


async def serve(specs: list[tuple[str, str, int]], time_scale: float, prefix_caching: bool = False) -> None:
    loop = asyncio.get_running_loop()
    servers, tasks = [], []
    for engine_id, tier, port in specs:
        engine = Engine(engine_id, TIERS[tier], time_scale, prefix_caching)
        tasks.append(asyncio.create_task(engine.run()))
        servers.append(await loop.create_server(lambda e=engine: _Conn(e), "127.0.0.1", port, backlog=1024))
    await asyncio.gather(*tasks)


def parse_engine(text: str) -> tuple[str, str, int]:
    engine_id, tier, port = text.split(":")
    if tier not in TIERS:
        raise argparse.ArgumentTypeError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
    return engine_id, tier, int(port)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--engine", type=parse_engine, action="append", required=True, help="ID:TIER:PORT")
    p.add_argument("--time-scale", type=float, default=1.0, help="emulated seconds per real second")
    p.add_argument("--prefix-caching", action="store_true", help="automatic prefix caching, as vLLM's")
    args = p.parse_args()
    if not math.isfinite(args.time_scale) or args.time_scale <= 0:
        p.error("--time-scale must be positive")
    try:
        import uvloop
        uvloop.run(serve(args.engine, args.time_scale, args.prefix_caching))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
