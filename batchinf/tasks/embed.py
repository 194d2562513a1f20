"""Task embed: one vector per text record, from a BERT-family encoder with sentence-transformers
pooling. Staged: token ids (length measure: tokens); run: token-budget batches over the row
group, sorted by length."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Iterator

import numpy as np
import pyarrow as pa
from pydantic import Field

from batchinf.errors import BatchinfError, ManifestError
from batchinf.manifest_rules import (BOOLEAN, LIMITED, MAX_DIMENSIONS, MAX_LENGTH, Section, choice, nullable,
                                     positive)
from batchinf.tasks.base import (RECORD_FIELDS, STAGE_SCHEMA, RunOutput, StagedRows, Task, chunks, ok_rows,
                                 record_columns, staged_row)
from batchinf.tasks.batching import EmbedOutcome, embed_isolating, run_units, token_budget_batches
from batchinf.tasks.embed_request import (
    EMBED_RESULT_FIELDS,
    EMBED_STAGE_FIELDS,
    dimensions_problem,
    embedding_size,
    prompt_for,
    shorten,
    token_array_problem,
)

DEVICES = ("auto", "cpu", "cuda")


class EmbedOptions(Section):
    """Options of task embed."""
    max_length: Annotated[int | None, nullable(positive(MAX_LENGTH))] = Field(
        None, description="tokens kept per record; default and ceiling: the bundle's max length")
    max_batch_tokens: Annotated[int, LIMITED] = Field(
        2048, description="padded tokens per forward batch (the CPU sweet spot)")
    truncate: Annotated[bool, BOOLEAN] = Field(
        True, description="false: over-long records become error rows (too_long) instead of being truncated")
    device: Annotated[str, choice(DEVICES)] = "auto"
    dimensions: Annotated[int | None, nullable(positive(MAX_DIMENSIONS))] = Field(
        None, description=("vector size, for bundles that declare Matryoshka support (matryoshka_dims): "
                           "truncate, then re-normalise"))
    prompt_name: str | None = Field(
        None, description="a prompt of the bundle's config_sentence_transformers.json (e.g. query) prepended "
                          "to every text; default: the bundle's default_prompt_name, if any")
    prompt: str | None = Field(None, max_length=4096,
                               description="text prepended to every record verbatim (overrides prompt_name)")


def embedding_schema(dim: int) -> pa.Schema:
    return pa.schema(RECORD_FIELDS + [
        ("embedding", pa.list_(pa.float32(), dim)),
        ("input_tokens", pa.int32()), ("output_tokens", pa.int32()), ("truncated", pa.bool_()),
    ] + EMBED_RESULT_FIELDS)


EMBED_STAGE_SCHEMA = pa.schema(list(STAGE_SCHEMA) + [pa.field(n, t) for n, t in EMBED_STAGE_FIELDS])


def tokenizer_for(runtime: Any, max_length: int) -> Any:
    """The bundle's tokenizer, truncating at `max_length` (the job's, at most the bundle's)."""
    tok = runtime.tokenizer
    if max_length != tok.max_length:
        from batchinf.runtime.tokenizer import TextTokenizer

        tok = TextTokenizer.from_file(runtime.root / "tokenizer.json", max_length)
    return tok


def stage_texts(obj: Any, tok: Any, records: Iterator[Any], what: str = "embed",
                meta: dict[str, Any] | None = None, prefix: str = "") -> pa.Table:
    """Tokenize text records in chunks; an over-long text is truncated and counted, or with
    truncate: false becomes a too_long error row; every text follows `prefix` (an embedding
    prompt). With the bundle's `meta` (task embed) records
    may also carry several inputs, token arrays, dimensions and an encoding (embed_request)."""
    schema = STAGE_SCHEMA if meta is None else EMBED_STAGE_SCHEMA
    staged = StagedRows(schema)
    for batch in chunks(records):
        texts = [prefix + x for r in batch if r.error is None for x in (r.items or (r.text,)) if isinstance(x, str)]
        encoded = iter(tok.encode_batch(texts) if texts else ())
        cols: dict[str, list[Any]] = {name: [] for name in schema.names}
        for r in batch:
            row = {**staged_row(r), "input_ids": None}
            if r.error is None:
                inputs = [next(encoded) if isinstance(x, str) else x for x in (r.items or (r.text,))]
                row.update(_staged_inputs(obj, tok, meta, r, inputs))
            for name in schema.names:
                cols[name].append(row.get(name))
        staged.add_columns(cols)
    return staged.table()


def _staged_inputs(obj: Any, tok: Any, meta: dict[str, Any] | None, r: Any, inputs: list[Any]) -> dict[str, Any]:
    """A valid record's staged columns from its encoded texts and raw token arrays, or the error
    (too_long, invalid_input, unsupported_dimensions) that makes it an error row."""
    who = f"{obj.pin.uri} " + (f"(custom_id {r.record_id!r})" if r.endpoint else f"record {r.record_id!r}")
    where = who + (" body.input" if r.endpoint else "")
    seqs: list[list[int]] = []
    truncated = False
    for k, x in enumerate(inputs):
        if isinstance(x, tuple):      # a token array: the ids the model reads, as given
            if (bad := token_array_problem(x, tok.vocab_size())):
                return {"error": "invalid_input", "message": f"{where}[{k}] {bad}"}
            ids, cut = list(x[:obj.max_length]), len(x) > obj.max_length
        else:
            ids, cut = x.ids, x.truncated
        if cut and not obj.truncate:
            return {"error": "too_long", "message": (f"{where}{f'[{k}]' if r.items else ''} is longer than "
                                                     f"max_length {obj.max_length} tokens; set options.truncate: "
                                                     "true to truncate it")}
        seqs.append(ids)
        truncated = truncated or cut
    row: dict[str, Any] = {"n_tokens": sum(len(s) for s in seqs), "truncated": truncated}
    if r.items is None:
        row["input_ids"] = seqs[0]
    else:
        row["items"] = seqs
    params = r.params or {}
    d = params.get("dimensions") or getattr(obj.options, "dimensions", None)
    if meta is not None and d is not None:
        if (problem := dimensions_problem(d, meta, obj.digest[:19] + "…")):
            return {"error": "unsupported_dimensions", "message": f"{who}: {problem}"}
        row["dimensions"] = d
    row["encoding_format"] = params.get("encoding_format")
    return row


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


def _fixed(vectors: list[np.ndarray | None], size: int) -> pa.Array:
    """The `embedding` column: a flat copy when every row has one (the common case), else per row."""
    if all(v is not None for v in vectors):
        flat = np.stack(vectors).reshape(-1) if vectors else np.zeros(0, np.float32)
        return pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), size)
    return pa.array([None if v is None else v.tolist() for v in vectors], pa.list_(pa.float32(), size))


class Embed(Task):
    name = "embed"
    onnx_output = "embedding"
    options = EmbedOptions
    stage_schema = EMBED_STAGE_SCHEMA
    fields = ("text_field",)

    def input_problem(self, inp: Any) -> str | None:
        if inp.prompt_field or inp.messages_field:
            return (f"input.prompt_field and input.messages_field are for task: generate; "
                    f"a {self.name} job reads input.text_field")
        return super().input_problem(inp)

    def read_as(self, inp: Any) -> tuple[str, str]:
        return inp.text_field, "text"

    def limits(self, runtime: Any, options: Any) -> tuple[int, bool]:
        d = getattr(options, "dimensions", None)
        if d is not None and (problem := dimensions_problem(d, runtime.meta, "of this job")):
            raise ManifestError(f"options.{problem}")
        return super().limits(runtime, options)

    def stage(self, obj: Any, runtime: Any, records: Iterator[Any]) -> pa.Table:
        try:
            prefix = prompt_for(runtime.meta, obj.options.prompt_name, obj.options.prompt)
        except BatchinfError as e:
            raise ManifestError(str(e)) from None
        return stage_texts(obj, tokenizer_for(runtime, obj.max_length), records, meta=runtime.meta, prefix=prefix)

    def result_schema(self, meta: dict[str, Any], options: Any = None) -> pa.Schema:
        return embedding_schema(getattr(options, "dimensions", None) or embedding_size(meta))

    def run(self, c: dict[str, list[Any]], runtime: Any, options: Any, check: Callable[[], None],
            split: Callable[[], bool] | None = None, files: Any = None) -> RunOutput:
        """Every input of every valid record is one sequence; a record's vectors are assembled in
        input order, shortened to its dimensions, and a record with a failed input fails whole."""
        schema = self.result_schema(runtime.meta, options)
        size = schema.field("embedding").type.list_size
        valid = ok_rows(c)
        items = c.get("items") or [None] * len(c["error"])
        owner, seqs = [], []
        for i in valid:
            for s in (items[i] if items[i] is not None else [c["input_ids"][i]]):
                owner.append(i)
                seqs.append(s)
        out = run_units(lambda units: runtime.embed([seqs[u] for u in units]), [len(s) for s in seqs],
                        list(range(len(seqs))), [c["record_id"][i] for i in owner], options.max_batch_tokens)
        failures: dict[int, str] = {}
        for u, msg in sorted(out.failures.items()):
            failures.setdefault(owner[u], msg)
        units: dict[int, list[int]] = {}
        for u, i in enumerate(owner):
            units.setdefault(i, []).append(u)
        dims = c.get("dimensions") or [None] * len(c["error"])
        ok = [i for i in valid if i not in failures]
        single: list[Any] = []
        several: list[Any] = []
        for i in ok:
            vecs = np.stack([out.vectors[u] for u in units[i]])
            if dims[i] is not None and dims[i] != vecs.shape[1]:
                vecs = shorten(vecs, dims[i])
            one = items[i] is None and vecs.shape[1] == size
            single.append(vecs[0] if one else None)
            several.append(None if one else vecs.tolist())
        n = sum(c["n_tokens"][i] for i in ok)
        table = pa.table({
            **record_columns(c, ok), "embedding": _fixed(single, size),
            "input_tokens": [c["n_tokens"][i] for i in ok], "output_tokens": [0] * len(ok),
            "truncated": [c["truncated"][i] for i in ok], "embeddings": pa.array(several, schema.field("embeddings").type),
            "encoding_format": [(c.get("encoding_format") or [None] * len(c["error"]))[i] for i in ok],
        }, schema=schema)
        return RunOutput(table, failures, {"input": n, "output": 0, "real": n, "padded": out.padded})

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
        from batchinf.runtime.embed import EmbedRuntime

        return EmbedRuntime(root, meta, device=device)

    def vllm_problem(self, meta: dict[str, Any]) -> str | None:
        from batchinf.engines.vllm_pooling import embed_problem

        return embed_problem(meta)

    def vllm_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        from batchinf.engines.vllm_pooling import VllmEmbedRuntime

        return VllmEmbedRuntime(root, meta, device=device)

    def onnx_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        from batchinf.runtime.onnx_encoder import OrtEmbedRuntime

        return OrtEmbedRuntime(root, meta, device=device)

    def verify_model(self, runtime: Any) -> None:
        from batchinf.runtime import bundle as rb

        rb.verify_model_fixtures(runtime)
