"""What the gateway's own engines (`kind: engine`, simulated or torch) can honour of an OpenAI request.

Engines take a prompt, `max_tokens`, `temperature`, `top_p` and `stop`, and give one choice. A request
that asks for anything else (tools, logprobs, a response format, `n` > 1, a seed, penalties, `echo`,
vendor fields, tool calls in its messages, a `prompt` beside a chat request's messages, a stream option
other than `include_usage` such as vLLM's `continuous_usage_stats`) would get an answer that silently
ignores it: an engine refuses it with a 400 that names the fields instead. A field sent with a value
that asks nothing (null, false, 0 but for `seed` and `logprobs`, empty, `n: 1`, `best_of: 1`,
`tool_choice: "none"`, `response_format: {"type": "text"}`, `top_k: -1`, `repetition_penalty: 1`,
`service_tier: "auto"`) is no request. `kind: openai` backends get
every field (`gateway.clients.openai_upstream`), and where a model has both kinds such a request is
routed to those only (`Pipeline._unable`). Torch engines also honour `seed`: a request the gateway
tokenised for them (an exact request) may carry one.
"""

from __future__ import annotations

from typing import Any

from gateway.requests.errors import InvalidRequest

HONOURED = frozenset({
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
    "stream", "stream_options", "user", "cache_salt",
})
MESSAGE_FIELDS = frozenset({"role", "content", "name"})
STREAM_OPTIONS_FIELDS = frozenset({"include_usage"})
# Values that ask for the default: OpenAI's, and vLLM's own "off" (`top_k: -1`, `repetition_penalty: 1`), which
# clients such as LiteLLM and LangChain send whatever the backend
_NO_REQUEST: dict[str, Any] = {"n": 1, "best_of": 1, "tool_choice": "none", "response_format": {"type": "text"},
                               "top_k": -1, "repetition_penalty": 1, "service_tier": "auto",
                               "modalities": ["text"]}


# Fields whose 0 asks something: a seed of 0, and a completion's `logprobs: 0` (the sampled token's own)
_ZERO_ASKS = frozenset({"seed", "logprobs"})


def _asks_nothing(key: str, value: Any) -> bool:
    if key in _ZERO_ASKS and value is not False and value == 0:
        return False
    return not value or _NO_REQUEST.get(key) == value


EXACT_HONOURED = HONOURED | {"seed"}
# (exact, chat) -> the fields honoured, built once: a chat request's `prompt` and a completion's
# `messages` are read by neither
_HONOURED_BY = {(exact, chat): (EXACT_HONOURED if exact else HONOURED) - {"prompt" if chat else "messages"}
                for exact in (False, True) for chat in (False, True)}


def refused_fields(body: dict[str, Any], *, exact: bool = False, chat: bool = True) -> list[str]:
    """The fields of `body` (a chat request's, else a completion's) an engine cannot honour, as dotted
    paths (`messages.2.tool_calls`, `stream_options.continuous_usage_stats`). A chat request's `prompt`
    and a completion's `messages` are read by neither."""
    honoured = _HONOURED_BY[exact, chat]
    refused = [k for k, v in body.items() if k not in honoured and not _asks_nothing(k, v)]
    options = body.get("stream_options")
    if isinstance(options, dict):
        refused += [f"stream_options.{k}" for k, v in options.items() if k not in STREAM_OPTIONS_FIELDS and v]
    messages = body.get("messages")
    if chat and isinstance(messages, list):
        for i, message in enumerate(messages):
            if isinstance(message, dict):
                refused += [f"messages.{i}.{k}" for k, v in message.items() if k not in MESSAGE_FIELDS and v]
    return refused


def check_engine_can_honour(body: dict[str, Any], *, exact: bool = False, chat: bool = True) -> None:
    refused = refused_fields(body, exact=exact, chat=chat)
    if refused:
        raise InvalidRequest(
            f"this gateway's engines cannot honour {', '.join(refused)}; "
            "such requests need a kind: openai backend (vLLM, SGLang, ...)", param=refused[0],
        )
