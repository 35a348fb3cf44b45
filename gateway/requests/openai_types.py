"""OpenAI request bodies as pydantic models, and their translation into a prompt.

Types are strict (a string where a number belongs is a 400, not a coercion) for the fields the
gateway acts on. Every other field (`tools`, `logprobs`, `seed`, vendor fields such as `top_k`,
`tool_calls` in messages, ...) is accepted: the models validate the client's body, which the caller
keeps as sent and which goes to kind: openai upstreams unchanged (`gateway.doors.jobs`); the gateway's own
engines refuse what they cannot honour (`gateway.clients.engine_fields`). The models hold no copy of the
body: a pydantic private attribute cost a few µs a request to set and read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from gateway.requests.errors import InvalidRequest
from gateway.requests.tokens import CHAT_MESSAGE_OVERHEAD, count_text_tokens


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageUrl(_Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageUrl

    @field_validator("image_url", mode="before")
    @classmethod
    def _bare_url(cls, value: object) -> object:
        """`"image_url": "data:..."`, the URL without its object: OpenAI takes it undocumented, vLLM too."""
        return {"url": value} if isinstance(value, str) else value


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _refusal_as_text(cls, content: object) -> object:
        """A `refusal` part (OpenAI answers a refused request with one, and a client sends the history back
        with it) is its text, as vLLM reads it; the body goes to upstreams as sent."""
        if not isinstance(content, list):
            return content
        return [_refusal_text(p) if isinstance(p, dict) and p.get("type") == "refusal" else p for p in content]


def _refusal_text(part: dict[str, Any]) -> dict[str, Any]:
    refusal = part.get("refusal")
    if not isinstance(refusal, str):
        raise PydanticCustomError("refusal_part", "a refusal part's `refusal` should be a string")
    return {"type": "text", "text": refusal}


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)   # NaN: "finite", not "≤ 2"
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    n: int | None = Field(default=None, ge=1)   # bounded by limits.max_choices
    stream: bool | None = False   # null: not streamed (OpenAI accepts it)
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    # honoured by torch engines (see gateway.clients.engine_fields); a signed 64-bit integer, as engines take it
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)
    user: str | None = None   # the end user or session: routed to where its prefix is cached
    cache_salt: str | None = Field(default=None, min_length=1)   # vLLM's: prefix-cache hits only within a salt
    # OpenAI's newer name for max_tokens, on both routes: a client that moved to it everywhere gets the
    # length it asked for, on completions too (ignored there, it would silently get the default length)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @field_validator("max_tokens", "max_completion_tokens", "n", "seed", "best_of", mode="before", check_fields=False)
    @classmethod
    def _past_64_bits(cls, value: Any) -> Any:
        """The JSON parser reads an integer past 64 bits as a float (1e+30): said as too large, where the
        strict integer check would say it is no integer."""
        if type(value) is float and value.is_integer() and abs(value) >= 2 ** 63:
            raise PydanticCustomError("int_too_large", "too large for a 64-bit integer")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The completion's length the client asked for, and the field that asked it (which errors name):
        `max_completion_tokens` where given, as OpenAI and vLLM read it, else `max_tokens`."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


MAX_TOKEN_ID = 1 << 32   # ids travel to engines as uint32


class CompletionRequest(_Sampling):
    # Text, or token ids as vLLM takes them (`[1, 2]`, or one list in a list); one prompt a request.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)   # generated, the best n returned: bounded by limits.max_choices

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids(cls, prompt: Any) -> Any:
        """A prompt of token ids is checked here, so that a bad one is named as such rather than by the
        union's four type errors ("prompt.str: Input should be a valid string", ...): each list non-empty,
        each id an integer (not a boolean, not a float) in [0, 2^32)."""
        first = prompt[0] if isinstance(prompt, list) and prompt else None
        if isinstance(first, list | int | float):   # a number first (a boolean too): meant as ids
            for ids in prompt if isinstance(first, list) else (prompt,):
                if not (isinstance(ids, list) and ids and all(type(i) is int and 0 <= i < MAX_TOKEN_ID for i in ids)):
                    raise PydanticCustomError(
                        "token_prompt", "a prompt of token ids is a non-empty list of integers in [0, 2^32), "
                                        "or a list of such lists")
        return prompt

    def one_prompt(self) -> str | list[int]:
        """The request's one prompt, text or token ids; InvalidRequest for several (batched prompts)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return prompt
        if len(prompt) != 1:
            raise InvalidRequest("prompt must be one prompt (batched prompts are not supported)", param="prompt")
        return prompt[0]


def body_error(exc: ValidationError) -> InvalidRequest:
    """A 400 naming the field a body got wrong, as a client wrote it. A field that takes several shapes
    (`content`: a string or a list of parts) fails once per shape; the error that got furthest into the
    body is the one the client meant (a malformed part, not "should be a string"), and where none got
    further the shapes are listed. pydantic's labels of the shapes (`str`, `list[...]`, a part's tag
    before its own field) are left out of the path."""
    errors = exc.errors()
    deepest = max(errors, key=lambda e: len(e["loc"]))
    where = _client_path(deepest["loc"])
    messages = list(dict.fromkeys(_words(e) for e in errors if _client_path(e["loc"]) == where))
    message = messages[0] + "".join(", or " + m.removeprefix("Input should be ") for m in messages[1:])
    return InvalidRequest(f"{where}: {message}" if where else message, param=where or None)


def _words(error: Any) -> str:
    """pydantic's message in the client's terms: no class names ("or instance of ChatMessage"), no
    "discriminator"."""
    kind, ctx = error["type"], error.get("ctx") or {}
    tag = str(ctx.get("discriminator", "")).strip("'")
    if kind == "model_type":
        return "Input should be a JSON object"
    if kind == "union_tag_not_found":
        return f"Input should be an object with a `{tag}` field"
    if kind == "union_tag_invalid":
        return f"`{tag}` should be one of {ctx['expected_tags']}{_ALSO.get(tag, '')}, not {ctx['tag']!r}"
    return str(error["msg"])


_ALSO = {"type": " or 'refusal'"}   # a content part's types read before validation (`ChatMessage._refusal_as_text`)


def _client_path(loc: tuple[int | str, ...]) -> str:
    path: list[str] = []
    for part in (str(p) for p in loc):
        if not (part in _SHAPES or "[" in part or (path and part == path[-1])):
            path.append(part)
    return ".".join(path)


_SHAPES = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    return "".join(p.text for p in message.content if isinstance(p, TextPart))


def render_chat(messages: list[ChatMessage]) -> tuple[str, int]:
    """A plain chat template: `role: text` lines; returns (prompt, estimated text tokens)."""
    lines, tokens = [], 0
    for m in messages:
        text = message_text(m)
        lines.append(f"{m.role}: {text}")
        tokens += count_text_tokens(text) + CHAT_MESSAGE_OVERHEAD
    return "\n".join(lines), tokens


def image_places(messages: list[ChatMessage]) -> tuple[int, ...]:
    """Where each image part sits in `render_chat`'s prompt, in order: the UTF-8 bytes before it (its
    message's line up to the image, after the lines before). The prefix index lays the prompt's blocks
    out as an engine does, each image at its place (common.prefix_blocks.prompt_blocks)."""
    places: list[int] = []
    start = 0
    for m in messages:
        head = start + len(f"{m.role}: ".encode())
        if isinstance(m.content, list):
            for p in m.content:
                if isinstance(p, TextPart):
                    head += len(p.text.encode())
                elif isinstance(p, ImagePart):
                    places.append(head)
        start += len(f"{m.role}: {message_text(m)}".encode()) + 1   # the line and its newline
    return tuple(places)


def image_parts(messages: list[ChatMessage]) -> list[tuple[int, int, ImagePart]]:
    """Every image part as (message index, part index, part), in order."""
    out: list[tuple[int, int, ImagePart]] = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            out.extend((i, j, p) for j, p in enumerate(m.content) if isinstance(p, ImagePart))
    return out
