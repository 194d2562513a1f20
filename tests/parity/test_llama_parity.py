"""The Llama-family runtime against transformers (the reference implementation) on tiny random
llama, mistral and qwen2 models: logits, greedy generation and the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchinf.runtime import bundle as rb
from batchinf.runtime.generation.runtime import GenerateRuntime
from batchinf.runtime.llama import KVCache, load_llama
from tests.helpers.decoder_parity import assert_greedy_matches, hf_causal_lm
from tests.helpers.tiny_llama import FAMILIES, make_family_dirs

pytestmark = pytest.mark.parity

TEXTS = ["the people of the world", "hello", "write a long sentence about water and the earth, then stop",
         "number 42 is the answer to: what"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_family_dirs(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def runtime(tiny_dirs: dict[str, Path]) -> GenerateRuntime:
    d = tiny_dirs["llama"]
    rt = GenerateRuntime(d, rb.build_meta(d))
    rt.load_model()
    return rt


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tiny_dirs: dict[str, Path], family: str) -> None:
    d = tiny_dirs[family]
    ours, ref = load_llama(d), hf_causal_lm(d)
    rt = GenerateRuntime(d, {"context_length": 256})
    seqs = [rt.encode_prompt(t) for t in TEXTS]
    S = max(map(len, seqs))
    tokens = torch.tensor([s + [0] * (S - len(s)) for s in seqs])        # right-padded batch
    cache = KVCache(ours.config, len(seqs), S, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        got = ours.prefill(tokens, torch.tensor(list(map(len, seqs))), torch.arange(len(seqs)), cache,
                           all_logits=True)
        for i, s in enumerate(seqs):
            want = ref(torch.tensor([s])).logits[0]                      # each sequence alone, unpadded
            assert (got[i, :len(s)] - want).abs().max().item() <= 1e-4, (family, i)
    scaling = json.loads((d / "config.json").read_text()).get("rope_scaling")
    assert (ours.config.rope_scaling or {}).get("rope_type") == (scaling or {}).get("rope_type")


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(tiny_dirs: dict[str, Path], family: str) -> None:
    assert_greedy_matches(tiny_dirs[family], TEXTS, 20, family)


def test_chat_template_matches_transformers(runtime: GenerateRuntime) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(runtime.root)
    for messages in ([{"role": "user", "content": "hello world"}],
                     [{"role": "system", "content": "be short"}, {"role": "user", "content": "the water?"},
                      {"role": "assistant", "content": "light"}, {"role": "user", "content": "why"}]):
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert runtime.encode_chat(messages) == list(want)
    assert runtime.render_chat([{"role": "user", "content": "x"}]).endswith("<|im_start|>assistant\n")
