"""The generate runtime keeps its KV cache within the worker's budget: slots are cut to fit, and a
request that alone would not fit is refused before anything is allocated. The submit-time estimate
(limits.py, from config.json without torch) uses the same bytes per token as the runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchinf.limits import kv_values_per_token
from batchinf.runtime import bundle as rb
from batchinf.runtime.generation.runtime import GenerateRuntime
from batchinf.runtime.generation.sampling import SamplingParams
from batchinf.runtime.generation.seq import GenRequest, GenStats
from tests.helpers.tiny_llama import make_tiny_llama


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> GenerateRuntime:
    d = make_tiny_llama(tmp_path_factory.mktemp("kv") / "llama")
    rt = GenerateRuntime(d, rb.build_meta(d))
    rt.load_model()
    return rt


def _requests(rt: GenerateRuntime, n: int, max_tokens: int = 8) -> list[GenRequest]:
    return [GenRequest(i, rt.encode_prompt("hello " + "big " * i + "world"), SamplingParams(max_tokens=max_tokens))
            for i in range(n)]


def test_submit_estimate_matches_the_runtime(runtime: GenerateRuntime) -> None:
    config = json.loads((Path(runtime.root) / "config.json").read_text())
    # 2 layers x 2 (K, V) x 2 kv heads x 16 dims x 4 bytes (float32 on CPU)
    assert runtime.kv_bytes_per_token() == kv_values_per_token(config) * 4 == 512


def test_slots_are_cut_to_the_budget_and_results_do_not_change(runtime: GenerateRuntime) -> None:
    reqs = _requests(runtime, 6)
    capacity = max(len(r.prompt_ids) + r.params.max_tokens for r in reqs)
    free, tight = GenStats(), GenStats()
    want = {r.key: r.token_ids for r in runtime.generate(reqs, max_slots=6, stats=free)}
    got = {r.key: r.token_ids for r in runtime.generate(reqs, max_slots=6, stats=tight,
                                                        kv_budget=capacity * runtime.kv_bytes_per_token())}
    assert got == want
    # one slot: each prompt is prefilled alone, unpadded; six: prompts of different lengths share a padded pass
    assert tight.prefill_positions == tight.prompt_tokens
    assert free.prefill_positions > free.prompt_tokens


def test_a_request_over_the_budget_is_refused_before_allocating(runtime: GenerateRuntime) -> None:
    reqs = _requests(runtime, 2, max_tokens=200)
    need = len(reqs[0].prompt_ids) + 200
    with pytest.raises(ValueError, match=rf"request 0: prompt \+ max_tokens = {need} tokens need {need * 512} bytes "
                                         r"of KV cache, over this worker's budget of 4096 bytes \(BATCHINF_MAX_KV_CACHE_BYTES\)"):
        list(runtime.generate(reqs, kv_budget=4096))
