"""`gateway demo-upstream --port 8001`: a mock OpenAI-compatible engine to put the gateway in front of.

Why: "front an existing vLLM" should be something a user can try without a GPU and without vLLM. This
server answers as vLLM does (or SGLang, `--engine sglang`) on the routes the gateway uses:

    GET  /v1/models             the model (`--model`), with `max_model_len` when `--max-model-len` is given
    POST /v1/chat/completions   streamed (SSE, usage last, `data: [DONE]`) and not; `n` choices; a request
    POST /v1/completions        with `tools` gets a call of its first tool, one with `logprobs` logprobs
    GET  /metrics               the engine's Prometheus gauges (queue, running, KV use and capacity) and its
                                requests' end-to-end latency (sum, count): what the gateway's `scrape:` and
                                `heterogate-agent` read
    GET  /health                200

A completion is `max_tokens` placeholder words ("w0 w1 ..."), one every `--token-delay-ms`. To watch
the gateway react to a busy or failing engine, `POST /control` with any of {"waiting": 40, "running": 3,
"fail": 2, "fail_delay_ms": 0, "token_delay_ms": 5, "metrics_status": 500} sets what /metrics reports
(or the status it fails with), fails the next `fail` completions with 503 (each after `fail_delay_ms`)
and changes the pace; {"cached_tokens": 12} adds `prompt_tokens_details` with that many cached tokens to
every usage (as `vllm serve --enable-prompt-tokens-details` does); `GET /stats` shows what it served:
counts, arrival times (`time.monotonic()`), the `max_tokens` asked, the last body and Authorization header.
`--api-key K` refuses /v1/* requests (/v1/models too) without `Authorization: Bearer K` (401), as `vllm
serve --api-key` does. `--kv-events-endpoint tcp://127.0.0.1:5557` caches prompts given as token ids and
publishes its KV cache events there as vLLM does (gateway/demo_kv_cache.py), with vLLM's prefix-cache
counters in /metrics, each usage's `cached_tokens`, and `POST /reset_prefix_cache`; with
`--kv-replay-endpoint tcp://127.0.0.1:5558`, vLLM's replay socket too. It runs on the
gateway's own HTTP server and only the gateway's runtime dependencies; it listens on 127.0.0.1 unless
`--host` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import zmq

from common.event_loop import run
from common.one_line_parser import OneLineParser, positive_int
from gateway.demo_kv_cache import DemoKvCache, EventPublisher
from gateway.doors.http_server import Exchange, Handler, HttpServer, Request, find_header

METRICS = {
    "vllm": (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{{engine="0",model_name="{model}"}} {waiting}\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{{engine="0",model_name="{model}"}} {running}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} 0.25\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{kv_blocks}",engine="0"}} 1.0\n'
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="{model}"}} {e2e_sum}\n'
        'vllm:e2e_request_latency_seconds_count{{engine="0",model_name="{model}"}} {e2e_count}\n'
    ),
    "sglang": (
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{{model_name="{model}"}} {waiting}\n'
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{{model_name="{model}"}} {running}\n'
        "# TYPE sglang:token_usage gauge\n"
        'sglang:token_usage{{model_name="{model}"}} 0.25\n'
        "# TYPE sglang:e2e_request_latency_seconds histogram\n"
        'sglang:e2e_request_latency_seconds_sum{{model_name="{model}"}} {e2e_sum}\n'
        'sglang:e2e_request_latency_seconds_count{{model_name="{model}"}} {e2e_count}\n'
    ),
}
PREFIX_COUNTERS = {   # the demo's prefix cache, where it has one (--kv-events-endpoint)
    "vllm": ("# TYPE vllm:prefix_cache_queries_total counter\n"
             'vllm:prefix_cache_queries_total{{engine="0",model_name="{model}"}} {prefix_queries}\n'
             "# TYPE vllm:prefix_cache_hits_total counter\n"
             'vllm:prefix_cache_hits_total{{engine="0",model_name="{model}"}} {prefix_hits}\n'),
    "sglang": "",
}
DEFAULT_MAX_TOKENS = 8          # a request without max_tokens gets this many words
CONTROLS = ("waiting", "running", "fail", "fail_delay_ms", "token_delay_ms", "metrics_status", "cached_tokens")

# A check every completion body passes before it is served: what it returns is kept in /stats under
# "checked"; a ValueError is answered 400 with its message.
BodyCheck = Callable[[dict[str, Any]], list[dict[str, Any]]]


@dataclass(frozen=True)
class UpstreamOptions:
    engine: str = "vllm"                 # the /metrics format: vllm or sglang
    model: str = "demo-model"            # the model /v1/models lists
    max_model_len: int | None = None     # listed in /v1/models when set (vLLM and SGLang list it)
    cache_info: bool = True              # vLLM's cache_config_info (the KV capacity) in /metrics
    api_key: str | None = None
    token_delay_ms: float = 1.0
    kv_blocks: int = 4096                # KV blocks of 16 tokens (cache_config_info; the prefix cache's size)
    kv_events_endpoint: str | None = None   # where the prefix cache's KV events are published (None: no cache)
    kv_replay_endpoint: str | None = None   # where they are sent again on request (None: no replay socket)


def n_tokens(body: dict[str, Any]) -> int:
    return int(body.get("max_tokens") or DEFAULT_MAX_TOKENS)


def prompt_tokens(body: dict[str, Any]) -> int:
    """A prompt of token ids: their number, as vLLM counts it; else a rough count, 4 bytes a token, as the
    gateway estimates when it has no tokenizer."""
    text = body.get("prompt") if "prompt" in body else body.get("messages")
    if isinstance(text, list) and text and isinstance(text[-1], int | list):
        return len(text[-1]) if isinstance(text[-1], list) else len(text)
    return max(1, len(orjson.dumps(text)) // 4)


def prompt_token_ids(body: dict[str, Any]) -> list[int] | None:
    """A completion's prompt of token ids (one prompt: a list of ints, or a list holding one), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


def tool_call(body: dict[str, Any]) -> dict[str, Any]:
    name = body["tools"][0]["function"]["name"]
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": '{"city": "Paris"}'}}


def token_logprobs(token: str, i: int) -> dict[str, Any]:
    return {"token": token, "logprob": -0.5 - i, "bytes": list(token.encode()),
            "top_logprobs": [{"token": token, "logprob": -0.5 - i, "bytes": list(token.encode())}]}


JSON, TEXT, SSE = b"application/json", b"text/plain; version=0.0.4", b"text/event-stream"


def _error_body(status: int, message: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}})


class DemoUpstream:
    """The mock engine: its routes on the gateway's HTTP server, and what /control and /stats show."""

    def __init__(self, options: UpstreamOptions, *, check_body: BodyCheck | None = None,
                 stats: dict[str, Any] | None = None) -> None:
        """`stats` adds entries to what GET /stats shows."""
        self.options = options
        self.check_body = check_body
        self.state: dict[str, Any] = {
            "waiting": 0, "running": 0, "fail": 0, "fail_delay_ms": 0, "metrics_status": 200, "served": 0,
            "cached_tokens": None,
            "token_delay_ms": options.token_delay_ms, "max_tokens": [], "last_body": None,
            "last_authorization": None, "pid": os.getpid(), "arrivals": [], "checked": [], "e2e_sum": 0.0,
            "e2e_count": 0, **(stats or {}),
        }
        self.metrics_text = "".join(line for line in METRICS[options.engine].splitlines(keepends=True)
                                    if options.cache_info or "cache_config_info" not in line)
        self.kv_cache: DemoKvCache | None = None
        if options.kv_events_endpoint is not None:
            self.kv_cache = DemoKvCache(options.kv_blocks, EventPublisher(
                options.kv_events_endpoint, replay_endpoint=options.kv_replay_endpoint))
            self.metrics_text += PREFIX_COUNTERS[options.engine]

    def routes(self) -> dict[str, Handler]:
        return {"/health": self.health, "/control": self.control, "/metrics": self.metrics, "/stats": self.stats,
                "/v1/models": self.models, "/v1/chat/completions": self.chat, "/v1/completions": self.completions,
                "/reset_prefix_cache": self.reset_prefix_cache}

    @staticmethod
    def _method(request: Request, exchange: Exchange, method: str) -> bool:
        if request.method == method or (method == "GET" and request.method == "HEAD"):
            return True
        exchange.respond(405, [(b"allow", method.encode())], _error_body(405, f"use {method} here"))
        return False

    async def health(self, request: Request, exchange: Exchange) -> None:
        if self._method(request, exchange, "GET"):
            exchange.respond(200, [], b"", TEXT)

    async def metrics(self, request: Request, exchange: Exchange) -> None:
        if not self._method(request, exchange, "GET"):
            return
        if self.state["metrics_status"] != 200:   # a broken metrics endpoint on an engine that still serves
            exchange.respond(int(self.state["metrics_status"]), [], b"metrics unavailable\n", TEXT)
            return
        cache = self.kv_cache
        text = self.metrics_text.format(model=self.options.model, kv_blocks=self.options.kv_blocks,
                                        prefix_queries=cache.queries if cache else 0,
                                        prefix_hits=cache.hits if cache else 0, **self.state)
        exchange.respond(200, [], text.encode(), TEXT)

    async def stats(self, request: Request, exchange: Exchange) -> None:
        if self._method(request, exchange, "GET"):
            exchange.respond(200, [], orjson.dumps(self.state))

    async def models(self, request: Request, exchange: Exchange) -> None:
        if not self._method(request, exchange, "GET"):
            return
        options = self.options
        authorization = find_header(request.headers, b"authorization")
        if options.api_key is not None and authorization != f"Bearer {options.api_key}".encode("latin-1"):
            exchange.respond(401, [], _error_body(401, "Unauthorized"))   # every /v1 route, as vLLM's --api-key
            return
        card: dict[str, Any] = {"id": options.model, "object": "model", "created": 1, "owned_by": options.engine}
        if options.max_model_len is not None:
            card["max_model_len"] = options.max_model_len
        exchange.respond(200, [], orjson.dumps({"object": "list", "data": [card]}))

    async def control(self, request: Request, exchange: Exchange) -> None:
        if not self._method(request, exchange, "POST"):
            return
        try:
            values = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            values = None
        if not isinstance(values, dict) or not set(values) <= set(CONTROLS) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in values.values()):
            message = f"expected an object of non-negative numbers with keys among {', '.join(CONTROLS)}"
            exchange.respond(400, [], _error_body(400, message))
            return
        self.state.update(values)
        exchange.respond(200, [], orjson.dumps({k: self.state[k] for k in CONTROLS}))

    async def reset_prefix_cache(self, request: Request, exchange: Exchange) -> None:
        if not self._method(request, exchange, "POST"):
            return
        if self.kv_cache is None:
            exchange.respond(400, [], _error_body(400, "no prefix cache (start with --kv-events-endpoint)"))
            return
        self.kv_cache.reset()
        exchange.respond(200, [], b"", TEXT)

    async def chat(self, request: Request, exchange: Exchange) -> None:
        await self._complete(request, exchange, chat=True)

    async def completions(self, request: Request, exchange: Exchange) -> None:
        await self._complete(request, exchange, chat=False)

    async def _complete(self, request: Request, exchange: Exchange, *, chat: bool) -> None:
        state = self.state
        state["arrivals"].append(time.monotonic())
        if not self._method(request, exchange, "POST"):
            return
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            exchange.respond(400, [], _error_body(400, "the body is not JSON"))
            return
        if not isinstance(body, dict):
            exchange.respond(400, [], _error_body(400, "the body must be a JSON object"))
            return
        authorization = find_header(request.headers, b"authorization")
        state["last_body"] = body
        state["last_authorization"] = None if authorization is None else authorization.decode("latin-1")
        if self.options.api_key is not None and state["last_authorization"] != f"Bearer {self.options.api_key}":
            exchange.respond(401, [], _error_body(401, "Unauthorized"))
            return
        if state["fail"] > 0:
            state["fail"] -= 1
            await asyncio.sleep(state["fail_delay_ms"] / 1000)
            exchange.respond(503, [], _error_body(503, "overloaded"))
            return
        if self.check_body is not None:
            try:
                state["checked"] += self.check_body(body)
            except ValueError as exc:
                exchange.respond(400, [], _error_body(400, str(exc)))
                return
        state["served"] += 1
        state["max_tokens"].append(body.get("max_tokens"))
        cached = None   # the prefix cache's hit, where it has one and the prompt is token ids
        if self.kv_cache is not None and (ids := prompt_token_ids(body)) is not None:
            cached = self.kv_cache.admit(ids)
        started = time.monotonic()
        if not body.get("stream"):
            await asyncio.sleep(n_tokens(body) * state["token_delay_ms"] / 1000)
            exchange.respond(200, [], self._whole(body, chat, cached))
        else:
            exchange.start_stream(200, [(b"content-type", SSE), (b"cache-control", b"no-cache")])
            async for event in self._stream(body, chat, cached):
                exchange.send(event)
                await exchange.drain()
            exchange.end_stream()
        # the served requests' latency, as vLLM's histogram sums it (what the gateway's scrape reads)
        state["e2e_sum"] += time.monotonic() - started
        state["e2e_count"] += 1

    async def _stream(self, body: dict[str, Any], chat: bool, cached: int | None) -> AsyncIterator[bytes]:
        """Compact JSON events as vLLM writes them, with an extra field a relay must keep."""
        n = n_tokens(body)
        head = {"id": f"upstream-{self.state['served']}", "created": int(time.time()), "model": body.get("model", ""),
                "object": "chat.completion.chunk" if chat else "text_completion"}

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return b"data: " + orjson.dumps({**head, "choices": choices, "engine_marker": 7, **extra}) + b"\n\n"

        prompt = prompt_tokens(body)
        if chat:
            yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        if chat and body.get("tools"):
            call = tool_call(body)
            arguments = call["function"].pop("arguments")
            yield event([{"index": 0, "delta": {"tool_calls": [{"index": 0, **call, "function": {
                **call["function"], "arguments": ""}}]}, "finish_reason": None}])
            yield event([{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]},
                          "finish_reason": "tool_calls"}])
            yield event([], usage=self._usage(prompt, 5))
            yield b"data: [DONE]\n\n"
            return
        for i in range(n):
            for c in range(int(body.get("n") or 1)):   # one event per choice, as vLLM sends them
                choice: dict[str, Any] = {"index": c, "finish_reason": "length" if i == n - 1 else None}
                if chat:
                    choice["delta"] = {"content": f"w{i} "}
                    if body.get("logprobs"):
                        choice["logprobs"] = {"content": [token_logprobs(f"w{i} ", i)]}
                else:
                    choice["text"] = f"w{i} "
                yield event([choice])
            await asyncio.sleep(self.state["token_delay_ms"] / 1000)
        made = n * int(body.get("n") or 1)   # every choice's tokens, as vLLM counts them
        yield event([], usage=self._usage(prompt, made, cached))
        yield b"data: [DONE]\n\n"

    def _whole(self, body: dict[str, Any], chat: bool, cached: int | None) -> bytes:
        """A non-streamed reply as vLLM writes it, with the same extra field."""
        n = n_tokens(body)
        text = "".join(f"w{i} " for i in range(n))
        choices = []
        for c in range(int(body.get("n") or 1)):
            choice: dict[str, Any] = {"index": c, "finish_reason": "length", "logprobs": None}
            if chat and body.get("tools"):
                choice.update(finish_reason="tool_calls",
                              message={"role": "assistant", "content": None, "tool_calls": [tool_call(body)]})
            elif chat:
                choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
                if body.get("logprobs"):
                    choice["logprobs"] = {"content": [token_logprobs(f"w{i} ", i) for i in range(n)]}
            else:
                choice["text"] = text
            choices.append(choice)
        prompt = prompt_tokens(body)
        return orjson.dumps({
            "id": f"upstream-{self.state['served']}", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": body.get("model", ""), "choices": choices, "engine_marker": 7,
            "usage": self._usage(prompt, n * len(choices), cached),
        })

    def _usage(self, prompt: int, made: int, cached: int | None = None) -> dict[str, Any]:
        """`cached`: what the prefix cache found (None: no cache, or not a prompt of token ids); the
        `cached_tokens` control, where set, wins."""
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}
        if self.state["cached_tokens"] is not None:
            cached = int(self.state["cached_tokens"])
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": min(cached, prompt)}
        return usage


async def not_found(request: Request, exchange: Exchange) -> None:
    """Every other path: a 404 in the OpenAI error shape."""
    exchange.respond(404, [], _error_body(404, f"no route {request.path}"))


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 32 << 20     # a request body beyond this gets 413
    idle_s: float = 75.0               # an idle keep-alive connection, and a request's head, at most this long
    body_timeout_s: float = 60.0       # a body must be whole this long after its headers (else 408)
    drain_s: float = 5.0               # on SIGINT/SIGTERM: requests in flight finish for up to this long


async def serve(upstream: DemoUpstream, host: str, port: int, limits: ServerLimits = ServerLimits()) -> None:
    """Serves the mock on the gateway's HTTP server until SIGINT or SIGTERM."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    server = HttpServer(upstream.routes(), not_found, max_body_bytes=limits.max_body_bytes, idle_s=limits.idle_s,
                        body_timeout_s=limits.body_timeout_s)
    await server.start(sock)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(limits.drain_s)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8001, help="listen port (default 8001)")
    p.add_argument("--engine", choices=sorted(METRICS), default="vllm", help="the /metrics format (default vllm)")
    p.add_argument("--model", default=UpstreamOptions.model, help="the model /v1/models lists")
    p.add_argument("--max-model-len", type=int, help="the context /v1/models lists (default: none listed)")
    p.add_argument("--no-cache-info", action="store_true", help="leave the KV capacity out of /metrics")
    p.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1/*")
    p.add_argument("--token-delay-ms", type=float, default=UpstreamOptions.token_delay_ms,
                   help="pause between generated words (default 1)")
    p.add_argument("--max-body-bytes", type=int, default=ServerLimits.max_body_bytes)
    p.add_argument("--kv-blocks", type=positive_int, default=UpstreamOptions.kv_blocks,
                   help="KV blocks of 16 tokens: the prefix cache's size, and /metrics' num_gpu_blocks (default 4096)")
    p.add_argument("--kv-events-endpoint", metavar="ENDPOINT",
                   help="cache prompts of token ids and publish KV events on this ZeroMQ endpoint, as vLLM's "
                        "--kv-events-config does (e.g. tcp://127.0.0.1:5557)")
    p.add_argument("--kv-replay-endpoint", metavar="ENDPOINT",
                   help="with --kv-events-endpoint: send the last 10,000 batches again on request on this ZeroMQ "
                        "endpoint, as vLLM's replay_endpoint does (e.g. tcp://127.0.0.1:5558)")


def options_from(args: argparse.Namespace) -> UpstreamOptions:
    return UpstreamOptions(args.engine, args.model, args.max_model_len, not args.no_cache_info, args.api_key,
                           args.token_delay_ms, args.kv_blocks, args.kv_events_endpoint, args.kv_replay_endpoint)


def main(argv: list[str]) -> None:
    p = OneLineParser(prog="gateway demo-upstream", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if args.kv_replay_endpoint is not None and args.kv_events_endpoint is None:
        p.error("--kv-replay-endpoint replays the KV events of --kv-events-endpoint: give both")
    options = options_from(args)
    print(f"demo upstream (mock {options.engine}, model {options.model}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    try:
        upstream = DemoUpstream(options)
    except zmq.ZMQError as exc:   # the endpoint is taken, or not one ZeroMQ can bind
        endpoints = " and ".join(e for e in (options.kv_events_endpoint, options.kv_replay_endpoint) if e)
        print(f"gateway demo-upstream: cannot publish KV events on {endpoints}: {exc}",
              file=sys.stderr)
        raise SystemExit(1) from None
    try:
        run(serve(upstream, args.host, args.port, ServerLimits(max_body_bytes=args.max_body_bytes)))
    except OSError as exc:   # the port is taken, the address is not this host's
        print(f"gateway demo-upstream: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
