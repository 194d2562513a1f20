"""The GGUF importer on the real SmolLM2-135M-Instruct (Q4_1) against transformers' own GGUF loader."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from batchinf.runtime.generation.runtime import GenerateRuntime
from batchinf.runtime.gguf import GGUFFile
from tests.helpers.gguf_greedy import assert_greedy_matches

pytestmark = pytest.mark.integration

TEXTS = ["Hello, world! How are you?", "The capital of France is Paris.",
         "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "Ünïcödé, emoji 🚀 and CJK 中文  two  spaces\n\nnewlines\tand tabs",
         "def f(x):\n    return x ** 2  # squares"]
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors."]
TOKENS = 16


@pytest.fixture(scope="module")
def converted(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenerateRuntime]:
    """`batchinf bundle import-gguf` into a fresh home, then the bundle opened (digests and fixtures verified)."""
    from click.testing import CliRunner

    from batchinf.bundles import open_runtime
    from batchinf.cli import main
    from tests.helpers.env import reset_process_state, use_home

    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, tmp_path_factory.mktemp("home"), fast_leases=False)
        r = CliRunner().invoke(main, ["bundle", "import-gguf", str(smollm2_gguf), "--name", "smollm2",
                                      "--alias", "prod", "--json"])
        assert r.exit_code == 0, r.output
        info = json.loads(r.output)
        assert (info["task"], info["family"], info["aliases"]) == ("generate", "llama", ["smollm2@prod"])
        yield open_runtime(info["digest"])
        reset_process_state()


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": smollm2_gguf.name}
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, dtype=torch.float32, **kw).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kw)


@pytest.mark.slow
def test_gguf_header_and_conversion(smollm2_gguf: Path, converted: GenerateRuntime) -> None:
    with GGUFFile(smollm2_gguf) as g:
        types = {g.tensors[n].ggml_type for n in g.tensors}
        assert g.metadata["general.architecture"] == "llama" and g.metadata["tokenizer.ggml.pre"] == "smollm"
    assert types == {0, 3, 8}                           # F32, Q4_1, Q8_0: all dequantised by our reader
    cfg = json.loads((converted.root / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (30, 3, True)
    meta = converted.meta
    assert meta["special_tokens"]["eos_ids"] == [2] and meta["chat_template"] is True
    assert meta["context_length"] == 8192


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf(converted: GenerateRuntime, reference) -> None:
    _, tok = reference
    for text in TEXTS:
        assert converted.encode_prompt(text) == tok(text)["input_ids"], text
    # tokenizer.ggml.pre "smollm": digits are split one by one, as llama.cpp and the HF tokenizer do.
    digits = converted.encode_prompt("12345")
    assert [converted.decode([t]) for t in digits] == list("12345")


@pytest.mark.slow
def test_greedy_matches_transformers_gguf(converted: GenerateRuntime, reference) -> None:
    model, tok = reference
    ours = assert_greedy_matches(converted, model, tok, QUESTIONS, TOKENS)
    assert "Paris" in ours[0].text


def test_import_gguf_refuses_non_gguf(bi_home: Path) -> None:
    from click.testing import CliRunner

    from batchinf.cli import main

    bad = bi_home.parent / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    r = CliRunner().invoke(main, ["bundle", "import-gguf", str(bad), "--name", "x"])
    assert r.exit_code == 2 and "not a GGUF file" in r.output


CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                         "coastal": {"type": "boolean"}},
        "required": ["city", "population", "coastal"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                         "rating": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["title", "year", "rating", "tags"], "additionalProperties": False}
PLANET = {"type": "object", "properties": {"name": {"type": "string"}, "mass_kg": {"type": "number"},
                                           "moons": {"type": "integer"}, "gas_giant": {"type": "boolean"}},
          "required": ["name", "mass_kg", "moons", "gas_giant"], "additionalProperties": False}
ASKS = {"city": (CITY, ["Describe Paris as JSON.", "Describe Tokyo as JSON.", "Give me a city in Peru as JSON.",
                        "Describe the largest city in Canada as JSON."]),
        "book": (BOOK, ["Describe the novel Dune as JSON.", "Describe a famous French book as JSON.",
                        "Describe Moby Dick as JSON.", "Describe a book about gardening as JSON."]),
        "planet": (PLANET, ["Describe Jupiter as JSON.", "Describe Mars as JSON.", "Describe Earth as JSON.",
                            "Describe Neptune as JSON."])}


@pytest.mark.parametrize("name", list(ASKS))
def test_structured_output_of_a_weak_model_finishes_in_schema_order(converted: GenerateRuntime, name: str) -> None:
    """SmolLM2-135M, greedy, 120 tokens: numbers are bounded to what JSON consumers hold (an
    unbounded integer used to run "population": 1111111... out of tokens), keys come in the
    schema's order (as OpenAI's strict mode writes them); at least 3 of 4 answers finish valid."""
    import jsonschema

    from batchinf.checks import canonical_response_format
    from batchinf.runtime.generation.sampling import SamplingParams
    from batchinf.runtime.generation.seq import GenRequest

    schema, prompts = ASKS[name]
    rf = canonical_response_format({"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                          "strict": True}})
    reqs = [GenRequest(k, converted.encode_chat([{"role": "user", "content": p}]),
                       SamplingParams(max_tokens=120, response_format=rf)) for k, p in enumerate(prompts)]
    results = sorted(converted.generate(reqs), key=lambda r: r.key)
    finished = []
    for r in results:
        if r.finish_reason != "stop":
            continue
        answer = json.loads(r.text)
        jsonschema.validate(answer, schema)
        assert list(answer) == list(schema["properties"]), r.text
        finished.append(r.text)
    assert len(finished) >= 3, [r.text for r in results]
