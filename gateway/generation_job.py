"""One validated request as the pipeline and the backend clients see it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.images import ImageInput
from gateway.policies.contracts import RequestProfile
from heterogate.wire import engine_pb2

# How a backend gets image embeddings: direct from the vision engine (DeliverEmbedding), inline in its
# request body (vLLM image_embeds), or none (it encodes its own images).
Handoff = Literal["direct", "inline", "none"]


@dataclass(frozen=True, slots=True)
class GenerationJob:
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

    @property
    def image_tokens(self) -> int:
        return sum(img.tokens for img in self.images)

    def profile(self) -> RequestProfile:
        return RequestProfile(
            self.request_id, self.prompt_tokens + self.image_tokens, self.max_tokens, self.image_tokens
        )
