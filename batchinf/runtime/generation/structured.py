"""Structured output and log-probabilities for generation.

`response_format` (OpenAI's shape: `{"type": "text" | "json_object"}` or `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`) is compiled to a grammar by llguidance and enforced
while decoding: before each token is picked, the tokens the grammar does not allow next are masked
to -inf, so greedy and sampled answers alike are valid JSON that matches the schema (unless
max_tokens cuts them: finish_reason "length"). JSON is written compact (no free whitespace), so a
model cannot spend its budget on blank lines. llguidance was chosen over xgrammar (which pulls
triton and transformers in at run time) and outlines-core: one small wheel, no dependencies, and a
mask costs tens of microseconds per row (docs/performance).

Log-probabilities are the model's own (log-softmax of the raw logits, before temperature and masks),
in OpenAI's `choices[].logprobs.content` shape.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

def grammar(rf_json: str) -> str:
    """llguidance's grammar for a staged response_format (ValueError when the schema is not valid JSON)."""
    from llguidance import LLMatcher

    rf = json.loads(rf_json)
    schema = {"type": "object"} if rf["type"] == "json_object" else rf["json_schema"]["schema"]
    return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def grammar_problem(rf_json: str) -> str | None:
    """Why llguidance cannot enforce this response_format (an unknown type, an unsupported keyword,
    a contradiction), or None."""
    from llguidance import LLMatcher

    try:
        err = LLMatcher.validate_grammar(grammar(rf_json))
    except (ValueError, TypeError) as e:
        return f"the schema cannot be compiled: {e}"
    return f"the schema cannot be enforced: {err.strip()[:500]}" if err else None


class Vocab:
    """The tokenizer as llguidance sees it (built once per runtime: about a second), with the
    grammars compiled so far."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos_ids: tuple[int, ...]) -> None:
        from llguidance import LLTokenizer

        self.n_vocab = n_vocab
        self.ll = LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=list(eos_ids) or None)
        self._grammars: dict[str, str] = {}

    def guide(self, rf_json: str, key: int) -> Guide:
        from llguidance import LLMatcher

        if rf_json not in self._grammars:
            self._grammars[rf_json] = grammar(rf_json)
        m = LLMatcher(self.ll, self._grammars[rf_json], log_level=0)
        if m.is_error():
            raise ValueError(f"request {key}: response_format cannot be enforced: {m.get_error()[:500]}")
        return Guide(m, self.n_vocab, key)

    def entry(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self.ll.decode_bytes([token])
        return {"token": raw.decode("utf-8", errors="backslashreplace"), "logprob": logprob, "bytes": list(raw)}

    def logprobs(self, row: torch.Tensor, token: int, top: int) -> dict[str, Any]:
        """OpenAI's logprobs entry for `token` picked from `row`, with the `top` most likely tokens."""
        lp = torch.log_softmax(row.float(), -1)
        out = self.entry(token, float(lp[token]))
        if top:
            vals, ids = torch.topk(lp, top)
            out["top_logprobs"] = [self.entry(int(i), float(v)) for v, i in zip(vals.tolist(), ids.tolist())]
        else:
            out["top_logprobs"] = []
        return out


def vocab_of(runtime: Any) -> Vocab:
    """A generate runtime's Vocab, built on its first structured or logprobs request."""
    if getattr(runtime, "_structured_vocab", None) is None:
        runtime._structured_vocab = Vocab(runtime.tokenizer.to_str(), int(runtime.model.lm_head.weight.shape[0]),
                                          runtime.eos_ids)
    return runtime._structured_vocab


class Guide:
    """One sequence's grammar state: masks its logits, follows its tokens."""

    def __init__(self, matcher: Any, n_vocab: int, key: int) -> None:
        self.m, self.n_vocab, self.key = matcher, n_vocab, key

    def masked(self, row: torch.Tensor) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        banned = bits[:row.shape[-1]] == 0
        if row.device.type == "cpu" and row.dtype == torch.float32:
            # numpy, single-threaded: torch spreads a 50k-element masked_fill over its intra-op
            # threads, which on a busy machine measured 47 ms where this takes 0.05 ms
            out = row.numpy().copy()
            out[banned] = -np.inf
            return torch.from_numpy(out)
        return row.masked_fill(torch.from_numpy(banned).to(row.device), float("-inf"))

    def consume(self, token: int) -> bool:
        """Follow `token`; True when the grammar is complete (nothing may follow)."""
        self.m.consume_token(token)
        if self.m.is_error():
            raise RuntimeError(f"request {self.key}: structured output failed: {self.m.get_error()[:500]}")
        return bool(self.m.is_stopped())
