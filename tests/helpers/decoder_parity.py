"""Shared checks of our decoder runtime against transformers' (the reference implementation)."""

from __future__ import annotations

from pathlib import Path

import torch

from batchinf.runtime.generate import GenerateRuntime, GenRequest, SamplingParams


def hf_causal_lm(d: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def assert_greedy_matches(d: Path, texts: list[str], max_tokens: int, label: str) -> None:
    """Greedy continuations of every text, batched through our continuous batching, equal
    transformers' generate on each text alone, token for token."""
    rt = GenerateRuntime(d, {"context_length": 256, "special_tokens": {"eos_ids": []}})
    ref = hf_causal_lm(d)
    prompts = [rt.encode_prompt(t) for t in texts]
    results = {r.key: r for r in rt.generate(GenRequest(i, p, SamplingParams(max_tokens=max_tokens))
                                             for i, p in enumerate(prompts))}
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            out = ref.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
        assert results[i].token_ids == out[0, len(p):].tolist(), (label, i)
        assert results[i].finish_reason == "length" and results[i].output_tokens == max_tokens
