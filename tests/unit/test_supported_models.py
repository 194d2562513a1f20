"""The "Supported models" table of docs/reference/supported-models.md is the family registry's, and
the registry says what the code does: every native model_type is one its runtime accepts, and the
GGUF column is gguf.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchinf.errors import BundleError
from batchinf.runtime import families, gguf
from batchinf.runtime.encoder import EncoderConfig
from batchinf.runtime.families import FAMILIES, NATIVE, TABLE_END, TABLE_START, supported_models_markdown
from batchinf.runtime.llama import MODEL_TYPES, config_of
from batchinf.runtime.modernbert import ModernBertConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "supported-models.md"
TINY = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "max_position_embeddings": 32}


def test_docs_table_is_generated_from_the_registry() -> None:
    text = PAGE.read_text()
    assert TABLE_START in text and TABLE_END in text, f"{PAGE} lacks the supported-models markers"
    table = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip("\n") + "\n"
    assert table == supported_models_markdown(), (
        f"{PAGE}'s Supported models table is stale; regenerate it with "
        "`python -c \"from batchinf.runtime.families import supported_models_markdown as f; print(f())\"`")


def test_registry_matches_the_runtimes() -> None:
    assert set(families.DECODER_TYPES) == set(MODEL_TYPES)
    for fam in FAMILIES:
        if fam.implementation != NATIVE:
            continue
        for mt in fam.model_types:
            if "llama" in fam.runtime:
                assert config_of({**TINY, "model_type": mt}).model_type == mt
            elif "modernbert" in fam.runtime:
                ModernBertConfig.from_hf({**TINY, "model_type": mt})
            else:
                EncoderConfig.from_hf({**TINY, "model_type": mt})
    with pytest.raises(BundleError):
        config_of({**TINY, "model_type": "gpt2"})


def test_gguf_column_comes_from_gguf_py() -> None:
    archs, types = families.gguf_support()
    assert set(types) == {t[0] for t in gguf.GGML_TYPES.values()}
    assert set(archs) <= set(families.DECODER_TYPES)
    table = supported_models_markdown()
    for line in table.splitlines()[2:]:
        model_types = line.split("|")[2]
        has_gguf = any(t.strip() in archs for t in model_types.split(","))
        assert (", ".join(types) in line) == has_gguf, line
