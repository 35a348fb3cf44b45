"""The torch language executor: runs the continuous batcher's plan on a Hugging Face decoder over slot KV.

Per step the batcher (backends/batcher.py) admits waiting sequences while a slot is free and plans the
step; this executor prefills each newly admitted sequence into its own slot (text embeddings with the
image features spliced in at their placeholder spans), then decodes one token for every running sequence
in one batched forward. Sequences join and leave between steps; the running ones' KV is never moved or
re-padded. A freed slot keeps its KV, and a prompt that starts as its tokens did takes it and is
prefilled only past the blocks they share; a prompt that shares more with a running sequence copies
that run's KV into its own slot (backends/slot_prefix.py: prefix reuse as the slot layout allows,
reported as vLLM's prefix-cache counters).

The model runs in a worker thread, so the event loop keeps serving gRPC and heartbeats during a step.
Tokens are chosen per request (greedy, or seeded temperature + top_p), detokenised incrementally, and
a sequence ends at EOS, at a stop string (the text ends before it) or at max_tokens. KV capacity is the
slot cache actually allocated; the heartbeats report it and what the running sequences hold of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import torch

from backends.batcher import ContinuousBatcher, Sequence
from backends.detokenizer import IncrementalText
from backends.executors import GenerateInput, InvalidInput, LoadReport, Sampling, Token
from backends.sampling import choose, generator
from backends.slot_kv import DecoderRunner, SlotKV
from backends.slot_prefix import SlotPrefixes, Take, block_keys, image_key
from backends.token_streams import TokenStreams
from backends.torch_models import LoadedModel
from common import perf_model
from common.catalog import GpuProfile, ModelProfile
from common.errors import ConfigError
from common.prefix_blocks import BLOCK_TOKENS


@dataclass(eq=False)
class _Live:
    ids: list[int]
    spans: list[tuple[int, int]]
    images: list[torch.Tensor]
    sampling: Sampling
    gen: torch.Generator
    text: IncrementalText
    rope: torch.Tensor | None = None    # Qwen2-VL family: the prompt's M-RoPE positions [3, n] ...
    rope_delta: int = 0                 # ... and the offset of decode positions from cache positions
    digests: list[bytes] = field(default_factory=list)   # the images' keys (backends/slot_prefix.image_key)
    blocks: list[bytes] = field(default_factory=list)  # the prompt's block keys (backends/slot_prefix.py)
    salt: str = ""                      # its cache salt: the keys' chain starts from it
    take: Take | None = None            # its slot, and the prompt tokens whose KV it holds or copies
    length: int = 0                     # tokens in the slot's KV
    out: list[int] = field(default_factory=list)
    admitted: float = 0.0


def kv_budget_bytes(loaded: LoadedModel, model: ModelProfile, gpu: GpuProfile, memory_utilization: float) -> int:
    """CUDA: the device's memory × utilisation, less what is in use now (the weights). CPU: the same share of
    the catalog GPU's memory once the weights are counted, as the simulated engine would have."""
    if loaded.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(loaded.device)
        return max(0, int(total * memory_utilization) - (total - free))
    return perf_model.kv_capacity_bytes(model, gpu, memory_utilization=memory_utilization)


def mrope_positions(config: Any, ids: list[int], grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    """Qwen2.5-VL's 3-D positions of a prompt ([3, n]) and its rope delta, from the token ids and image grids
    alone: the model's own `get_rope_index`, on a stand-in that carries only the config (no vision weights)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    def vision_positions(*args: Any, **kwargs: Any) -> Any:
        return Qwen2_5_VLModel.get_vision_position_ids(None, *args, **kwargs)  # type: ignore[arg-type]

    stub = SimpleNamespace(config=config, get_vision_position_ids=vision_positions)
    tensor = torch.tensor([ids])
    rope_index: Any = Qwen2_5_VLModel.get_rope_index
    pos, delta = rope_index(stub, tensor, mm_token_type_ids=(tensor == config.image_token_id).int(),
                            image_grid_thw=torch.tensor(grids) if grids else None)
    return pos[:, 0], int(delta.flatten()[0])


class TorchLanguageExecutor:
    def __init__(
        self, loaded: LoadedModel, model: ModelProfile, gpu: GpuProfile, *, kv_budget: int, max_batch: int,
        max_len: int, on_change: Callable[[], None] = lambda: None,
    ) -> None:
        lm = loaded.model
        text: Any = lm.config.text_config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        profile = model.model_copy(update={"dtype": loaded.dtype_name})   # KV bytes in the dtype that runs
        # Start-up faults of the launch config are ConfigErrors: the engine exits with one line naming them.
        context = int(getattr(text, "max_position_embeddings", max_len))
        if max_len > context:
            raise ConfigError(f"max_model_len {max_len} is over the model's context of {context} tokens "
                              "(max_position_embeddings)")
        slot_bytes = perf_model.kv_bytes(profile, max_len)
        slots = min(max_batch, kv_budget // slot_bytes)
        if slots < 1:
            raise ConfigError(f"the KV budget of {kv_budget} bytes (memory_utilization of the device) and max_batch "
                              f"{max_batch} leave no slot of max_model_len {max_len} tokens ({slot_bytes} bytes)")
        self.kv = SlotKV(text.num_hidden_layers, slots, text.num_key_value_heads, max_len, head_dim,
                         loaded.dtype, loaded.device)
        self.runner = DecoderRunner(lm.model.language_model, lm.lm_head, self.kv)
        self.loaded = loaded
        self.vocab = int(text.vocab_size)
        eos = lm.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        suppressed = loaded.suppressed
        # tokens never chosen (their logits -inf), as Hugging Face's generate() suppresses them
        self.suppressed = torch.tensor(suppressed, device=loaded.device) if suppressed else None
        self.hidden = int(text.hidden_size)
        self.mrope = loaded.family == "qwen2_5_vl"
        self.batcher = ContinuousBatcher(profile, gpu, self.kv.nbytes, max_batch=slots, slot_tokens=max_len)
        self._streams = TokenStreams(self.batcher, on_change)
        self._on_change = on_change
        self._live: dict[Sequence, _Live] = {}
        self.prefixes = SlotPrefixes(slots)

    @property
    def has_work(self) -> bool:
        return not self.batcher.idle

    def load(self) -> LoadReport:
        return replace(self._streams.load(self.kv.max_len), prefix_cache_queries=self.prefixes.queries,
                       prefix_cache_hits=self.prefixes.hits, kv_block_tokens=BLOCK_TOKENS)

    def generate(self, request: GenerateInput) -> AsyncIterator[Token]:
        live = self._prepare(request)
        seq = Sequence(request.request_id, len(live.ids), request.max_tokens, request.max_tokens,
                       arrival_s=time.monotonic())
        return self._stream(seq, live)

    async def _stream(self, seq: Sequence, live: _Live) -> AsyncIterator[Token]:
        self._live[seq] = live
        try:
            async for token in self._streams.stream(seq):
                yield token
        finally:
            if live.take is None:   # never admitted (refused, or cancelled while waiting): nothing to free
                self._live.pop(seq, None)

    def _prepare(self, request: GenerateInput) -> _Live:
        tok = self.loaded.tokenizer
        ids = list(request.token_ids) or list(tok(request.prompt, add_special_tokens=False)["input_ids"])
        if not ids:
            raise InvalidInput("the prompt has no tokens")
        if max(ids) >= self.vocab or min(ids) < 0:
            raise InvalidInput(f"token ids must be below the vocabulary size {self.vocab}")
        if len(request.image_spans) != len(request.embeddings):
            raise InvalidInput(f"{len(request.image_spans)} image spans for {len(request.embeddings)} embeddings")
        images = []
        end = 0
        for i, ((start, length), emb) in enumerate(zip(request.image_spans, request.embeddings, strict=True)):
            if emb.tokens != length or emb.hidden != self.hidden or start + length > len(ids):
                raise InvalidInput(
                    f"image {i}: embedding of {emb.tokens}x{emb.hidden} does not fit the span ({start}, {length}) "
                    f"of a {len(ids)}-token prompt on a model of hidden size {self.hidden}"
                )
            if start < end:
                raise InvalidInput(f"image {i}: its span ({start}, {length}) is before or inside the previous one's")
            end = start + length
            dtype = getattr(torch, emb.dtype, None)
            if not isinstance(dtype, torch.dtype) or len(emb.data) != emb.tokens * emb.hidden * dtype.itemsize:
                raise InvalidInput(f"image {i}: {len(emb.data)} bytes are not {emb.tokens}x{emb.hidden} {emb.dtype}")
            images.append(torch.frombuffer(bytearray(emb.data), dtype=dtype).view(emb.tokens, emb.hidden))
        live = _Live(ids, list(request.image_spans), images, request.sampling, generator(request.sampling),
                     IncrementalText(tok, request.sampling.stop))
        live.digests = [image_key(request, k) for k in range(len(images))]
        live.salt = request.cache_salt
        live.blocks = block_keys(ids, live.spans, live.digests, len(ids), salt=live.salt)
        if self.mrope:
            if len(request.image_grids) != len(images):
                raise InvalidInput(f"{len(images)} images need {len(images)} grids (grid_thw); got "
                                   f"{len(request.image_grids)}")
            live.rope, live.rope_delta = mrope_positions(self.loaded.model.config, ids, request.image_grids)
        return live

    async def run_step(self) -> int:
        """Run one batch step; returns the number of tokens it produced."""
        plan = self.batcher.step()
        self._release_gone(set(plan.prefilled) | set(plan.decoded))
        now = time.monotonic()
        for seq in plan.prefilled:
            live = self._live[seq]
            live.take, live.admitted = self.prefixes.take(live.blocks, len(live.ids)), now
        work = sorted(((s, self._live[s]) for s in plan.decoded), key=lambda w: w[1].take.slot if w[1].take else 0)
        fresh = [(s, self._live[s]) for s in plan.prefilled]
        if work or fresh:
            chosen = await asyncio.to_thread(self._compute, fresh, work)
            for (seq, live), token_id in zip(fresh + work, chosen, strict=True):
                self._emit(seq, live, token_id)
        self._release_gone({s for s in self.batcher.running if not s.cancelled})
        self._on_change()
        return len(plan.prefilled) + len(plan.decoded)

    def _compute(self, fresh: list[tuple[Sequence, _Live]], work: list[tuple[Sequence, _Live]]) -> list[int]:
        """Blocking: prefill the new sequences one by one, then one batched decode of the running ones."""
        chosen: list[int] = []
        with torch.inference_mode():
            for _, live in fresh:
                take = live.take
                assert take is not None
                if take.source >= 0:   # a shared prefix in a slot in use (prefilled before this, if this step's)
                    self.kv.copy_prefix(take.source, take.slot, take.copy_from, take.reused)
                embeds = self.runner.embed_prompt(live.ids, live.spans, live.images)[take.reused:]
                logits = self._suppress(self.runner.prefill(take.slot, embeds, live.rope, take.reused))
                live.images = []   # spliced into the KV: the features are no longer needed
                live.length = len(live.ids)
                chosen.append(choose(logits.cpu(), live.sampling, live.gen))
            if work:
                deltas = [lv.rope_delta for _, lv in work] if self.mrope else None
                logits = self._suppress(self.runner.decode(
                    [lv.take.slot for _, lv in work], [lv.length for _, lv in work],  # type: ignore[union-attr]
                    [lv.out[-1] for _, lv in work], deltas)).cpu()
                for row, (_, live) in zip(logits, work, strict=True):
                    live.length += 1
                    chosen.append(choose(row, live.sampling, live.gen))
        return chosen

    def _suppress(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., vocab] with the suppressed tokens' set to -inf: greedy and sampling alike skip them."""
        if self.suppressed is not None:
            logits[..., self.suppressed] = float("-inf")
        return logits

    def _emit(self, seq: Sequence, live: _Live, token_id: int) -> None:
        live.out.append(token_id)
        finish = None
        if token_id in self.eos:
            text, finish = live.text.finish(), "stop"
        else:
            text = live.text.push(token_id)
            if live.text.stopped:
                finish = "stop"
            elif len(live.out) >= seq.max_tokens:
                text, finish = text + live.text.finish(), "length"
        if finish is not None:
            self.batcher.cancel(seq)   # leaves the batch (its KV reservation freed) at the next step
            self._streams.completed(time.monotonic() - live.admitted)
        cached = live.take.reused if finish is not None and live.take is not None else None
        self._streams.publish(seq, Token(text, len(live.out) - 1, finish, cached))

    def _release_gone(self, stepping: set[Sequence]) -> None:
        """Free the slot of every sequence outside `stepping` (the sequences that run, or will run, a step):
        it left the batch (finished, stopped or cancelled)."""
        for seq, live in list(self._live.items()):
            if live.take is not None and seq not in stepping:
                self.prefixes.release(live.take.slot, block_keys(live.ids + live.out, live.spans, live.digests,
                                                            live.length, live.blocks, live.salt))
                del self._live[seq]
