"""Locust load test for the live gateway, replaying the simulator's seeded workloads.

Request i of a run is sample i of `loadtest.sim.workloads` at `--seed` (the sequence wraps after
SAMPLES requests), so a live run and a simulation at the same seed see the same prompt, image and
output lengths. Prompts are sized with the gateway's own token estimate, so the gateway counts
exactly the sampled prompt tokens (clipped where prompt + images + max_tokens would overflow the
context); max_tokens is the sampled output length. Users are closed-loop: each sends its next
request as soon as the last one ends, so `-u` is the number of requests in flight.

    locust -f loadtest/locustfile.py --headless -u 32 -r 8 -t 60s --host http://127.0.0.1:8000

`--requests N` ends a headless run once requests 0 to N - 1 have all been answered or failed (or `-t` has
passed), so a run sends the same requests however fast the host starts Locust and its users (with
`--processes`, each process sends its own N).

Stats entries: POST `text`, `image`, `text stream`, `image stream` (end-to-end latency; for a stream,
until `data: [DONE]`) and TTFT `text stream`, `image stream` (time to the first content chunk).
A stream fails on an error event, on no content, or without `data: [DONE]`.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import time
from base64 import b64encode
from dataclasses import dataclass
from typing import Any

import numpy as np
import requests
from locust import User, constant, events, task
from locust.argument_parser import LocustArgumentParser
from locust.env import Environment
from locust.exception import StopUser
from PIL import Image

from gateway.requests.tokens import BYTES_PER_TOKEN, CHAT_MESSAGE_OVERHEAD
from loadtest.sim.workloads import WORKLOADS, Lengths, lengths, multimodal

SAMPLES = 10_000
MULTIMODAL = {"coco": False, "mm_mixed": True}     # image workloads → heavy-tailed image count (as in WORKLOADS)
COCO_SIZES = ((640, 480), (480, 640), (640, 427), (427, 640))   # the commonest COCO image shapes
IMAGE_POOL = 8                                     # distinct images, drawn once: per-request PNGs would load the client
MIN_CONTEXT = 256                                  # below, no prompt is left beside a typical answer
TIMEOUT_S = (10.0, 300.0)                          # (connect, read between bytes)
_WORDS = ("gpu", "cluster", "request", "token", "image", "memory", "routing", "latency", "queue", "batch",
          "vision", "language", "model", "bandwidth", "compute", "cache", "prefill", "decode", "the", "a")


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1]")
    return value


def _count(text: str, negative: str) -> int:
    """An integer of 0 or more; `negative`: what the refusal of a negative one says."""
    try:
        value = int(text)
    except ValueError:   # argparse would name the type's function in its message
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative; {negative}")
    return value


def seed_number(text: str) -> int:
    # numpy's generators take no negative seed (every user then failed, a traceback a request)
    return _count(text, "a seed is 0 or more")


def request_count(text: str) -> int:
    return _count(text, "give 0 (no limit) or more")


def context_tokens(text: str) -> int:
    value = int(text)
    if value < MIN_CONTEXT:   # prompts are clipped to what the context leaves beside images and output
        raise argparse.ArgumentTypeError(f"{text} is below {MIN_CONTEXT} tokens: every prompt would be clipped "
                                         "to nothing (give the served model's context)")
    return value


@events.init_command_line_parser.add_listener
def add_options(parser: LocustArgumentParser) -> None:
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mm_mixed",
                        help="seeded workload of loadtest/sim/workloads.py (default mm_mixed: half image requests)")
    parser.add_argument("--image-fraction", type=fraction, default=None,
                        help="share of requests with images (default: the workload's own; on a text workload "
                             "that share becomes COCO 'describe this image' requests)")
    parser.add_argument("--stream-fraction", type=fraction, default=0.5, help="share of streamed requests")
    parser.add_argument("--requests", type=request_count, default=0,
                        help="end the run once this many requests have been answered (default 0: at -t only)")
    parser.add_argument("--seed", type=seed_number, default=0,
                        help="workload seed (the simulator's seeds are 0, 1, ...)")
    parser.add_argument("--model", default="llava-1.5-7b", help="model name sent in every request")
    parser.add_argument("--max-context", type=context_tokens, default=4096, help="the model's context, to clip prompts")
    parser.add_argument("--api-key", default="", is_secret=True, help="bearer key, if the gateway requires one")


def sample(workload: str, n: int, seed: int, image_fraction: float | None) -> Lengths:
    """The workload's lengths; `image_fraction` overrides its share of image requests.

    An image workload takes it as its own knob; a text workload keeps its lengths for the other
    requests and gives that share COCO requests (one image, short instruction, output ≤ 128).
    """
    if image_fraction is None:
        return lengths(workload, n, seed)
    if workload in MULTIMODAL:
        rng = np.random.default_rng([seed, 0])
        return multimodal(rng, n, image_fraction=image_fraction, heavy_tail=MULTIMODAL[workload])
    text = lengths(workload, n, seed)
    coco = multimodal(np.random.default_rng([seed, 2]), n, image_fraction=1.0, heavy_tail=False)
    pick = np.random.default_rng([seed, 3]).random(n) < image_fraction
    return Lengths(*(np.where(pick, getattr(coco, f), getattr(text, f))
                     for f in ("text_tokens", "image_tokens", "images", "output_tokens", "max_output_tokens")))


def png_data_url(size: tuple[int, int], rng: np.random.Generator) -> str:
    """A photo-like PNG (smooth colour fields plus grain, so it compresses like a photo) as a data URL."""
    w, h = size
    coarse = Image.fromarray(rng.integers(0, 256, (h // 40 + 1, w // 40 + 1, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize(size, Image.Resampling.BILINEAR), dtype=np.int16)
    pixels = np.clip(smooth + rng.integers(-8, 9, smooth.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + b64encode(buf.getvalue()).decode()


@dataclass(frozen=True, slots=True)
class ChatRequest:
    name: str            # the stats entry
    stream: bool
    body: dict[str, Any]


class Plan:
    """The run's seeded request sequence, shared by all users of this process."""

    def __init__(self, options: argparse.Namespace) -> None:
        seed = options.seed
        self.lengths = sample(options.workload, SAMPLES, seed, options.image_fraction)
        self.stream = np.random.default_rng([seed, 4]).random(SAMPLES) < options.stream_fraction
        rng = np.random.default_rng([seed, 5])
        self.images = [png_data_url(COCO_SIZES[k % len(COCO_SIZES)], rng) for k in range(IMAGE_POOL)]
        self.corpus = " ".join(rng.choice(_WORDS, 12_000))
        self.model, self.context = options.model, options.max_context
        self.limit = options.requests   # 0: none
        self._next = itertools.count()
        self.answered = 0

    def next(self) -> ChatRequest | None:
        """The next request, None once `limit` have been handed out."""
        i = next(self._next)
        return None if self.limit and i >= self.limit else self.request(i % SAMPLES)

    def finished(self) -> bool:
        """A request was answered (or failed): whether that was the run's last."""
        self.answered += 1
        return self.answered == self.limit

    def request(self, i: int) -> ChatRequest:
        n_images, max_tokens = int(self.lengths.images[i]), int(self.lengths.output_tokens[i])
        room = self.context - int(self.lengths.image_tokens[i]) - max_tokens
        text = self.prompt(i, min(int(self.lengths.text_tokens[i]), room), n_images)
        content: str | list[dict[str, Any]] = text
        if n_images:
            urls = (self.images[(i + k) % IMAGE_POOL] for k in range(n_images))
            content = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]
        stream = bool(self.stream[i])
        body: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": content}],
                                "max_tokens": max_tokens, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return ChatRequest(("image" if n_images else "text") + (" stream" if stream else ""), stream, body)

    def prompt(self, i: int, tokens: int, n_images: int) -> str:
        """ASCII text that the gateway counts as `tokens` tokens in one chat message (gateway/requests/tokens.py)."""
        nbytes = max(1, tokens - CHAT_MESSAGE_OVERHEAD) * BYTES_PER_TOKEN
        lead = "" if not n_images else "Describe this image. " if n_images == 1 else "Describe these images. "
        start = (i * 7919) % (len(self.corpus) - nbytes)
        return (lead + self.corpus[start:start + nbytes])[:nbytes]


class BadResponse(Exception):
    """A 200 response whose body breaks the OpenAI contract (or carries an error event)."""


class SseParser:
    """Server-sent events from bytes as they arrive: the data of every complete event, in order."""

    def __init__(self) -> None:
        self._pending = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        events_: list[str] = []
        for raw in lines:
            line = raw.removesuffix(b"\r").decode()
            if not line:                          # a blank line dispatches the event
                if self._data:
                    events_.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):         # other fields and ":" comments carry nothing we check
                self._data.append(line.removeprefix("data:").removeprefix(" "))
        return events_


def has_content(event: Any) -> bool:
    """Whether a chunk carries content; a chunk not shaped as a chat chunk is a bad response."""
    try:
        return any(c.get("delta", {}).get("content") for c in event.get("choices", []))
    except (AttributeError, TypeError):   # not a dict, or choices / deltas that are not
        raise BadResponse(f"not a chat completion chunk: {str(event)[:200]}") from None


def read_stream(resp: requests.Response, start: float) -> tuple[float, int]:
    """Consume a chat stream to its end; (seconds to the first content chunk, bytes received)."""
    parser, received, ttft, done = SseParser(), 0, None, False
    for chunk in resp.iter_content(chunk_size=None):   # as it arrives, so TTFT is not held for a full buffer
        received += len(chunk)
        for data in parser.feed(chunk):
            if done:
                raise BadResponse("event after data: [DONE]")
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if not isinstance(event, dict):
                raise BadResponse(f"event is not a JSON object: {data[:200]!r}")
            if "error" in event:
                raise BadResponse(f"error event: {data[:300]}")
            if ttft is None and has_content(event):
                ttft = time.perf_counter() - start
    if not done:
        raise BadResponse("stream ended without data: [DONE]")
    if ttft is None:
        raise BadResponse("stream carried no content")
    return ttft, received


def read_completion(resp: requests.Response) -> int:
    try:
        content = resp.json()["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        content = None
    if not isinstance(content, str):
        raise BadResponse(f"no choices[0].message.content in {resp.text[:200]!r}")
    return len(resp.content)


def check_status(resp: requests.Response) -> None:
    if resp.status_code != 200:
        raise BadResponse(f"HTTP {resp.status_code}: {resp.text[:200]}")


class GatewayUser(User):
    """One closed-loop client of /v1/chat/completions."""

    wait_time = constant(0)
    plan: Plan                  # set at test start, from the command-line options

    def on_start(self) -> None:
        self.session = requests.Session()
        if key := self.environment.parsed_options.api_key:
            self.session.headers["authorization"] = f"Bearer {key}"

    def on_stop(self) -> None:
        self.session.close()

    @task
    def chat(self) -> None:
        """Send the next request; report its latency and, for a stream, its TTFT as a separate entry."""
        req = self.plan.next()
        if req is None:   # --requests handed out: this user is done, the last answer ends the run
            raise StopUser()
        url = f"{self.host}/v1/chat/completions"
        start_time, start = time.time(), time.perf_counter()
        received, ttft, error = 0, None, None
        try:
            with self.session.post(url, json=req.body, stream=req.stream, timeout=TIMEOUT_S) as resp:
                check_status(resp)
                if req.stream:
                    ttft, received = read_stream(resp, start)
                else:
                    received = read_completion(resp)
        except Exception as exc:   # any failure of this request is its failure, counted like an answer
            error = exc
        fire = self.environment.events.request.fire
        fire(request_type="POST", name=req.name, response_time=(time.perf_counter() - start) * 1000,
             response_length=received, exception=error, context={}, start_time=start_time, url=url)
        if ttft is not None:
            fire(request_type="TTFT", name=req.name, response_time=ttft * 1000, response_length=0,
                 exception=None, context={}, start_time=start_time, url=url)
        if self.plan.finished() and self.environment.runner is not None:
            self.environment.runner.quit()


@events.test_start.add_listener
def build_plan(environment: Environment, **_: Any) -> None:
    """At each start, so options changed in the web UI apply to the next run."""
    assert environment.parsed_options is not None, "options come from the locust command line"
    GatewayUser.plan = Plan(environment.parsed_options)
