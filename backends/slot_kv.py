"""Slot KV: a preallocated KV cache with one fixed slot per sequence, behind a Hugging Face decoder.

The cache is `[layers, slots, kv_heads, max_len, head_dim]` for K and for V, allocated once. A sequence
owns one slot from admission to its end: joining or leaving the batch copies no other sequence's KV and
re-pads nothing, and each slot keeps its own length and positions. Hugging Face attention layers only
call the cache's `update(k, v, layer_idx)`, and a ready 4-D attention mask is used as it is, so a
duck-typed cache is enough: `update` writes the step's keys and values at each row's positions and returns
the first `kv_len` positions of the rows' slots; the mask hides what lies beyond each row's length.

Positions for the rotary embedding are the cache positions, or for the Qwen2-VL family 3-D M-RoPE positions
(temporal, height, width): computed for the prompt from the image grids, then `length + rope_delta` on all
three axes while decoding.

Attention reads up to the longest live sequence for every row: cheap when lengths are close, wasteful
when they are very uneven (a paged cache would not be).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


class SlotKV:
    def __init__(
        self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots, self.max_len = slots, max_len
        self.rows = torch.zeros(0, dtype=torch.long, device=device)
        self.pos = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.kv_len = 0
        self.span: slice | None = None   # rows as a slice when they are consecutive: read a view, copy nothing

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> (
        tuple[torch.Tensor, torch.Tensor]
    ):
        """k, v: [rows, kv_heads, q, head_dim] → this layer's [rows, kv_heads, kv_len, head_dim]."""
        keys, values = self.k[layer_idx], self.v[layer_idx]
        keys[self.rows[:, None], :, self.pos] = k.transpose(1, 2)
        values[self.rows[:, None], :, self.pos] = v.transpose(1, 2)
        rows = self.span if self.span is not None else self.rows
        return keys[rows, :, : self.kv_len], values[rows, :, : self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    def copy_prefix(self, source: int, slot: int, start: int, end: int) -> None:
        """The KV of positions [start, end) of slot `source` into slot `slot` (part of a shared prefix)."""
        for cache in (self.k, self.v):
            cache[:, slot, :, start:end] = cache[:, source, :, start:end]


class DecoderRunner:
    """Prefill one sequence into its slot, or decode one token for a batch of slots (no grad, blocking)."""

    def __init__(self, decoder: nn.Module, head: nn.Module, kv: SlotKV) -> None:
        self.decoder, self.head, self.kv = decoder, head, kv
        self.embed: nn.Module = decoder.get_input_embeddings()   # type: ignore[operator]
        self.device = kv.k.device
        # transformers renamed the decoders' `past_key_values` argument to `cache` (the old name warns, then goes
        # in 5.40): pass the cache under the name this version's decoder takes.
        params = inspect.signature(decoder.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def _forward(self, embeds: torch.Tensor, slots: list[int], pos: torch.Tensor, position_ids: torch.Tensor,
                 kv_len: int, mask: torch.Tensor) -> torch.Tensor:
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        self.kv.span = slice(slots[0], slots[-1] + 1) if consecutive else None
        self.kv.rows, self.kv.pos, self.kv.kv_len = torch.tensor(slots, device=self.device), pos, kv_len
        out = self.decoder(inputs_embeds=embeds, position_ids=position_ids, attention_mask=mask, use_cache=True,
                           **{self._cache_arg: self.kv})
        logits: torch.Tensor = self.head(out.last_hidden_state[:, -1]).float()
        return logits

    def embed_prompt(self, ids: list[int], spans: list[tuple[int, int]], images: list[torch.Tensor]) -> torch.Tensor:
        """The prompt's input embeddings, each image's features spliced in at its placeholder span."""
        embeds: torch.Tensor = self.embed(torch.tensor(ids, device=self.device))
        for (start, length), feats in zip(spans, images, strict=True):
            embeds[start:start + length] = feats.to(device=self.device, dtype=embeds.dtype)
        return embeds

    @torch.inference_mode()
    def prefill(self, slot: int, embeds: torch.Tensor, rope: torch.Tensor | None = None, start: int = 0) -> (
        torch.Tensor
    ):
        """embeds: [n − start, hidden], the prompt's tokens from `start` on (the slot's KV already holds the
        first `start`: a reused prefix); rope: [3, n] M-RoPE positions of the whole prompt or None → logits
        [vocab] of the next token."""
        n = start + embeds.shape[0]
        pos = torch.arange(start, n, device=self.device)[None]
        position_ids = pos if rope is None else rope[:, start:].to(self.device)[:, None, :]
        mask = torch.ones(n - start, n, dtype=torch.bool, device=self.device).tril(diagonal=start)[None, None]
        return self._forward(embeds[None], [slot], pos, position_ids, n, mask)[0]

    @torch.inference_mode()
    def decode(self, slots: list[int], lengths: list[int], tokens: list[int], rope_deltas: list[int] | None = None) -> (
        torch.Tensor
    ):
        """One token per slot, each appended at position `lengths[i]` → logits [batch, vocab]. Pass the slots in
        ascending order: consecutive slots are read in place."""
        lens = torch.tensor(lengths, device=self.device)
        pos = lens[:, None]
        position_ids = pos
        if rope_deltas is not None:
            position_ids = (pos + torch.tensor(rope_deltas, device=self.device)[:, None])[None].expand(3, -1, -1)
        kv_len = int(max(lengths)) + 1
        mask = (torch.arange(kv_len, device=self.device)[None] <= lens[:, None])[:, None, None]
        embeds = self.embed(torch.tensor(tokens, device=self.device)[:, None])
        return self._forward(embeds, slots, pos, position_ids, kv_len, mask)
