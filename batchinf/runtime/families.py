"""The registry of model families: which config.json `model_type`s batchinf runs, for which
tasks, and by which implementation. Bundle import detects a model's family here; the docs'
"Supported models" table is generated from it (a unit test keeps the two equal)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

NATIVE = "native"
FALLBACK = "transformers fallback"


@dataclass(frozen=True)
class Family:
    name: str                        # as the docs name it
    model_types: tuple[str, ...]     # config.json model_type values
    tasks: tuple[str, ...]
    runtime: tuple[str, ...]         # the batchinf.runtime modules that compute it
    implementation: str = NATIVE


FAMILIES: tuple[Family, ...] = (
    Family("BERT", ("bert",), ("embed", "score", "classify"), ("encoder", "classifier")),
    Family("XLM-RoBERTa, RoBERTa", ("xlm-roberta", "roberta"), ("embed", "score", "classify"),
           ("encoder", "classifier")),
    Family("ModernBERT", ("modernbert",), ("embed",), ("modernbert",)),
    Family("Llama (incl. Llama 3.x rope scaling), SmolLM", ("llama",), ("generate", "embed"), ("llama",)),
    Family("Mistral", ("mistral",), ("generate", "embed"), ("llama",)),
    Family("Qwen2, Qwen2.5", ("qwen2",), ("generate", "embed"), ("llama",)),
    Family("Qwen3 (q/k norms), Qwen3-Embedding", ("qwen3",), ("generate", "embed"), ("llama",)),
    Family("Gemma 2", ("gemma2",), ("generate", "embed"), ("llama", "gemma")),
    Family("Gemma 3 (text), EmbeddingGemma (bidirectional, embed only)", ("gemma3_text",), ("generate", "embed"),
           ("llama", "gemma")),
    Family("any other encoder transformers ships (MPNet, DistilBERT, ...)", ("(any other)",),
           ("embed",), ("hf_fallback",), FALLBACK),
    Family("any other causal LM transformers ships (GPT-2, GPT-NeoX/Pythia, OPT, Phi, Falcon, ...)",
           ("(any other)",), ("generate",), ("hf_decoder",), FALLBACK),
)

DECODER_TYPES = tuple(t for f in FAMILIES if "llama" in f.runtime for t in f.model_types)
ENCODER_TYPES = ("bert", "xlm-roberta", "roberta", "modernbert")
DECODER_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                         "Gemma2ForCausalLM", "Gemma3ForCausalLM")


def is_decoder(config: dict[str, Any]) -> bool:
    return (config.get("model_type", "") in DECODER_TYPES
            or any(a in DECODER_ARCHITECTURES for a in config.get("architectures") or ()))


def is_decoder_embedding(config: dict[str, Any], src: Path) -> bool:
    """A decoder shipped as a sentence-transformers model (modules.json with a Pooling module, e.g.
    Qwen3-Embedding): an embed bundle, pooled over the decoder's final hidden states."""
    modules = Path(src) / "modules.json"
    return is_decoder(config) and modules.is_file() and "Pooling" in modules.read_text()


def gguf_support() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(model_types runtime/gguf.py converts, tensor types it dequantises), read from its tables."""
    from batchinf.runtime.gguf_arch import ARCHS
    from batchinf.runtime.gguf_quants import GGML_TYPES

    return (tuple(sorted({a.model_type for a in ARCHS.values()} | {"mistral"})),   # Mistral files are `llama`
            tuple(t[0] for t in GGML_TYPES.values()))


def supported_models_markdown() -> str:
    """The supported-models table (docs/reference/supported-models.md)."""
    gguf_types, quant = gguf_support()
    rows = ["| Family | config.json `model_type` | Tasks | Implementation | GGUF import |",
            "|---|---|---|---|---|"]
    for f in FAMILIES:
        gguf = ", ".join(quant) if set(f.model_types) & set(gguf_types) else "—"
        rows.append(f"| {f.name} | {', '.join(f.model_types)} | {', '.join(f.tasks)} | "
                    f"{f.implementation} ({', '.join(f'`runtime/{m}.py`' for m in f.runtime)}) | {gguf} |")
    return "\n".join(rows) + "\n"


TABLE_START, TABLE_END = "<!-- supported-models:start -->", "<!-- supported-models:end -->"
