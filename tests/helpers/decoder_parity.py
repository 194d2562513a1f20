"""Shared checks of our decoder runtime against transformers' (the reference implementation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from batchinf.runtime.generation.runtime import GenerateRuntime
from batchinf.runtime.generation.sampling import SamplingParams
from batchinf.runtime.generation.seq import GenRequest
from batchinf.runtime.llama import KVCache


def hf_causal_lm(d: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def prefill_logits(model: Any, seqs: list[list[int]]) -> torch.Tensor:
    """Our decoder's logits at every position of a right-padded batch, [B, S, V]."""
    S = max(map(len, seqs))
    tokens = torch.tensor([s + [0] * (S - len(s)) for s in seqs])
    cache = KVCache(model.config, len(seqs), S, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        return model.prefill(tokens, torch.tensor(list(map(len, seqs))), torch.arange(len(seqs)), cache,
                             all_logits=True)


def assert_greedy_matches(d: Path, texts: list[str] | list[list[int]], max_tokens: int, label: str,
                          ref: Any = None) -> None:
    """Greedy continuations of every text (or token list), batched through our continuous batching,
    equal transformers' generate on each alone, token for token; `ref` is the reference model
    (default: transformers' on `d` itself)."""
    rt = GenerateRuntime(d, {"context_length": 256, "special_tokens": {"eos_ids": []}})
    ref = hf_causal_lm(d) if ref is None else ref
    prompts = [t if isinstance(t, list) else rt.encode_prompt(t) for t in texts]
    results = {r.key: r for r in rt.generate(GenRequest(i, p, SamplingParams(max_tokens=max_tokens))
                                             for i, p in enumerate(prompts))}
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            out = ref.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
        assert results[i].token_ids == out[0, len(p):].tolist(), (label, i)
        assert results[i].finish_reason == "length" and results[i].output_tokens == max_tokens
