"""The task strategy: what every task (embed, generate, score, classify, classify_image,
generate_image) does, so
plan, execute, verify and the bundle registry never branch on a task's name.

A task
- validates its manifest options (its `options` model) and input fields (`input_problem`),
- says which record field its reader reads and as what kind (`read_as`),
- stages one object's records at plan time (`stage`): tokenize, decode or preprocess, with its
  own length measure in the staged `n_tokens` column (what buckets and shards are cut by),
- runs a staged batch on a runtime (`run`) into rows of its result schema (`result_schema`),
- summarises its results for `_MANIFEST.json` (`summary_columns` + `summarize`),
- may stage one long record as several consecutive rows (`PIECE`: transcribe's long files), run
  them on any shards and workers, and assemble their outputs into the record's one row at
  publish (`piece_schema`, `RunOutput.pieces`, `assemble`),
- detects its models at bundle import (`detects`), builds their bundle.json with fixtures
  (`build_meta`), and opens and checks a runtime for them (`open_runtime`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Iterator

import pyarrow as pa

# Columns every staged table starts with; a task appends its own.
STAGE_FIELDS = [
    ("ordinal", pa.int64()), ("record_id", pa.string()), ("error", pa.string()),
    ("message", pa.string()), ("n_tokens", pa.int32()), ("truncated", pa.bool_()),
]
STAGE_SCHEMA = pa.schema(STAGE_FIELDS + [("input_ids", pa.list_(pa.int32()))])
RECORD_FIELDS = [("record_id", pa.string()), ("source", pa.string()), ("ordinal", pa.int64())]
# A staged column of a task that stages a long record as several rows ("pieces", each a share of
# its work, run on any shard): the piece's number, 0 for the first (or only) row of a record.
# Rows of a number above 0 continue a record: planning counts them as work (rows of shards),
# never as records; the record is its first row's (duplicate ids, error rows, counts).
PIECE = "piece"

# Input fields each task may read; a field of another task is refused by name.
INPUT_FIELDS = ("text_field", "prompt_field", "messages_field", "query_field", "document_field",
                "documents_field", "image_field", "audio_field")
INPUT_DEFAULTS: dict[str, Any] = {"text_field": "text"}
FIELD_TASKS = {"text_field": "embed / classify", "prompt_field": "generate", "messages_field": "generate",
               "query_field": "score", "document_field": "score", "documents_field": "score",
               "image_field": "classify_image", "audio_field": "transcribe"}


@dataclass
class RunOutput:
    """What running one staged batch gives: result rows (a table of the task's result schema),
    failures by staged position (exception text), token counts, and the positions it left
    undone because its shard is being split (`deferred`, ascending; a whole-shard task only), and
    the error code of failures that are not `inference_error` (`codes`: the record's own fault)."""
    table: pa.Table
    failures: dict[int, str] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=lambda: {"input": 0, "output": 0, "real": 0, "padded": 0})
    deferred: list[int] = field(default_factory=list)
    codes: dict[int, str] = field(default_factory=dict)     # error codes of failures other than inference_error
    pieces: pa.Table | None = None  # rows of the task's `piece_schema`: the outputs of staged rows that are pieces
                                    # of a record (neither result nor error rows: `Task.assemble` makes those)


@dataclass
class Assembled:
    """`Task.assemble`'s answer: one result row (of the result schema) or one error row per record
    whose pieces were all given; the records some of whose pieces are missing (`incomplete`:
    (source, ordinal) -> what is missing); and the piece rows it used."""
    results: pa.Table
    errors: list[dict[str, Any]]            # record_id, source, ordinal, error, message, attempts, and the
                                            # piece (its number) the error is charged to
    incomplete: dict[tuple[str, int], str]
    rows: int


class Task:
    """Base of every task strategy (see the module docstring). Subclasses set the class variables
    and override what differs."""
    name: ClassVar[str]
    options: ClassVar[type]                     # its pydantic options model
    fields: ClassVar[tuple[str, ...]] = ()      # the input.* fields it reads
    stage_schema: ClassVar[pa.Schema] = STAGE_SCHEMA
    streams: ClassVar[bool] = True              # execute runs row group by row group (else whole shard)
    # `batchinf run` on the CPU runs its shards on lanes of one process by default (lanes.local_layout)
    lanes_on_cpu: ClassVar[bool] = False
    summary_columns: ClassVar[tuple[str, ...]] = ()
    needs: ClassVar[tuple[str, ...]] = ("config.json", "tokenizer.json")   # files a bundle must have
    weights: ClassVar[str] = ".safetensors"     # how the bundle's weight files end
    uses_torch: ClassVar[bool] = True           # its native runtime computes with PyTorch
    min_shard_work: ClassVar[int | None] = None  # least work a planned shard holds (None: BATCHINF_MIN_SHARD_TOKENS)
    # what the status counts progress in besides records (ledger/status.PROGRESS_UNITS), if anything:
    # `planned_progress` at plan and commit, the runtime's `progress_done` while a shard runs
    progress_unit: ClassVar[str | None] = None
    stages_files: ClassVar[bool] = False        # `run` stages files besides its rows (`files`), published
                                                # from the rows' `output_files`
    piece_schema: ClassVar[pa.Schema | None] = None     # a task staging long records in pieces (`PIECE`):
                                                        # the rows of its `RunOutput.pieces`

    # --- manifest ---------------------------------------------------------------------------
    def input_problem(self, inp: Any) -> str | None:
        """What is wrong with the manifest's input section for this task, or None."""
        if inp.format == "audio":
            return f"input.format audio (audio files) is for task: transcribe; a job of task {self.name} reads records"
        for name in INPUT_FIELDS:
            if name not in self.fields and getattr(inp, name, None) not in (None, INPUT_DEFAULTS.get(name)):
                return (f"input.{name} is for task: {FIELD_TASKS[name]}; a job of task {self.name} reads "
                        f"{', '.join('input.' + f for f in self.fields)}")
        return None

    def read_as(self, inp: Any) -> tuple[str, str]:
        """(field name, kind) a jsonl/parquet reader reads each record by: kind text, prompt,
        messages, or record (the whole record, checked by the task at staging)."""
        return "", "record"

    def limits(self, runtime: Any, options: Any) -> tuple[int, bool]:
        """(max_length, truncate) for staging: tokens kept per record, and whether over-long
        records are truncated (else they become error rows)."""
        limit = int(runtime.meta["max_length"])
        return min(getattr(options, "max_length", None) or limit, limit), bool(getattr(options, "truncate", True))

    # --- plan -------------------------------------------------------------------------------
    def shard_floor(self, options: Any, records: int, work: int, workers: int | None) -> int | None:
        """The least work a planned shard of this job holds (`records` valid records, `work` in
        all, for `workers` workers); None: BATCHINF_MIN_SHARD_TOKENS. Default: the task's
        `min_shard_work`."""
        return self.min_shard_work

    def stage(self, obj: Any, runtime: Any, records: Iterator[Any]) -> pa.Table:
        """One input object's records -> its staged table (stage_schema). `obj` is the planning
        task (pin, max_length, truncate, options)."""
        raise NotImplementedError

    # --- execute ----------------------------------------------------------------------------
    def result_schema(self, meta: dict[str, Any], options: Any = None) -> pa.Schema:
        raise NotImplementedError

    def run(self, c: dict[str, list[Any]], runtime: Any, options: Any, check: Callable[[], None],
            split: Callable[[], bool] | None = None, files: Any = None) -> RunOutput:
        """Staged columns (`c`, with `source` as strings) of one batch -> RunOutput. Only rows
        whose `error` is None are computed; positions index `c`. `split` says whether the shard
        is to be split: a whole-shard task (`streams` False) then starts no more records and
        returns those it has not started as `deferred`; a streaming task ignores it (execute
        splits its shard between staged chunks). `split.stop()`, where `split` has it
        (`execute.Watch`), says the job was cancelled: a whole-shard task then stops at its next
        step, and the records it has not finished come back `deferred` too. A task that
        `stages_files` gets `files` (`parts.AttemptFiles`): it stages each file there with
        `files.put(key, data)`, `key` being where publish copies it under the output prefix."""
        raise NotImplementedError

    def planned_progress(self, staged: pa.Table | pa.RecordBatch) -> int | None:
        """The progress units (`progress_unit`) the staged rows without an error take; None for
        a task that counts only records."""
        return None

    # --- verify -----------------------------------------------------------------------------
    def renders(self, options: Any) -> tuple[str, ...]:
        """The kinds of extra output files (under `<kind>/`) the job's options ask for."""
        return ()

    def render(self, table: pa.Table, options: Any) -> list[tuple[str, str, bytes]]:
        """A result part's extra output files: (kind, key under the output prefix, content)."""
        return []

    def summarize(self, tables: Iterable[pa.Table]) -> dict[str, Any]:
        """Extra `_MANIFEST.json` counts from the result parts' `summary_columns`."""
        return {}

    def summarize_plan(self, work: int) -> dict[str, Any]:
        """Extra `batchinf plan` fields from the planned work (the valid records' length measure)."""
        return {}

    def assemble(self, pieces: pa.Table, failed: set[tuple[str, int]]) -> Assembled:
        """Piece outputs (rows of `piece_schema` from every committed attempt that ran pieces) ->
        one result or error row per record whose pieces are all there, in (source, ordinal) order;
        the records in `failed` (a committed error row names them already: a poison piece) are
        left out. Called at publish (verify.py) for a task with a `piece_schema`."""
        raise NotImplementedError

    def output_files(self, tables: Iterable[pa.Table]) -> list[dict[str, Any]]:
        """Files besides the parts the task staged (`stages_files`; generate_image's images), for
        `_MANIFEST.json`'s `files` and for publish to copy: key (relative to the output), kind,
        sha256; read from the same `summary_columns`."""
        return []

    # --- bundles ----------------------------------------------------------------------------
    def detects(self, config: dict[str, Any], src: Path) -> bool:
        """Whether a model directory with this config.json is a model of this task."""
        return False

    def prepare(self, src: Path, tmp: Path) -> Path | None:
        """A model directory in another engine's layout, made a bundle directory under `tmp`
        (renamed or converted files); None when `src` is not one of this task's."""
        return None

    def build_meta(self, src: Path, files: list[str], *, max_length: int | None, dtype: str) -> dict[str, Any]:
        raise NotImplementedError

    def open_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        raise NotImplementedError

    def vllm_problem(self, meta: dict[str, Any]) -> str | None:
        """Why the vllm engine cannot run this bundle of this task as native does (None: it can),
        from bundle.json alone: asked when a job on vllm is created (engines.job_engine)."""
        return None

    def vllm_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        """This task's runtime executed by vLLM (batchinf/engines); only tasks in engines.TASKS["vllm"] have one."""
        raise NotImplementedError(f"engine vllm does not run task {self.name}")

    # what the onnxruntime engine's graph of this task's bundles outputs: "embedding" (pooled,
    # normalised as the bundle says) or "logits" (runtime/onnx_export.py); None: it has no graph
    onnx_output: ClassVar[str | None] = None

    def onnx_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        """This task's runtime executed by ONNX Runtime (batchinf/engines); only tasks in
        engines.TASKS["onnxruntime"] have one."""
        raise NotImplementedError(f"engine onnxruntime does not run task {self.name}")

    def verify_inputs(self, runtime: Any) -> None:
        """Check the bundle's input fixtures (tokenizer or preprocessor drift); BundleError if any drifts."""
        from batchinf.runtime.bundle import verify_tokenizer_fixtures

        verify_tokenizer_fixtures(runtime)

    def verify_model(self, runtime: Any) -> None:
        """Run the bundle's fixtures through the loaded model; BundleError when they drift."""
        raise NotImplementedError


def ok_rows(c: dict[str, list[Any]]) -> list[int]:
    """Positions of the staged rows that carry no error."""
    return [i for i, e in enumerate(c["error"]) if e is None]


def record_columns(c: dict[str, list[Any]], ok: list[int]) -> dict[str, list[Any]]:
    """record_id, source and ordinal of the rows at `ok`."""
    return {k: [c[k][i] for i in ok] for k in ("record_id", "source", "ordinal")}


def staged_row(r: Any) -> dict[str, Any]:
    """The common staged columns of an input record (its error, if it has one)."""
    return {"ordinal": r.ordinal, "record_id": r.record_id, "error": r.error, "message": r.message,
            "n_tokens": 0, "truncated": False}


STAGE_CHUNK = 4096     # staged rows held as Python objects at once; the rest are already Arrow


class StagedRows:
    """An object's staged rows, turned into Arrow every STAGE_CHUNK rows, so planning a part holds
    one chunk of Python rows (a Python int costs 9 times its int32) besides its Arrow table."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.rows: list[dict[str, Any]] = []
        self.batches: list[pa.RecordBatch] = []

    def append(self, row: dict[str, Any]) -> None:
        """Add a row; the rows before it must be final (they may be turned into Arrow now)."""
        if len(self.rows) >= STAGE_CHUNK:
            self._spill()
        self.rows.append(row)

    def add_columns(self, cols: dict[str, list[Any]]) -> None:
        """Add a chunk of final rows given as columns (the schema's names)."""
        self._spill()
        self.batches.append(pa.record_batch(cols, schema=self.schema))

    def _spill(self) -> None:
        if self.rows:
            self.batches.append(pa.RecordBatch.from_pylist(self.rows, schema=self.schema))
            self.rows = []

    def table(self) -> pa.Table:
        self._spill()
        return pa.Table.from_batches(self.batches, schema=self.schema)


def usable_records(obj: Any, records: Iterable[Any], rows: StagedRows | list[dict[str, Any]]
                   ) -> Iterator[tuple[dict[str, Any], Any, str]]:
    """Append every record's staged row to `rows`; yield (row, record, where) for each record
    without an error, `where` naming it in messages. The caller finishes each row before the
    next record (the rows before it may already be Arrow)."""
    for r in records:
        row = staged_row(r)
        rows.append(row)
        if r.error is None:
            yield row, r, f"{obj.pin.uri} record {r.record_id!r}"


def chunks(records: Iterable[Any]) -> Iterator[list[Any]]:
    """Records in lists of STAGE_CHUNK (the last shorter)."""
    it = iter(records)
    while chunk := list(islice(it, STAGE_CHUNK)):
        yield chunk
