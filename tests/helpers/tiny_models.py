"""Tiny, random, complete HF/sentence-transformers BERT model directories for fast tests."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# Texts for encoder tests: short and long, in and out of the tiny vocabulary, so a batch pads.
ENCODER_TEXTS = [
    "hello",
    "The model reads a batch of text and writes one vector per line.",
    "Zebras quietly x-ray 42 jovial kiwis; QED!",
    "a b c",
    "Every good boy does fine, " * 6,
]
COMMON_WORDS = (
    "the of and to a in is it you that he was for on are with as i his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round man year came show every good "
    "me give our under name very through just form sentence great think say help low line differ "
    "turn cause much mean before move right boy old too same tell does set three want air well "
    "also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father model batch text data test hello"
).split()


def _vocab(vocab_words: list[str] | None) -> list[str]:
    words = COMMON_WORDS if vocab_words is None else vocab_words
    # Single characters and their ## continuations make every ASCII text tokenizable.
    chars = list(string.ascii_lowercase + string.digits)
    pieces = SPECIAL_TOKENS + chars + list(string.punctuation) + ["##" + c for c in chars]
    pieces += [w for w in words if w not in pieces]
    return list(dict.fromkeys(pieces))


def _build_tokenizer(vocab: list[str]) -> Tokenizer:
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls_id, sep_id = vocab.index("[CLS]"), vocab.index("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def _random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]

    def normal(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm(prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": 1.0 + normal(D, std=0.1), f"{prefix}.bias": normal(D, std=0.1)}

    def linear(prefix: str, d_out: int, d_in: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": normal(d_out, d_in), f"{prefix}.bias": normal(d_out, std=0.05)}

    w = {
        "embeddings.word_embeddings.weight": normal(V, D, std=1.0),
        "embeddings.position_embeddings.weight": normal(cfg["max_position_embeddings"], D, std=0.5),
        "embeddings.token_type_embeddings.weight": normal(cfg["type_vocab_size"], D, std=0.5),
        **norm("embeddings.LayerNorm"),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        for name in ("query", "key", "value"):
            w.update(linear(f"{p}.attention.self.{name}", D, D))
        w.update(linear(f"{p}.attention.output.dense", D, D))
        w.update(norm(f"{p}.attention.output.LayerNorm"))
        w.update(linear(f"{p}.intermediate.dense", F, D))
        w.update(linear(f"{p}.output.dense", D, F))
        w.update(norm(f"{p}.output.LayerNorm"))
    w.update(linear("pooler.dense", D, D))
    return {k: v.contiguous() for k, v in w.items()}


def _write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2))


def make_tiny_bert(
    dir: Path,
    *,
    vocab_words: list[str] | None = None,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    intermediate: int = 64,
    max_position: int = 128,
    seed: int = 0,
    pooling: str = "mean",
    normalize: bool = True,
) -> Path:
    """Write a loadable (transformers, sentence-transformers, batchinf) tiny BERT into `dir`."""
    if pooling not in ("mean", "cls"):
        raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    vocab = _vocab(vocab_words)
    cfg = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": len(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_position,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "position_embedding_type": "absolute",
        "pad_token_id": 0,
    }
    _write_json(dir / "config.json", cfg)
    save_file(_random_weights(cfg, seed), str(dir / "model.safetensors"), metadata={"format": "pt"})

    _build_tokenizer(vocab).save(str(dir / "tokenizer.json"))
    (dir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    _write_json(
        dir / "tokenizer_config.json",
        {
            "tokenizer_class": "BertTokenizer",
            "do_lower_case": True,
            "model_max_length": max_position,
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "mask_token": "[MASK]",
        },
    )

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    _write_json(dir / "modules.json", modules)
    _write_json(
        dir / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": hidden,
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
        },
    )
    _write_json(dir / "sentence_bert_config.json", {"max_seq_length": max_position, "do_lower_case": False})
    return dir


def with_fixed_padding(src: Path, dst: Path) -> Path:
    """Copy `src`/tokenizer.json to the file `dst` with truncation to 8 and fixed padding to 8 baked
    in (as some exported tokenizers have), which a runtime must override."""
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    tj["padding"] = {
        "strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": None,
        "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]",
    }
    dst.write_text(json.dumps(tj))
    return dst


def with_activation_outlier(src: Path, dst: Path, factor: float = 1000.0) -> Path:
    """A copy of a tiny BERT whose attention output projections read one outlier channel: in every
    layer the value projection's channel 0 is `factor` times larger and the attention output
    weights reading it `factor` times smaller. In float32 the model computes the same; quantised
    per token, every other channel of that input collapses onto a few levels (the int8 gate must
    refuse it)."""
    from safetensors.torch import load_file

    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    layers = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        p = f"encoder.layer.{i}.attention"
        w[f"{p}.self.value.weight"][0] *= factor
        w[f"{p}.self.value.bias"][0] *= factor
        w[f"{p}.output.dense.weight"][:, 0] /= factor
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
