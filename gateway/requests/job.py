"""One validated request as the pipeline and the backend clients see it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from operator import attrgetter
from typing import Any, Literal

from common.wire import engine_pb2
from gateway.requests.images import ImageInput
from gateway.routing.policies.contracts import RequestProfile

# How a backend gets image embeddings: direct from the vision engine (DeliverEmbedding), inline in its
# request body (vLLM image_embeds), or none (it encodes its own images).
Handoff = Literal["direct", "inline", "none"]
# The tenant of a request whose key names none (and of every request with API keys off).
DEFAULT_TENANT = "default"


@dataclass(slots=True)
class GenerationJob:
    """Treated as immutable (`dataclasses.replace` makes a changed copy), but not declared frozen: one is
    built per request, and a frozen dataclass's __init__ sets each of its fields through
    object.__setattr__ (about twice the time)."""

    request_id: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    temperature: float = 1.0
    images: tuple[ImageInput, ...] = ()
    timeout_s: float | None = None     # the client's deadline, capped by the server's request timeout
    kind: Literal["chat", "text"] = "chat"
    # The client's OpenAI body (validated), forwarded as-is to OpenAI-compatible upstream engines.
    body: dict[str, Any] = field(default_factory=dict, compare=False)
    # The client wants one reply, not a stream: an engine may send everything after the first token at once.
    whole: bool = False
    # The images' embeddings, for a backend that takes them in its request (handoff "inline").
    embeddings: tuple[engine_pb2.Embedding, ...] = field(default=(), compare=False)
    # The client gave max_tokens: the request needs prompt + max_tokens of context. Otherwise max_tokens
    # is the gateway's default, shortened to the room the chosen backend has (as vLLM does).
    max_tokens_asked: bool = True
    # Exact requests (torch engines): the model's token ids with image placeholders expanded, where each
    # image goes in them, and the sampling the engine applies.
    token_ids: tuple[int, ...] = field(default=(), compare=False)
    # A text prompt's token ids by its model's tokenizer where the gateway has one for a model without
    # torch engines (`tokenizer:`): what the prefix index hashes, as the engines' KV events name their
    # blocks; never sent (kind: openai upstreams tokenize the body themselves).
    prefix_ids: tuple[int, ...] = field(default=(), compare=False)
    image_spans: tuple[tuple[int, int], ...] = ()
    image_grids: tuple[tuple[int, int, int], ...] = ()   # Qwen2-VL family: (t, h, w) per image
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # The session the client names (`x-session-id`, else the body's `user`; "" for none): the prefix
    # index keeps its backend (gateway.routing.prefix_index).
    session: str = ""
    # Whose request it is (gateway.config.tenants): its limits, its share of admission, its usage.
    tenant: str = DEFAULT_TENANT
    # Its prefix-cache salt ("" none): the client's `cache_salt`, after its tenant's name where
    # tenants.isolate_prefix_cache is on. Engines and the prefix index share KV only within a salt.
    cache_salt: str = ""
    # The model it asked for, by its served name (an alias resolved): its pool (gateway/config/models.py);
    # None: every backend (a cluster of one model built without names, as in the simulator)
    model: str | None = None
    # The completions generated (`n`, or a completion's `best_of` where larger; kind: openai upstreams
    # only): each may take max_tokens.
    choices: int = 1
    # W3C trace context passed on to the backend: the dispatch span's (gateway.pipeline.tracing), with tracing
    # off the client's as it sent it ("": none), and the client's tracestate
    traceparent: str = field(default="", compare=False)
    tracestate: str = field(default="", compare=False)
    # Where each image sits: the bytes of `prompt` before it (none given: every image before the text).
    image_places: tuple[int, ...] = ()

    @property
    def image_tokens(self) -> int:
        return sum(img.tokens for img in self.images) if self.images else 0

    @property
    def context_tokens(self) -> int:
        """Context a backend must serve for this request: prompt (text + image tokens) + max_tokens,
        or + 1 when the client left max_tokens to the gateway."""
        return self.prompt_tokens + self.image_tokens + (self.max_tokens if self.max_tokens_asked else 1)

    def traced(self, traceparent: str, tracestate: str) -> GenerationJob:
        """This job with the W3C trace context a dispatch passes on. Every traced dispatch makes one, so
        it is copied field by field (about 1 µs) and not by `dataclasses.replace` (about 4 µs)."""
        job = GenerationJob(*_FIELDS(self))
        job.traceparent, job.tracestate = traceparent, tracestate
        return job

    def for_context(self, max_context: int) -> GenerationJob:
        """This job as sent to a backend of `max_context`: an unasked max_tokens fits the room left."""
        room = max_context - self.prompt_tokens - self.image_tokens
        if self.max_tokens_asked or not max_context or self.max_tokens <= room:
            return self
        return replace(self, max_tokens=max(1, room))

    def placed_images(self) -> list[tuple[int, int, int]]:
        """Each image as the prefix index and the engines' caches lay it out: (content digest, tokens,
        bytes of the prompt before it; with token ids, the start of its span in them)."""
        if self.token_ids:   # exact prompts: where each image's placeholder run starts (none known: first)
            places: tuple[int, ...] = (tuple(start for start, _ in self.image_spans)
                                       if len(self.image_spans) == len(self.images) else (0,) * len(self.images))
        else:
            places = self.image_places or (0,) * len(self.images)
        return [(i.digest, i.tokens, p) for i, p in zip(self.images, places, strict=True)]

    def profile(self) -> RequestProfile:
        return RequestProfile(
            self.request_id, self.prompt_tokens + self.image_tokens, self.max_tokens, self.image_tokens
        )


_FIELDS = attrgetter(*(f.name for f in fields(GenerationJob)))   # in __init__'s order
