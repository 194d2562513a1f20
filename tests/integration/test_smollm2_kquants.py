"""Real K-quant GGUF files: SmolLM2-135M-Instruct re-quantised by llama.cpp's own `llama-quantize`
(tests/helpers/llama_quantize.py builds it once) to Q4_K_M and Q6_K. Each file's every tensor,
dequantised by our reader, equals the `gguf` package's dequantisation bit for bit; each file
imported with `bundle import-gguf` gives the same greedy tokens as transformers' GGUF loader."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from batchinf.runtime.generation.runtime import GenerateRuntime
from batchinf.runtime.gguf import GGUFFile
from batchinf.runtime.gguf_quants import GGML_TYPES
from tests.helpers.gguf_greedy import assert_greedy_matches
from tests.helpers.llama_quantize import requantised_smollm2

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors."]
TOKENS = 16
# what llama.cpp writes for a 576-wide model: K-quants where rows are multiples of 256, its fallbacks elsewhere
KINDS = {"Q4_K_M": {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"}, "Q6_K": {"Q6_K", "Q8_0", "F32"}}


@pytest.fixture(scope="module", params=sorted(KINDS))
def kquant(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, requantised_smollm2(request.param)


def test_every_tensor_equals_gguf_dequantisation(kquant: tuple[str, Path]) -> None:
    import gguf

    kind, path = kquant
    reader = gguf.GGUFReader(str(path))
    seen = set()
    with GGUFFile(path) as g:
        for t in reader.tensors:
            want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            got = g.tensor(t.name)
            seen.add(GGML_TYPES[g.tensors[t.name].ggml_type][0])
            np.testing.assert_array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32),
                                          err_msg=t.name)
    assert seen == KINDS[kind]


@pytest.fixture(scope="module")
def converted(kquant: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenerateRuntime]:
    from click.testing import CliRunner

    from batchinf.bundles import open_runtime
    from batchinf.cli import main
    from tests.helpers.env import reset_process_state, use_home

    kind, path = kquant
    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, tmp_path_factory.mktemp("home"), fast_leases=False)
        r = CliRunner().invoke(main, ["bundle", "import-gguf", str(path), "--name", f"smollm2-{kind.lower()}",
                                      "--json"])
        assert r.exit_code == 0, r.output
        yield open_runtime(json.loads(r.output)["digest"])
        reset_process_state()


def test_greedy_matches_transformers_gguf(kquant: tuple[str, Path], converted: GenerateRuntime) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, path = kquant
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = assert_greedy_matches(converted, model, tok, QUESTIONS, TOKENS)
    assert "France" in ours[0].text     # re-quantised twice (Q4_1 first): it says "L'Étoile ...", not Paris
