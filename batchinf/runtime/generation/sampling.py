"""Sampling for generation: per-record parameters, seeds and generators, and one token from logits.
torch is imported by the functions that need it: planning resolves each record's params and seed
here, and a planner that imported torch for that paid seconds (6 of a loaded machine's 8-second
plan of 128 chat prompts) and its memory."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0        # 0 -> greedy
    top_k: int = 0                  # 0 -> off
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()   # in addition to the bundle's eos ids
    stop: tuple[str, ...] = ()             # stop strings: text is cut before the first match
    seed: int = 0                          # per record: derive_seed(job_seed, record_id)
    response_format: str | None = None     # canonical_response_format JSON; None: text
    logprobs: int | None = None            # None: off; n: each token's logprob and the n most likely


def derive_seed(job_seed: int, record_id: str) -> int:
    """A record's sampling seed: stable across processes and retries, 63-bit."""
    h = hashlib.sha256(f"{int(job_seed)}\x00{record_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") >> 1


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One token from logits [V] with temperature, top-k and top-p (as transformers' warpers)."""
    import torch

    x = logits.float() / p.temperature
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x)                              # ascending
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum <= 1 - p.top_p
        drop[-1] = False                                             # keep at least the top token
        x = x.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = x.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def generator(p: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A sampled sequence's own generator, seeded with its seed; None when greedy."""
    if p.temperature <= 0:
        return None
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(p.seed)
    return gen

