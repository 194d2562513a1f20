"""What an embed record may ask for beyond one text (openai-batch embeddings lines, and the job's
`options.dimensions`): several inputs (strings or token arrays) answered together, and fewer
dimensions than the bundle's.

A record's inputs are staged together (`items`, one token list per input; its length measure is
their sum) and run as separate sequences, so a line's vectors come back in input order or, if any
input fails, the line is one error row: never a partial answer.

`dimensions` is honoured only by a bundle whose bundle.json declares `matryoshka_dims` (the sizes
the model was trained to be cut to, set with `bundle import --matryoshka-dims`): the vector is cut
to its first `dimensions` values, then re-normalised to unit length, as sentence-transformers'
`truncate_dim` with normalisation and OpenAI's text-embedding-3 models give it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from batchinf.errors import BatchinfError, BundleError

# Staged beside STAGE_SCHEMA's columns by task embed: a list input's token lists (input_ids is
# null then), the record's dimensions (null: the job's size) and its response encoding.
EMBED_STAGE_FIELDS = [("items", pa.list_(pa.list_(pa.int32()))), ("dimensions", pa.int32()),
                      ("encoding_format", pa.string())]
# Result columns beside `embedding`: a record with several inputs, or with dimensions other than
# the job's size, has `embedding` null and its vectors here, in input order.
EMBED_RESULT_FIELDS = [("embeddings", pa.list_(pa.list_(pa.float32()))), ("encoding_format", pa.string())]


def embedding_size(meta: dict[str, Any]) -> int:
    """The bundle's own vector size (its fixtures' embeddings)."""
    return len(meta["fixtures"][0]["embedding"])


def check_matryoshka_dims(dims: list[int], meta: dict[str, Any]) -> list[int]:
    """Validated `matryoshka_dims` for an embed bundle's bundle.json: distinct sizes below the
    bundle's own, largest first; BundleError saying what is wrong otherwise."""
    if meta.get("task") != "embed":
        raise BundleError(f"--matryoshka-dims is for embedding models; this is a {meta.get('task')} model")
    full = embedding_size(meta)
    bad = [d for d in dims if not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= full]
    if bad or not dims:
        raise BundleError(f"matryoshka dims {dims!r} must be sizes between 1 and the model's {full} dimensions")
    return sorted({d for d in dims if d != full}, reverse=True)


def dimensions_problem(d: int, meta: dict[str, Any], bundle: str) -> str | None:
    """Why bundle `bundle` cannot give `d`-dimensional vectors, naming the fix; None if it can."""
    full = embedding_size(meta)
    if d == full:
        return None
    declared = meta.get("matryoshka_dims")
    if not isinstance(declared, list) or not declared:
        return (f"dimensions {d}: bundle {bundle} does not declare Matryoshka support, so its {full}-dimensional "
                "vectors cannot be shortened; remove dimensions, or import a Matryoshka-trained model with "
                f"`batchinf bundle import DIR --name NAME --matryoshka-dims {full // 2},{full // 4}`")
    if d not in declared or d > full:
        return (f"dimensions {d} is not a size bundle {bundle} declares; use {full} or one of "
                f"{', '.join(str(x) for x in declared)}")
    return None


def shorten(vectors: np.ndarray, d: int) -> np.ndarray:
    """Matryoshka truncation: the first d values of each row, re-normalised to unit length."""
    # vectors: [N, D] -> [N, d]
    cut = np.ascontiguousarray(vectors[:, :d], dtype=np.float32)
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return cut / np.maximum(norms, 1e-12)


def token_array_problem(ids: tuple[int, ...], vocab: int) -> str | None:
    """A token array with an id outside the bundle's vocabulary: what is wrong and the fix."""
    bad = next((t for t in ids if t >= vocab), None)
    if bad is None:
        return None
    return (f"holds token id {bad}, outside this bundle's vocabulary of {vocab} ids; send ids from the bundle's "
            "own tokenizer, or send the text")


def prompt_for(meta: dict[str, Any], prompt_name: str | None, prompt: str | None) -> str:
    """The text prepended to every record: `prompt` verbatim, else the bundle's prompt named
    `prompt_name`, else its default prompt, else none."""
    prompts = meta.get("prompts") or {}
    if prompt is not None:
        return prompt
    name = prompt_name if prompt_name is not None else meta.get("default_prompt_name")
    if name is None:
        return ""
    if name not in prompts:
        raise BatchinfError(f"options.prompt_name {name!r} is not a prompt of this bundle; its prompts: "
                            f"{', '.join(prompts) or 'none'} (or give options.prompt verbatim)")
    return prompts[name]
