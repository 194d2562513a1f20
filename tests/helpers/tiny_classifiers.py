"""Tiny random-weight sequence classifiers written by transformers itself (save_pretrained,
safetensors): BERT and XLM-RoBERTa cross-encoders (sentence-transformers CrossEncoder format),
a BERT classifier and a multi-label one. Imports transformers: not for tests/unit."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from tests.helpers.tiny_models import _build_tokenizer, _vocab

XLMR_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
SIGMOID = "torch.nn.modules.activation.Sigmoid"


def _xlmr_tokenizer(words: list[str]) -> Tokenizer:
    vocab = XLMR_SPECIALS + [w for w in _vocab(None)[5:] if w not in XLMR_SPECIALS]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(XLMR_SPECIALS)
    return tok


def make_tiny_classifier(dir: Path, *, family: str = "bert", num_labels: int = 1, multi_label: bool = False,
                         cross_encoder: bool = False, seed: int = 0, max_position: int = 128, hidden: int = 32,
                         heads: int = 4) -> Path:
    """Write a tiny sequence classifier into `dir` (config.json, model.safetensors, tokenizer);
    `hidden` / `heads` is the head size (vLLM's CPU attention takes 32, 64, ...)."""
    from transformers import (BertConfig, BertForSequenceClassification, XLMRobertaConfig,
                              XLMRobertaForSequenceClassification)

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    labels = {i: f"label_{chr(97 + i)}" for i in range(num_labels)}
    common = dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads, intermediate_size=2 * hidden,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.3,
                  num_labels=num_labels, id2label=labels, label2id={v: k for k, v in labels.items()})
    if multi_label:
        common["problem_type"] = "multi_label_classification"
    torch.manual_seed(seed)
    if family == "bert":
        tok = _build_tokenizer(_vocab(None))
        cfg = BertConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=max_position, **common)
        model = BertForSequenceClassification(cfg)
        specials = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                    "mask_token": "[MASK]"}
    else:
        tok = _xlmr_tokenizer([])
        cfg = XLMRobertaConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=max_position + 2,
                               type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2, **common)
        model = XLMRobertaForSequenceClassification(cfg)
        specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
                    "cls_token": "<s>", "sep_token": "</s>"}
    with torch.no_grad():   # biases away from zero, so the heads give varied logits
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    if cross_encoder:
        model.config.sentence_transformers = {"activation_fn": SIGMOID, "version": "6.2.0"}
    model.eval().save_pretrained(dir, safe_serialization=True)
    tok.save(str(dir / "tokenizer.json"))
    cls = "BertTokenizerFast" if family == "bert" else "PreTrainedTokenizerFast"   # BERT: token type ids
    (dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": cls, "model_max_length": max_position, **specials}))
    return dir
