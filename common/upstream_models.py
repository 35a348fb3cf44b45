"""The context length an OpenAI-compatible engine serves, read from its `GET /v1/models`.

vLLM lists each served model with `max_model_len` (prompt + completion tokens; its `--max-model-len`,
else the model's own), and SGLang does the same since sgl-project/sglang#4809 (March 2025; its computed context length).
TensorRT-LLM and older SGLang list models without it: then the engine "does not say" and the
gateway falls back to the backend's configured `max_model_len`, then to the catalog model.
"""

from __future__ import annotations

from typing import Any

import httpx

from common.errors import HeteroGateError

MODELS_PATH = "/v1/models"


class ModelsUnavailable(HeteroGateError):
    """The engine could not be asked (network error, or a server error worth asking again)."""


def max_model_len(listing: Any, model: str | None = None) -> int | None:
    """`max_model_len` of `model` in a /v1/models body (of the first model that has one when `model` is
    None or not listed); None when the engine does not say."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return None
    entries = [d for d in data if isinstance(d, dict)]
    named = [d for d in entries if model is not None and d.get("id") == model]
    for entry in named or entries:
        value = entry.get("max_model_len")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


async def fetch_max_model_len(client: httpx.AsyncClient, base_url: str, model: str | None = None) -> int | None:
    """Ask the engine; None when it answers without a context length (or has no /v1/models at all).

    Raises ModelsUnavailable when it could not answer now (network error, 5xx), so the caller asks again.
    """
    url = base_url.rstrip("/") + MODELS_PATH
    try:
        response = await client.get(url)
    except httpx.HTTPError as exc:
        raise ModelsUnavailable(f"GET {url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code >= 500:
        raise ModelsUnavailable(f"GET {url}: HTTP {response.status_code}")
    if response.status_code != 200:
        return None
    try:
        return max_model_len(response.json(), model)
    except ValueError:
        return None
