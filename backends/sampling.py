"""Next-token choice per request: greedy at temperature 0, else temperature + nucleus (top_p) sampling.

Every request draws from its own generator, seeded by the request (`seed`) or at random, so a seeded
request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import secrets

import torch

from backends.executors import Sampling


def generator(sampling: Sampling) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(sampling.seed if sampling.seed is not None else secrets.randbits(63))
    return g


def choose(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> int:
    """logits: [vocab] float32 on the CPU."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs   # mass of the tokens ranked above each one
        sorted_probs[before >= sampling.top_p] = 0.0        # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen))
