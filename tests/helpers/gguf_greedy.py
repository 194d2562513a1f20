"""Greedy generation of an imported GGUF bundle against transformers' own GGUF loader on the same file."""

from __future__ import annotations

from typing import Any

import torch


def assert_greedy_matches(rt: Any, model: Any, tok: Any, questions: list[str], tokens: int) -> list[Any]:
    """Chat prompts tokenized alike, then `tokens` greedy tokens identical per question (EOS id 2,
    SmolLM2's `<|im_end|>`); returns our results in question order."""
    prompts = [rt.encode_chat([{"role": "user", "content": q}]) for q in questions]
    for p, q in zip(prompts, questions):
        assert p == list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))
    from batchinf.runtime.generation.sampling import SamplingParams
    from batchinf.runtime.generation.seq import GenRequest

    ours = {r.key: r for r in rt.generate(GenRequest(i, p, SamplingParams(max_tokens=tokens))
                                          for i, p in enumerate(prompts))}
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            out = model.generate(torch.tensor([p]), max_new_tokens=tokens, do_sample=False, eos_token_id=2,
                                 pad_token_id=2)[0, len(p):].tolist()
        got = ours[i].token_ids + ([2] if ours[i].finish_reason == "stop" else [])
        assert got == out, (questions[i], ours[i].text)
    return [ours[i] for i in range(len(prompts))]
