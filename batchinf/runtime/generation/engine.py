"""Runs a scheduler's StepPlan on a decoder and its KV cache: the torch side of generation.

The model is a Llama-family decoder (runtime/llama.py) or the transformers fallback
(runtime/hf_decoder.py): `prefill`, `decode_step`, `fill` and `new_cache` with `move` and per-layer
`copy_prefix`. The decode step is the plain function `decode_one_token`, so it can be wrapped by
torch.compile (as gpt-fast does) without touching the loop around it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from batchinf.runtime.generation.sampling import generator, sample
from batchinf.runtime.generation.scheduler import StepPlan
from batchinf.runtime.generation.seq import GenStats, Seq
from batchinf.runtime.generation.stops import follow, stop_ids
from batchinf.runtime.generation.structured import Vocab


def decode_one_token(model: Any, tokens: torch.Tensor, input_pos: torch.Tensor, cache: Any,
                     fill: Any = None) -> torch.Tensor:
    """One decode step: token [B] of each row at its position [B] (K/V written there), and a Fill's
    prompt tokens in the same forward pass -> next-token logits [B, V]."""
    return model.decode_step(tokens, input_pos, cache, fill)


def right_padded(rows: list[list[int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (tokens [B, S] right-padded with 0, lengths [B])."""
    S = max(map(len, rows))
    return (torch.tensor([r + [0] * (S - len(r)) for r in rows], device=dev),
            torch.tensor([len(r) for r in rows], device=dev))


class Engine:
    """One generate call's model, cache and counters; `decode` turns ids to text (stop strings),
    `vocab` gives the structured-output vocabulary on first use."""

    def __init__(self, model: Any, cache: Any, stats: GenStats, *, eos_ids: tuple[int, ...],
                 decode: Callable[[list[int]], str], vocab: Callable[[], Vocab]) -> None:
        self.model, self.cache, self.stats = model, cache, stats
        self.eos_ids, self.decode, self.vocab = eos_ids, decode, vocab
        self.dev = model.device

    def run(self, plan: StepPlan) -> None:
        for src, dst, positions in plan.moves:
            self.cache.move(src, dst, positions)
        for s in plan.admitted:
            self.start(s)
        self.prefill(plan)
        if any(s is not None and not s.done for s in plan.decode):
            self.decode_step(plan)

    def start(self, s: Seq) -> None:
        p = s.req.params
        s.stops = stop_ids(self.eos_ids, p)
        s.gen = generator(p, self.dev)
        s.guide = self.vocab().guide(p.response_format, s.req.key) if p.response_format is not None else None

    def prefill(self, plan: StepPlan) -> None:
        """Prefill the new sequences that share no prefix (their first token), then copy the shared
        prefixes' K/V (those sequences join the decode step)."""
        dev, stats = self.dev, self.stats
        for group in plan.prefill:
            tokens, lengths = right_padded([s.req.prompt_ids for s in group], dev)
            logits = self.model.prefill(tokens, lengths, torch.tensor([s.slot for s in group], device=dev), self.cache)
            stats.prefill_positions += tokens.numel()
            self.advance(group, logits)
        if plan.copies:
            shared = torch.tensor([s.start for s, _ in plan.copies], device=dev)
            dst = torch.tensor([s.slot for s, _ in plan.copies], device=dev)
            src = torch.tensor([d.slot for _, d in plan.copies], device=dev)
            for layer in self.cache.layers:
                layer.copy_prefix(dst, src, shared)
            stats.cached_prompt_tokens += int(shared.sum())
        stats.prompt_tokens += sum(len(s.req.prompt_ids) for s in plan.admitted)

    def decode_step(self, plan: StepPlan) -> None:
        from batchinf.runtime.llama import Fill

        rows, dev, stats = plan.decode, self.dev, self.stats
        # Idle and finished rows recompute their own last position: harmless, and counted as waste.
        # A joining row (no output yet) feeds its last prompt token.
        tokens = [(s.out[-1] if s.out else s.req.prompt_ids[-1]) if s is not None else 0 for s in rows]
        pos = [s.pos if s is not None else 0 for s in rows]
        fills = []
        for group in plan.fills:
            tokens_g, lengths = right_padded([s.req.prompt_ids[s.start:-1] for s in group], dev)
            fills.append(Fill(tokens_g, torch.tensor([s.start for s in group], device=dev),
                              torch.tensor([s.slot for s in group], device=dev), lengths))
            stats.prefill_positions += tokens_g.numel()
        for fill in fills[:-1]:             # only the last group rides along the decode step
            self.model.fill(fill, self.cache)
        logits = decode_one_token(self.model, torch.tensor(tokens, device=dev), torch.tensor(pos, device=dev),
                                  self.cache, fills[-1] if fills else None)
        live = [s for s in rows if s is not None and not s.done]
        stats.decode_slot_steps += len(rows)
        stats.decode_tokens += len(live)
        stats.joined += len(plan.copies)
        self.advance(live, logits[[s.slot for s in live]] if len(live) < len(rows) else logits)

    def release(self, s: Seq) -> None:
        """A finished sequence's slot memory handed back (a cache that can: runtime/llama.py)."""
        if (release := getattr(self.cache, "release", None)) is not None:
            release(s.slot)

    def advance(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        """Pick each sequence's next token from its logits row [len(seqs), V] (greedy, sampled,
        masked by its grammar; logprobs where asked) and check stops."""
        picked = logits.argmax(-1).tolist()
        for i, s in enumerate(seqs):
            row = s.guide.masked(logits[i]) if s.guide is not None else logits[i]
            if s.gen is not None:
                picked[i] = sample(row, s.req.params, s.gen)
            elif s.guide is not None:
                picked[i] = int(row.argmax())
            if s.req.params.logprobs is not None:
                s.logprobs.append(self.vocab().logprobs(logits[i], picked[i], s.req.params.logprobs))
        for s, t in zip(seqs, picked):
            follow(s, t, self.decode)
