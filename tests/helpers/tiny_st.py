"""Tiny sentence-transformers model directories: BERT with a full pipeline (Pooling in any mode,
Dense, Normalize, prompts), XLM-RoBERTa, and a Qwen3 decoder saved as a bare model with
last-token pooling (Qwen3-Embedding's layout). Each loads in sentence-transformers and batchinf."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from tests.helpers.tiny_decoders import make_tiny_decoder
from tests.helpers.tiny_models import COMMON_WORDS, make_tiny_bert

PROMPTS = {"query": "query: ", "passage": "passage: "}
ST_TYPES = {"Transformer": "sentence_transformers.models.Transformer",
            "Pooling": "sentence_transformers.models.Pooling", "Dense": "sentence_transformers.models.Dense",
            "Normalize": "sentence_transformers.models.Normalize"}


def _write(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2))


def write_pipeline(d: Path, dim: int, modes: list[str], *, dense_out: int | None = None, normalize: bool = True,
                   prompts: dict[str, str] | None = None, seed: int = 0) -> Path:
    """modules.json (Transformer, Pooling[, Dense][, Normalize]) and the modules' files, plus
    config_sentence_transformers.json with `prompts`."""
    modules = [("Transformer", ""), ("Pooling", "1_Pooling")]
    _write(d / "1_Pooling" / "config.json", {"word_embedding_dimension": dim,
                                             "pooling_mode": modes[0] if len(modes) == 1 else modes})
    if dense_out:
        g = torch.Generator().manual_seed(seed)
        d_in = dim * len(modes)
        _write(d / "2_Dense" / "config.json", {"in_features": d_in, "out_features": dense_out, "bias": True,
                                               "activation_function": "torch.nn.modules.activation.Tanh"})
        save_file({"linear.weight": torch.randn(dense_out, d_in, generator=g) * 0.3,
                   "linear.bias": torch.randn(dense_out, generator=g) * 0.1}, str(d / "2_Dense" / "model.safetensors"))
        modules.append(("Dense", "2_Dense"))
    if normalize:
        modules.append(("Normalize", "3_Normalize"))
        (d / "3_Normalize").mkdir(exist_ok=True)
    _write(d / "modules.json", [{"idx": i, "name": str(i), "path": p, "type": ST_TYPES[k]}
                                for i, (k, p) in enumerate(modules)])
    if prompts:
        _write(d / "config_sentence_transformers.json", {"prompts": prompts, "default_prompt_name": None,
                                                         "similarity_fn_name": "cosine"})
    return d


def make_st_bert(d: Path, modes: list[str], **kw) -> Path:
    make_tiny_bert(d, hidden=32, max_position=128)
    return write_pipeline(d, 32, modes, **kw)


def make_st_xlmr(d: Path, seed: int = 0) -> Path:
    """A tiny XLM-RoBERTa (pad id 1, so positions start at 2) with mean pooling, saved by transformers."""
    import transformers

    d.mkdir(parents=True, exist_ok=True)
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    vocab = specials + list(dict.fromkeys(COMMON_WORDS + list("abcdefghijklmnopqrstuvwxyz0123456789")))
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(True)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.save(str(d / "tokenizer.json"))
    _write(d / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                                         "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
                                         "cls_token": "<s>", "sep_token": "</s>", "model_max_length": 62})
    cfg = transformers.XLMRobertaConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                        pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1)
    torch.manual_seed(seed)
    transformers.XLMRobertaModel(cfg, add_pooling_layer=False).save_pretrained(d, safe_serialization=True)
    _write(d / "sentence_bert_config.json", {"max_seq_length": 62, "do_lower_case": False})
    return write_pipeline(d, 32, ["mean"], prompts=PROMPTS)


def make_st_qwen3(d: Path, pooling: str = "lasttoken") -> Path:
    """A tiny Qwen3 saved as a bare Qwen3Model (keys without `model.`, no lm_head), pooled by its
    last token, normalised, with an instruction prompt: Qwen3-Embedding's layout."""
    import transformers

    make_tiny_decoder(d, "qwen3")
    bare = transformers.AutoModel.from_pretrained(d, dtype=torch.float32)
    for f in d.glob("*.safetensors"):
        f.unlink()
    bare.save_pretrained(d, safe_serialization=True)
    _write(d / "sentence_bert_config.json", {"max_seq_length": 200, "do_lower_case": False})
    return write_pipeline(d, 64, [pooling], prompts={"query": "Instruct: find the answer\nQuery: "})


def _bert_tokenized(d: Path) -> list[str]:
    """The tiny BERT's tokenizer files in `d` (its model files removed); its vocabulary."""
    make_tiny_bert(d, hidden=32, max_position=128)
    for f in ("model.safetensors", "config.json"):
        (d / f).unlink()
    return (d / "vocab.txt").read_text().split("\n")[:-1]


def make_st_modernbert(d: Path, seed: int = 0) -> Path:
    """A tiny ModernBERT (native), saved by transformers as ModernBertForMaskedLM (keys under
    `model.` plus an MLM head), with a local window far shorter than the texts, mean pooling,
    Normalize and prompts."""
    import transformers

    vocab = _bert_tokenized(d)
    cfg = transformers.ModernBertConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=128, local_attention=8, global_attn_every_n_layers=3, norm_bias=True,
        pad_token_id=vocab.index("[PAD]"), cls_token_id=vocab.index("[CLS]"), sep_token_id=vocab.index("[SEP]"),
        bos_token_id=vocab.index("[CLS]"), eos_token_id=vocab.index("[SEP]"))
    torch.manual_seed(seed)
    model = transformers.ModernBertForMaskedLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:      # LayerNorms start at ones/zeros: make a wrong norm show
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    model.save_pretrained(d, safe_serialization=True)
    return write_pipeline(d, 32, ["mean"], prompts=PROMPTS)


def make_st_distilbert(d: Path, seed: int = 0) -> Path:
    """A tiny DistilBERT: no native implementation, so it runs through the transformers fallback."""
    import transformers

    vocab = _bert_tokenized(d)
    cfg = transformers.DistilBertConfig(vocab_size=len(vocab), dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                        max_position_embeddings=128, pad_token_id=vocab.index("[PAD]"))
    torch.manual_seed(seed)
    transformers.DistilBertModel(cfg).save_pretrained(d, safe_serialization=True)
    return write_pipeline(d, 32, ["mean"], prompts=PROMPTS)
