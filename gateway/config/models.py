"""The models a cluster serves: one by default (`model:`), several with `models:`.

A request names a model (or one of its aliases) and goes to that model's pool: the backends that serve
it. Each pool is routed as a whole cluster would be (same state table, same policies): a model is a filter
on the candidates, not a second gateway. A backend serves one model (a managed engine) or several (an
OpenAI-compatible upstream that serves them all, e.g. vLLM with several LoRA adapters): then its load
counts once, in every pool it belongs to.

    model: llava-1.5-7b            # the first model (a catalog name); backends serve it unless they say
    aliases: [llava]               # other names clients may use for it
    models:                        # more models, each with its own name, catalog entry and aliases
      - {name: qwen-vl, catalog: qwen2.5-vl-7b, aliases: [qwen]}
    backends:
      - {id: a, gpu: H100, launch: {}}                       # serves llava-1.5-7b
      - {id: b, gpu: L40S, model: qwen-vl, launch: {}}
      - {id: c, kind: openai, address: ..., model: [llava-1.5-7b, qwen-vl]}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from common.catalog import ModelProfile
from common.yaml_files import StrictModel

MODEL_NAME = r"^[A-Za-z0-9._:/@+-]{1,128}$"


class ModelSpec(StrictModel):
    """One more model of the cluster (`models:`)."""

    name: str = Field(pattern=MODEL_NAME)        # what clients send as `model` (and /v1/models lists)
    catalog: str | None = None                   # its entry in the model catalog (default: `name`)
    aliases: list[str] = Field(default_factory=list)
    tokenizer: str | None = Field(default=None, min_length=1)   # as the cluster file's `tokenizer`, for this model


@dataclass(frozen=True)
class ServedModel:
    """A model as the gateway serves it: the name clients use, its catalog profile (the performance
    model's figures), the other names it answers to."""

    name: str
    catalog: str
    profile: ModelProfile
    aliases: tuple[str, ...] = ()
    # A local Hugging Face directory with the model's tokenizer (None: none): text prompts to kind: openai
    # backends are counted and hashed by it, so the prefix index names blocks as the engines' KV events do.
    tokenizer: Path | None = None


class ModelNames:
    """Names and aliases → models, the first one the cluster's default."""

    def __init__(self, models: list[ServedModel]) -> None:
        self.models = {m.name: m for m in models}
        self.default = models[0]
        self._by_name = {alias: m for m in models for alias in (m.name, *m.aliases)}

    def resolve(self, name: str) -> ServedModel | None:
        return self._by_name.get(name)

    def names(self) -> str:
        """The served names, for error messages."""
        return ", ".join(repr(n) for n in self.models)

    def __len__(self) -> int:
        return len(self.models)
