"""Text -> token ids with a `tokenizer.json`, truncated at a caller-chosen max_length."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from batchinf.errors import BatchinfError, BundleError


@dataclass(frozen=True)
class Encoded:
    ids: list[int]  # token ids incl. special tokens, truncated to max_length
    truncated: bool  # True when the text was longer than max_length tokens


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, max_length: int, pad_id: int) -> None:
        if max_length < 1:
            raise BatchinfError(f"tokenizer max_length must be >= 1, got {max_length}")
        self._tok = tokenizer
        self.max_length = max_length
        self.pad_id = pad_id

    @classmethod
    def from_file(cls, path: Path | str, max_length: int) -> "TextTokenizer":
        path = Path(path)
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise BundleError(f"cannot read tokenizer {path}: {e}") from e
        pad_id = _pad_id(tok)
        # tokenizer.json may carry its own padding/truncation (all-MiniLM pads+truncates
        # at 128); we pad per batch ourselves, and max_length must be the only limit.
        tok.no_padding()
        tok.no_truncation()
        # Same call transformers makes for truncation=True: the limit counts the
        # special tokens the post-processor adds.
        tok.enable_truncation(max_length, stride=0, strategy="longest_first")
        return cls(tok, max_length, pad_id)

    def encode_batch(self, texts: list[str]) -> list[Encoded]:
        encodings = self._tok.encode_batch(texts)  # parallel in Rust
        return [Encoded(ids=e.ids, truncated=len(e.overflowing) > 0) for e in encodings]

    def vocab_size(self) -> int:
        """Ids this tokenizer knows (added tokens included): a token array must stay below it."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> Encoded:
        e = self._tok.encode(text)
        return Encoded(ids=e.ids, truncated=len(e.overflowing) > 0)


def _pad_id(tok: Tokenizer) -> int:
    padding = tok.padding
    if padding is not None and padding.get("pad_id") is not None:
        return int(padding["pad_id"])
    for token in ("[PAD]", "<pad>"):
        token_id = tok.token_to_id(token)
        if token_id is not None:
            return token_id
    return 0
