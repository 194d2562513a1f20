"""A loaded embedding model: the bundle's tokenizer and encoder (BERT-like, ModernBERT, a decoder
used as an encoder, or the transformers fallback), optional int8, and the bundle's Dense layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class EmbedRuntime:
    """A loaded encoder: tokenizer + model on one device."""
    root: Path
    meta: dict[str, Any]
    device: str = "cpu"
    dtype_override: str | None = None
    tokenizer: Any = field(init=False)
    model: Any = field(init=False, default=None)
    dense: list[Any] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        from batchinf.runtime.tokenizer import TextTokenizer

        self.tokenizer = TextTokenizer.from_file(self.root / "tokenizer.json", self.meta["max_length"])

    def load_model(self) -> None:
        import torch

        from batchinf.runtime.encoder import load_encoder
        from batchinf.runtime.st_modules import load_dense

        dtype = self.dtype_override or self.meta.get("dtype", "float32")
        if self.device == "cpu":
            dtype = "float32"   # CPUs here lack fast bf16/fp16 kernels
        if self.meta.get("encoder") == "decoder":
            from batchinf.runtime.decoder_embed import load_decoder_encoder

            self.model = load_decoder_encoder(self.root, device=self.device, dtype=getattr(torch, dtype))
        elif self.meta.get("family") == "modernbert":
            from batchinf.runtime.modernbert import load_modernbert

            self.model = load_modernbert(self.root, device=self.device, dtype=getattr(torch, dtype))
        elif self.meta.get("encoder") == "transformers":
            from batchinf.runtime.hf_fallback import load_transformers_encoder

            self.model = load_transformers_encoder(self.root, device=self.device, dtype=getattr(torch, dtype))
        else:
            self.model = load_encoder(self.root, device=self.device, dtype=getattr(torch, dtype))
        if self.meta.get("precision") == "int8":
            from batchinf.runtime import int8
            from batchinf.runtime.int8_linear import quantize_encoder

            int8.check_supported(self.meta, self.device)
            quantize_encoder(self.model, int8.scheme_of(self.meta))
        self.dense = load_dense(self.root, self.meta, self.device, getattr(torch, dtype))

    def encode_fixture(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def embed(self, batch: list[list[int]]) -> tuple[np.ndarray, int]:
        """batch of token-id lists -> (float32 [B, D], padded token positions computed)."""
        from batchinf.runtime.encoder import embed_batch

        if self.model is None:
            self.load_model()
        return embed_batch(self.model, batch, self.tokenizer.pad_id, self.meta["pooling"],
                           self.meta["normalize"], self.dense)
