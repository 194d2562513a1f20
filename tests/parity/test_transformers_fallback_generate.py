"""Generation through the transformers fallback (runtime/hf_decoder.py) on tiny random GPT-2,
GPT-NeoX and OPT models, which have no native decoder: imported with `implementation:
transformers`, their greedy answers through continuous batching (few slots, so freed slots are
refilled and compacted) equal transformers' own `generate(do_sample=False)` on each prompt alone,
the end-of-sequence token and max_tokens included; seeded sampling gives the same answer twice
and whatever shares the batch; stop strings cut the text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchinf.runtime.generation.runtime import GenerateRuntime
from batchinf.runtime.generation.sampling import SamplingParams
from batchinf.runtime.generation.seq import GenRequest
from batchinf.tasks import build_meta
from tests.helpers.decoder_parity import hf_causal_lm
from tests.helpers.tiny_decoders import FALLBACK_CONFIGS, make_tiny_causal_lm

pytestmark = pytest.mark.parity

TEXTS = ["the people of the world", "hello", "number 42 is the answer to: what",
         "write a long sentence about water and the earth, then stop, and then write one more about the sky",
         "the sky", "water and earth and people", "one more", "what is the answer"]
MAX_TOKENS = [12, 3, 20, 7, 16, 1, 9, 14]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("fallback-decoders")
    out = {}
    for i, fam in enumerate(FALLBACK_CONFIGS):
        d = make_tiny_causal_lm(root / fam, fam, seed=i)
        out[fam] = (d, build_meta(d))
    return out


def _run(d: Path, meta: dict, reqs: list[GenRequest], **kw) -> dict:
    rt = GenerateRuntime(d, meta)
    return {r.key: r for r in rt.generate(reqs, **kw)}


@pytest.mark.parametrize("family", list(FALLBACK_CONFIGS))
def test_import_records_the_fallback(bundles: dict, family: str) -> None:
    import transformers

    d, meta = bundles[family]
    assert meta["task"] == "generate" and meta["family"] == family
    assert meta["implementation"] == {"name": "transformers", "version": transformers.__version__}
    rt = GenerateRuntime(d, meta)
    rt.load_model()
    assert type(rt.model).__name__ == "TransformersDecoder" and not rt.share_prefixes
    ref = hf_causal_lm(d)
    for fx in meta["fixtures"]:
        if "continuation" in fx:
            with torch.inference_mode():
                out = ref.generate(torch.tensor([fx["token_ids"]]), max_new_tokens=len(fx["continuation"]),
                                   do_sample=False, pad_token_id=0)
            assert fx["continuation"] == out[0, len(fx["token_ids"]):].tolist()[:len(fx["continuation"])]


@pytest.mark.parametrize("family", list(FALLBACK_CONFIGS))
def test_greedy_equals_transformers_generate(bundles: dict, family: str) -> None:
    d, meta = bundles[family]
    rt = GenerateRuntime(d, meta)
    prompts = [rt.encode_prompt(t) for t in TEXTS]
    reqs = [GenRequest(i, p, SamplingParams(max_tokens=n)) for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS))]
    got = _run(d, meta, reqs, max_slots=3, max_batch_tokens=120)
    ref = hf_causal_lm(d)
    eos = set(meta["special_tokens"]["eos_ids"])
    stopped = 0
    for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS)):
        with torch.inference_mode():
            out = ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                               eos_token_id=sorted(eos))[0, len(p):].tolist()
        r = got[i]
        if out and out[-1] in eos:      # batchinf drops the stop token from the text, counts it
            stopped += 1
            assert (r.finish_reason, r.token_ids, r.output_tokens) == ("stop", out[:-1], len(out)), i
        else:
            assert (r.finish_reason, r.token_ids, r.output_tokens) == ("length", out, n), i
        assert r.text == rt.decode(r.token_ids)
    assert stopped < len(TEXTS)


@pytest.mark.parametrize("family", list(FALLBACK_CONFIGS))
def test_seeded_sampling_is_reproducible(bundles: dict, family: str) -> None:
    d, meta = bundles[family]
    rt = GenerateRuntime(d, meta)
    prompts = [rt.encode_prompt(t) for t in TEXTS]

    def reqs(keys: list[int]) -> list[GenRequest]:
        return [GenRequest(i, prompts[i], SamplingParams(max_tokens=MAX_TOKENS[i] + 4, temperature=1.3, top_k=40,
                                                         top_p=0.95, seed=1000 + i)) for i in keys]

    everything = list(range(len(TEXTS)))
    first = _run(d, meta, reqs(everything), max_slots=3)
    second = _run(d, meta, reqs(everything), max_slots=5)
    alone = _run(d, meta, reqs([2]))
    assert {k: (r.token_ids, r.text) for k, r in first.items()} == {k: (r.token_ids, r.text) for k, r in second.items()}
    assert alone[2].token_ids == first[2].token_ids
    greedy = _run(d, meta, [GenRequest(i, prompts[i], SamplingParams(max_tokens=MAX_TOKENS[i] + 4)) for i in everything])
    assert any(first[i].token_ids != greedy[i].token_ids for i in everything)    # it did sample


def test_stop_string_cuts_the_text(bundles: dict) -> None:
    d, meta = bundles["gpt2"]
    rt = GenerateRuntime(d, meta)
    p = rt.encode_prompt(TEXTS[0])
    full = _run(d, meta, [GenRequest(0, p, SamplingParams(max_tokens=20))])[0]
    assert len(full.text) > 6, full
    stop = full.text[len(full.text) // 2:][:3]
    cut = _run(d, meta, [GenRequest(0, p, SamplingParams(max_tokens=20, stop=(stop,)))])[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
