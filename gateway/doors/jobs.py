"""Validated OpenAI requests → `GenerationJob`s: limits, model name, images, token counts.

Shared by the HTTP and gRPC front doors so that both enforce the very same rules.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from common.tokenizer import PromptIds
from gateway.config.models import ServedModel
from gateway.requests.errors import InvalidRequest, ModelNotFound
from gateway.requests.exact_prompt import ExactPrompts
from gateway.requests.images import ImageInput, load_image
from gateway.requests.job import GenerationJob
from gateway.requests.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    ImagePart,
    image_parts,
    image_places,
    render_chat,
)
from gateway.requests.tokens import count_text_tokens
from gateway.runtime import Runtime


class JobBuilder:
    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._config = runtime.config
        self._limits = runtime.limits
        self.models = runtime.config.models
        self.model_name = runtime.config.served_model_name

    def check_model(self, model: str) -> ServedModel:
        """The model `model` names (its name or an alias); 404 for any other."""
        served = self.models.resolve(model)
        if served is None:
            serves = f"serves {self.models.names()}" if len(self.models) > 1 else f"serves {self.model_name!r}"
            raise ModelNotFound(f"model {model!r} does not exist; this gateway {serves}", param="model")
        return served

    def max_tokens(self, prompt_tokens: int, asked: int | None, prompt_param: str = "messages",
                   model: str | None = None, asked_param: str = "max_tokens") -> int:
        """Check the prompt and max_tokens against the limits; return the max_tokens to use. Errors name
        `asked_param`, the field the client asked the length with (`max_completion_tokens` or `max_tokens`).

        Context as vLLM counts it: prompt + max_tokens ≤ max_model_len. The request is refused (400)
        only when no backend serves a context it fits in; which of them can take it is the router's
        business (`Pipeline.route_language`).
        """
        limit = self._limits.max_prompt_tokens
        if limit is not None and prompt_tokens > limit:
            raise InvalidRequest(f"prompt is {prompt_tokens} tokens; the limit is {limit}",
                                 param=prompt_param, code="context_length_exceeded")
        if asked is not None and asked > self._limits.max_tokens:
            raise InvalidRequest(f"{asked_param} is {asked}; the limit is {self._limits.max_tokens}", param=asked_param)
        context = self._runtime.table.largest_context(model)
        room = context - prompt_tokens
        if room < 1:
            raise InvalidRequest(
                f"this model's maximum context length is {context} tokens (the longest any backend serves); "
                f"the prompt is {prompt_tokens} tokens",
                param=prompt_param, code="context_length_exceeded",
            )
        if asked is not None and asked > room:
            raise InvalidRequest(
                f"this model's maximum context length is {context} tokens (the longest any backend serves); "
                f"the request needs {prompt_tokens + asked} ({prompt_tokens} in the prompt, {asked} in {asked_param})",
                param=asked_param, code="context_length_exceeded",
            )
        # a default past the cap (max_tokens: 64 beside the default 256) gives no request more than the cap
        return asked if asked is not None else min(self._limits.default_max_tokens, self._limits.max_tokens, room)

    async def chat(self, req: ChatCompletionRequest, body: dict[str, Any], request_id: str,
                   timeout_s: float | None, tenant: str) -> GenerationJob:
        """`body`: the client's body that `req` was validated from; `tenant`: whose request it is."""
        if len(req.messages) > self._limits.max_messages:
            raise InvalidRequest(
                f"{len(req.messages)} messages; the limit is {self._limits.max_messages}", param="messages"
            )
        for i, m in enumerate(req.messages):   # as OpenAI: only an assistant's message may have no content
            if m.content in (None, []) and m.role != "assistant":   # an empty string is content
                raise InvalidRequest(f"a {m.role} message needs content (a string or at least one part)",
                                     param=f"messages.{i}.content")
        served = self.check_model(req.model)
        salt = self._salt(req, tenant)
        parts = image_parts(req.messages)
        images = await self._images(parts, served, salt) if parts else ()   # text only: no coroutine to run
        prompt, tokens = render_chat(req.messages)
        exact = self._exact(served)
        ids: tuple[int, ...] = ()
        prefix_ids: tuple[int, ...] = ()
        spans: tuple[tuple[int, int], ...] = ()
        if exact is not None:
            prompt_ids = exact.chat(req.messages, images)
            ids, spans, tokens = tuple(prompt_ids.ids), tuple(prompt_ids.image_spans), prompt_ids.text_tokens
        elif not images and (counter := self._runtime.tokenizers.get(served.name)) is not None:
            # as the engine renders and tokenizes it (off the event loop: ~2.5 ms for 4k tokens)
            prefix_ids = await _routing_ids(counter, counter.chat, req.messages, ())
            tokens = len(prefix_ids) or tokens
        asked, asked_param = req.requested_max_tokens()
        max_tokens = self.max_tokens(tokens + sum([i.tokens for i in images]), asked, model=served.name,
                                     asked_param=asked_param)
        temperature = 1.0 if req.temperature is None else req.temperature
        return GenerationJob(request_id, prompt, tokens, max_tokens, temperature, images, timeout_s, "chat",
                             self._body(req, body), not req.stream, max_tokens_asked=asked is not None,
                             token_ids=ids, prefix_ids=prefix_ids, image_spans=spans,
                             image_grids=exact.grids(images) if exact else (),
                             top_p=req.top_p or 1.0, seed=req.seed, stop=req.stop_strings(), session=req.user or "",
                             model=served.name, image_places=image_places(req.messages) if parts else (),
                             tenant=tenant, cache_salt=salt, choices=req.n or 1)

    async def completion(self, req: CompletionRequest, body: dict[str, Any], request_id: str,
                         timeout_s: float | None, tenant: str) -> GenerationJob:
        served = self.check_model(req.model)
        prompt = req.one_prompt()
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        exact = self._exact(served)
        ids: tuple[int, ...] = ()
        prefix_ids: tuple[int, ...] = ()
        if isinstance(prompt, list):   # token ids, as sent: routed and cached by them, no text
            if exact is not None:
                exact.check_ids(prompt)
            ids, prompt = tuple(prompt), ""
            tokens = len(ids)
        elif exact is not None:
            ids = tuple(exact.text(prompt).ids)
            tokens = len(ids)
        elif (counter := self._runtime.tokenizers.get(served.name)) is not None:
            prefix_ids = await _routing_ids(counter, counter.text, prompt)   # with a BOS, as vLLM's completions
            tokens = len(prefix_ids) or count_text_tokens(prompt)
        else:
            tokens = count_text_tokens(prompt)
        asked, asked_param = req.requested_max_tokens()
        max_tokens = self.max_tokens(tokens, asked, prompt_param="prompt", model=served.name, asked_param=asked_param)
        temperature = 1.0 if req.temperature is None else req.temperature
        return GenerationJob(request_id, prompt, tokens, max_tokens, temperature, (), timeout_s, "text",
                             self._body(req, body), not req.stream, max_tokens_asked=asked is not None,
                             token_ids=ids, prefix_ids=prefix_ids, top_p=req.top_p or 1.0, seed=req.seed,
                             stop=req.stop_strings(), session=req.user or "", model=served.name, tenant=tenant,
                             cache_salt=self._salt(req, tenant), choices=max(req.n or 1, req.best_of or 1))

    def _body(self, req: ChatCompletionRequest | CompletionRequest, body: dict[str, Any]) -> dict[str, Any]:
        """The client's own body for upstreams, as sent (validated by `req`, not rewritten by it, not
        copied: its readers copy what they change; the upstream client sets `stream` itself)."""
        if req.n is not None and req.n > self._limits.max_choices:
            raise InvalidRequest(f"n is {req.n}; the limit is {self._limits.max_choices}", param="n")
        best_of = getattr(req, "best_of", None)   # completions only
        if best_of is not None and best_of > self._limits.max_choices:
            raise InvalidRequest(f"best_of is {best_of}; the limit is {self._limits.max_choices}", param="best_of")
        if isinstance(req.stop, list) and len(req.stop) > self._limits.max_stop_strings:
            raise InvalidRequest(f"stop has {len(req.stop)} strings; the limit is {self._limits.max_stop_strings}",
                                 param="stop")
        if req.stream_options is not None and not req.stream:   # as OpenAI and vLLM answer
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        return body

    def _salt(self, req: ChatCompletionRequest | CompletionRequest, tenant: str) -> str:
        """The request's prefix-cache salt: the client's, after its tenant's name when tenants are
        isolated (a client cannot name another tenant's salt: its own name always comes first)."""
        salt = req.cache_salt or ""
        if self._config.settings.tenants.isolate_prefix_cache:
            return f"tenant:{tenant}" + (f":{salt}" if salt else "")
        return salt

    def _exact(self, served: ServedModel) -> ExactPrompts | None:
        """The exact tokenizer, for the model the torch engines run."""
        return self._runtime.exact_prompts if served is self._config.torch_model else None

    async def _images(self, parts: list[tuple[int, int, ImagePart]], served: ServedModel, salt: str) -> (
        tuple[ImageInput, ...]
    ):
        model = served.profile
        if model.vision is None:
            raise InvalidRequest(f"model {served.name!r} does not accept images", param="messages")
        runtime = self._runtime   # its config: the fleet as changed at runtime
        if not runtime.config.encodes_images(served.name) and served.name not in runtime.had_encoders:
            raise InvalidRequest(f"model {served.name!r} takes images, but no backend here encodes them for it "
                                 "(role vision or both, or a kind: openai upstream that reads images itself): "
                                 "this cluster serves it text only", param="messages")
        limits = self._config.settings.images
        if len(parts) > limits.max_images:
            raise InvalidRequest(f"{len(parts)} images; the limit is {limits.max_images} per request",
                                 param="messages")
        fetcher = self._runtime.fetcher
        return tuple(await asyncio.gather(*(
            load_image(p.image_url.url, f"messages.{i}.content.{j}", limits, model, fetcher, salt) for i, j, p in parts
        )))


async def _routing_ids(counter: ExactPrompts, encode: Callable[..., PromptIds], *args: Any) -> tuple[int, ...]:
    """A prompt's ids by a model's `tokenizer:`, for routing only (the body goes upstream as sent), on the
    tokenizer's thread; () where the tokenizer refuses the prompt (a literal image placeholder in the text,
    say): the upstream decides on it, and the prompt is counted and hashed from its text as without one."""
    try:
        return tuple((await asyncio.get_running_loop().run_in_executor(counter.executor, encode, *args)).ids)
    except InvalidRequest:
        return ()
