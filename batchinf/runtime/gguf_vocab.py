"""The tokenizer of a GGUF file as a `tokenizers` Tokenizer (tokenizer.json): byte-level BPE
(`tokenizer.ggml.model` gpt2, split as `tokenizer.ggml.pre` names) and SentencePiece BPE (`llama`:
byte fallback, merges recovered from the scores as transformers' GGUF loader does)."""

from __future__ import annotations

from typing import Any

from batchinf.errors import BundleError

TOKENIZER_MODELS = ("gpt2", "llama")    # tokenizer.ggml.model values: byte-level BPE, SentencePiece BPE
MAX_MERGE_WORK = 50_000_000             # character splits examined when deriving SentencePiece merges

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str) -> Any:
    """The pre-tokenizer that `tokenizer.ggml.pre` names (as llama.cpp's llama-vocab.cpp splits)."""
    from tokenizers import Regex, pre_tokenizers

    def split(regex: str) -> Any:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    if pre in ("gpt-2", "gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):    # each digit alone, then GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"):
        return split(_LLAMA3_SPLIT)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return split(_QWEN2_SPLIT)
    raise BundleError(f"tokenizer.ggml.pre {pre!r} is not supported yet (supported: gpt2, smollm, starcoder, "
                      "llama-bpe/llama3, qwen2)")


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """tokenizer.json from the GGUF vocabulary: byte-level BPE (gpt2) or SentencePiece BPE (llama)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise BundleError(f"tokenizer.ggml.model {kind!r} is not supported yet; batchinf builds "
                          f"{', '.join(TOKENIZER_MODELS)} tokenizers from GGUF files")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    if kind == "gpt2":
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=False))
        tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
        tok.decoder = decoders.ByteLevel()
    else:       # SentencePiece BPE, as transformers' LlamaTokenizer (legacy=False) builds it
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                   unk_token=tokens[unk] if unk is not None else None))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    # 3 = control (<|im_start|>), 4 = user-defined: both match whole in text, as in llama.cpp.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                           special_tokens=[(tokens[bos], bos)])
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """A SentencePiece vocabulary's BPE merges: every split of a token into two tokens, best score
    first (transformers' generate_merges, which its GGUF loader uses). The work is the sum of the
    squared token lengths, bounded so that a crafted vocabulary of huge tokens is refused."""
    if len(scores) != len(tokens):
        raise BundleError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    work = sum(len(t) ** 2 for t in tokens)
    if work > MAX_MERGE_WORK:
        raise BundleError(f"the GGUF vocabulary's tokens are too long to derive merges from ({work} character "
                          f"splits, limit {MAX_MERGE_WORK}); this is not a SentencePiece vocabulary")
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:], float(score)) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


