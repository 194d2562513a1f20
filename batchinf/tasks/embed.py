"""Task embed: one vector per text record, from a BERT-family encoder with sentence-transformers
pooling. Staged: token ids (length measure: tokens); run: token-budget batches over the row
group, sorted by length."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Iterator

import numpy as np
import pyarrow as pa
from pydantic import Field

from batchinf.errors import BatchinfError
from batchinf.manifest_rules import BOOLEAN, POSITIVE, Part, choice, nullable
from batchinf.tasks.base import RECORD_FIELDS, STAGE_SCHEMA, RunOutput, Task, ok_rows, record_columns
from batchinf.tasks.batching import EmbedOutcome, embed_isolating, token_budget_batches

DEVICES = ("auto", "cpu", "cuda")
TOKENIZE_CHUNK = 4096


class EmbedOptions(Part):
    """Options of task embed."""
    max_length: Annotated[int | None, nullable(POSITIVE)] = Field(
        None, description="tokens kept per record; default and ceiling: the bundle's max length")
    max_batch_tokens: Annotated[int, POSITIVE] = Field(
        2048, description="padded tokens per forward batch (the CPU sweet spot)")
    truncate: Annotated[bool, BOOLEAN] = Field(
        True, description="false: over-long records become error rows (too_long) instead of being truncated")
    device: Annotated[str, choice(DEVICES)] = "auto"
    prompt_name: str | None = Field(
        None, description="a prompt of the bundle's config_sentence_transformers.json (e.g. query) prepended "
                          "to every text; default: the bundle's default_prompt_name, if any")
    prompt: str | None = Field(None, max_length=4096,
                               description="text prepended to every record verbatim (overrides prompt_name)")


def embedding_schema(dim: int) -> pa.Schema:
    return pa.schema(RECORD_FIELDS + [
        ("embedding", pa.list_(pa.float32(), dim)),
        ("input_tokens", pa.int32()), ("output_tokens", pa.int32()), ("truncated", pa.bool_()),
    ])


def tokenizer_for(runtime: Any, max_length: int) -> Any:
    """The bundle's tokenizer, truncating at `max_length` (the job's, at most the bundle's)."""
    tok = runtime.tokenizer
    if max_length != tok.max_length:
        from batchinf.runtime.tokenizer import TextTokenizer

        tok = TextTokenizer.from_file(runtime.root / "tokenizer.json", max_length)
    return tok


def stage_texts(obj: Any, tok: Any, records: Iterator[Any], what: str = "embed", prefix: str = "") -> pa.Table:
    """Tokenize text records (each after `prefix`, an embedding prompt) in chunks; an over-long
    text is truncated and counted, or with truncate: false becomes a too_long error row."""
    cols: dict[str, list[Any]] = {name: [] for name in STAGE_SCHEMA.names}

    def flush(batch: list) -> None:
        valid = [r for r in batch if r.error is None]
        encoded = iter(tok.encode_batch([prefix + r.text for r in valid]))
        for r in batch:
            e = next(encoded) if r.error is None else None
            error, message = r.error, r.message
            if e is not None and e.truncated and not obj.truncate:
                error, message = "too_long", (f"{obj.pin.uri} record {r.record_id!r} is longer than "
                                              f"max_length {obj.max_length} tokens; set "
                                              "options.truncate: true to truncate it")
            ok = error is None
            cols["ordinal"].append(r.ordinal)
            cols["record_id"].append(r.record_id)
            cols["error"].append(error)
            cols["message"].append(message)
            cols["n_tokens"].append(len(e.ids) if ok else 0)
            cols["truncated"].append(bool(e.truncated) if ok else False)
            cols["input_ids"].append(e.ids if ok else None)

    batch: list = []
    for rec in records:
        batch.append(rec)
        if len(batch) >= TOKENIZE_CHUNK:
            flush(batch)
            batch = []
    flush(batch)
    return pa.table(cols, schema=STAGE_SCHEMA)


def run_sequences(c: dict[str, list[Any]], forward: Callable[[list[list[int]]], tuple[np.ndarray, int]],
                  max_batch_tokens: int) -> tuple[list[int], np.ndarray, EmbedOutcome]:
    """Forward the staged token sequences of one row group in token-budget batches, sorted by
    length (staged order is by length already); (positions done, outputs stacked, outcome)."""
    valid = ok_rows(c)
    out = EmbedOutcome()
    for batch in token_budget_batches([c["n_tokens"][i] for i in valid], max_batch_tokens):
        embed_isolating(forward, c["input_ids"], [valid[j] for j in batch], c["record_id"], out)
    ok = [i for i in valid if i in out.vectors]
    return ok, (np.stack([out.vectors[i] for i in ok]) if ok else np.zeros((0, 0), np.float32)), out


class Embed(Task):
    name = "embed"
    options = EmbedOptions
    fields = ("text_field",)

    def input_problem(self, inp: Any) -> str | None:
        if inp.prompt_field or inp.messages_field:
            return (f"input.prompt_field and input.messages_field are for task: generate; "
                    f"a {self.name} job reads input.text_field")
        return super().input_problem(inp)

    def read_as(self, inp: Any) -> tuple[str, str]:
        return inp.text_field, "text"

    def stage(self, obj: Any, runtime: Any, records: Iterator[Any]) -> pa.Table:
        from batchinf.errors import ManifestError
        from batchinf.runtime.st_modules import prompt_for

        try:
            prefix = prompt_for(runtime.meta, obj.options.prompt_name, obj.options.prompt)
        except BatchinfError as e:
            raise ManifestError(str(e)) from None
        return stage_texts(obj, tokenizer_for(runtime, obj.max_length), records, prefix=prefix)

    def result_schema(self, meta: dict[str, Any]) -> pa.Schema:
        return embedding_schema(len(meta["fixtures"][0]["embedding"]))

    def run(self, c: dict[str, list[Any]], runtime: Any, options: Any, check: Callable[[], None]) -> RunOutput:
        schema = self.result_schema(runtime.meta)
        dim = schema.field("embedding").type.list_size
        ok, vectors, out = run_sequences(c, runtime.embed, options.max_batch_tokens)
        flat = vectors.reshape(-1) if ok else np.zeros(0, np.float32)
        n = sum(c["n_tokens"][i] for i in ok)
        table = pa.table({
            **record_columns(c, ok),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), dim),
            "input_tokens": [c["n_tokens"][i] for i in ok], "output_tokens": [0] * len(ok),
            "truncated": [c["truncated"][i] for i in ok],
        }, schema=schema)
        return RunOutput(table, out.failures, {"input": n, "output": 0, "real": n, "padded": out.padded})

    def detects(self, config: dict[str, Any], src: Path) -> bool:
        from batchinf.runtime.families import ENCODER_TYPES, is_decoder_embedding

        archs = config.get("architectures") or []
        return is_decoder_embedding(config, src) or (
            config.get("model_type") in ENCODER_TYPES and not any(a.endswith("ForSequenceClassification")
                                                                  for a in archs))

    def build_meta(self, src: Path, files: list[str], *, max_length: int | None, dtype: str) -> dict[str, Any]:
        from batchinf.runtime import bundle as rb

        return rb.build_embed_meta(src, files, max_length=max_length, dtype=dtype)

    def open_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        from batchinf.runtime import bundle as rb

        return rb.EmbedRuntime(root, meta, device=device)

    def verify_model(self, runtime: Any) -> None:
        from batchinf.runtime import bundle as rb

        rb.verify_model_fixtures(runtime)
