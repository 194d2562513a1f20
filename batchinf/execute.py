"""Execute: run one leased shard and checkpoint it under its fencing token.

Outputs go to attempt-scoped keys (`<work>/attempts/<shard>/a<N>/...`); only the committed
attempt's keys are recorded in the ledger, and only those are promoted at publish. Rows that are
pieces of a record (a long audio file staged in several rows) give piece outputs, written beside
the part (`pieces.parquet`, named in the part's footer: parts.pieces_footer) and assembled into
their records' rows at publish.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
from batchinf import failpoints, metrics
from batchinf.planning import sizing
from batchinf.bundles import open_runtime, take_load_seconds
from batchinf.config import settings
from batchinf.errors import AttemptReleased, JobStopped, StaleAttemptError
from batchinf.heartbeat import Heartbeat
from batchinf.ledger import leases
from batchinf.ledger import splits
from batchinf.ledger.models import Lease, Shard, ShardResult
from batchinf.parts import (ERROR_SCHEMA, PIECES_FILE, STAGE_ROW_GROUP, AttemptFiles, PartWriter, error_row,
                            open_parquet, pieces_footer, read_table, write_table)
from batchinf.planning.shard_names import shard_id
from batchinf.retry_policy import retrying
from batchinf.store import get_store, join
from batchinf.tasks import get_task

WATCH_POLL_SECONDS = 0.25   # a split or a cancel waits at most this long (one indexed read per poll)


class Watch:
    """What the lifecycle wants of this attempt (`splits.wanted`), read from the ledger at most
    every `every` seconds (the first time when first asked), so a loop may ask at every record or
    decode step: calling it says whether to split (stop admitting records; a stop says so too),
    `stop()` whether its job was cancelled (stop at the next batch or step, keep what is done). A
    failed read counts as nothing yet: the next one retries."""

    def __init__(self, lease: Lease, every: float) -> None:
        self.lease, self.every = lease, every
        self._next = 0.0
        self._said: str | None = None

    def _poll(self) -> str | None:
        if self._said != splits.STOP and (t := time.monotonic()) >= self._next:
            self._next = t + self.every
            try:
                self._said = splits.wanted(self.lease) or self._said
            except Exception:  # noqa: BLE001 -- a missed poll only delays the split or the stop
                pass
        return self._said

    def __call__(self) -> bool:
        return self._poll() is not None

    def stop(self) -> bool:
        return self._poll() == splits.STOP


class _StopOnly:
    """A Watch for a shard that may not split (splitting is off): it only ever says stop."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch

    def __call__(self) -> bool:
        return self.watch.stop()

    def stop(self) -> bool:
        return self.watch.stop()


def _staged_errors(c: dict[str, list[Any]], attempt: int) -> list[dict[str, Any]]:
    """Records that failed validation at planning: their error rows, as staged."""
    return [error_row(c["record_id"][i], c["source"][i], c["ordinal"][i], e, c["message"][i], attempt)
            for i, e in enumerate(c["error"]) if e is not None]


def _inference_errors(c: dict[str, list[Any]], failures: dict[int, str], attempt: int,
                      codes: dict[int, str] | None = None) -> list[dict[str, Any]]:
    codes = codes or {}
    return [error_row(c["record_id"][i], c["source"][i], c["ordinal"][i], codes.get(i, "inference_error"),
                      f"record {c['record_id'][i]!r}: {msg}", attempt) for i, msg in sorted(failures.items())]


def _staged_chunks(uri: str, streams: bool, work: int) -> Iterator[pa.Table | pa.RecordBatch]:
    """A task that streams gets the staged shard row group by row group, each in chunks of about
    `work` tokens (where the attempt may split); else all of it at once."""
    if not streams:
        yield read_table(uri)
        return
    with open_parquet(uri) as pf:
        for batch in pf.iter_batches(batch_size=STAGE_ROW_GROUP):
            yield from _chunks(batch, work)


def _chunks(staged: pa.Table | pa.RecordBatch, work: int) -> Iterator[pa.Table | pa.RecordBatch]:
    """A streamed batch in contiguous slices of about `work` tokens: the record boundaries at which
    the attempt may split its shard."""
    cum = np.cumsum(staged.column("n_tokens").to_numpy(zero_copy_only=False).astype(np.int64))
    if staged.num_rows == 0 or not work or cum[-1] <= work:
        yield staged
        return
    cuts = np.unique(np.clip(np.searchsorted(cum, np.arange(work, cum[-1], work), side="left") + 1,
                             1, staged.num_rows))
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), staged.num_rows]):
        if b > a:
            yield staged.slice(a, b - a)


def _split_children(job_work_uri: str, shard: Shard, lease: Lease, rest: np.ndarray) -> list[dict[str, Any]]:
    """Stage the shard's records at staged positions `rest` (ascending: those it has not done;
    a tail for a streaming task, any subset for generate, whose admission is not in staged
    order) as its children, in staged order: two of equal work (one for a single record; one
    child alone would only move the work to another worker), under names unique to this attempt."""
    staged = read_table(shard.input_uri)
    tail = int(rest[0]) + len(rest) == staged.num_rows and bool((np.diff(rest) == 1).all())
    left = staged.slice(int(rest[0])) if tail else staged.take(pa.array(rest, type=pa.int64()))
    # a child's id names the records it covers: the first done records' count, else the set left
    key = str(staged.num_rows - len(rest)) if tail else hashlib.sha256(rest.astype("<i8").tobytes()).hexdigest()[:16]
    tokens = left.column("n_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
    work = tokens + (left.column("max_tokens").fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
                     if "max_tokens" in left.schema.names else 0)    # generate: as planned, its decoding too
    halves = 2 if left.num_rows > 1 else 1
    runs = sizing.cut_balanced(np.arange(left.num_rows), work, -(-int(work.sum()) // halves), left.num_rows,
                               1 << 62, min_work=1)
    children = []
    for k, run in enumerate(runs):
        part = left.slice(int(run[0]), len(run))
        uri = join(job_work_uri, "shards", f"split-{shard.id}-a{lease.attempt}-{k}.parquet")
        write_table(uri, part, row_group_size=STAGE_ROW_GROUP)
        children.append({"id": shard_id(f"{shard.id}|split|{key}|{k}"), "num_records": part.num_rows,
                         "num_tokens": int(tokens[run].sum()), "input_uri": uri})
    return children


def _attempt_of(pieces: pa.Table, attempt: int) -> pa.Table:
    """Piece outputs with the attempt that computed a failed piece (`attempts`, as its error row will
    have it); a piece that succeeded names none, so a retry writes the same bytes."""
    failed = pieces.column("error").is_valid().to_pylist()
    return pieces.set_column(pieces.schema.get_field_index("attempts"), "attempts",
                             pa.array([attempt if f else None for f in failed], pa.int32()))


def _columns(staged: pa.Table | pa.RecordBatch) -> dict[str, list[Any]]:
    c = {name: staged.column(name).to_pylist() for name in staged.schema.names if name != "source"}
    c["source"] = staged.column("source").cast(pa.string()).to_pylist()
    return c


def execute_shard(lease: Lease, *, device: str = "cpu", heartbeat: Heartbeat | None = None) -> ShardResult:
    """Compute one shard under `lease`, write attempt-scoped files, and commit them.

    The job's task runs the staged rows: a streaming task (embed, score, classify...) one staged
    row group at a time, so memory stays bounded whatever the shard's size; generate gets the
    whole shard as one continuous batch (its size is bounded by shards.max_records).

    Asked to split (`ledger.splits`), the attempt commits the records it has done and stages the
    others as the shard's children: a streaming task at its next chunk boundary (the done records
    are a prefix of the staged ones), generate once its records in flight finish (any subset).
    When its job is cancelled it does the same at once (generate: at its next decode step), so the
    cancelled job keeps what was finished; with nothing finished it gives its lease back."""
    t0 = time.perf_counter()
    job, shard = lease.job, lease.shard
    m = job.manifest
    if job.device != "any":          # the job's device (engines.job_device); a claim matched it to this worker's
        device = job.device
    elif m.options.device != "auto":
        device = m.options.device
    runtime = open_runtime(job.bundle_digest, device=device, with_model=shard.bucket >= 0, engine=job.engine)
    if (starting := getattr(runtime, "begin_shard", None)) is not None:
        starting(job.id)        # a remote engine replays the fixtures at each job's start and every N shards

    progress0 = getattr(runtime, "progress_done", None)    # a runtime that counts its progress (Task.progress_unit)

    def check() -> None:
        if heartbeat is not None:
            if heartbeat.lost.is_set():
                raise StaleAttemptError(f"attempt {lease.attempt} of shard {lease.shard_id} lost its lease")
            if progress0 is not None:      # the task checks after every step or batch: the heartbeat reports it
                heartbeat.progress_done = round(runtime.progress_done - progress0)

    def finished(n: int = 1) -> None:
        """n more records are done (the heartbeat reports them), then `check`."""
        if heartbeat is not None:
            heartbeat.records_done += n
        check()

    task = get_task(m.task)
    error_rows: list[dict[str, Any]] = []
    tokens = {"input": 0, "output": 0, "real": 0, "padded": 0}
    results = PartWriter(task.result_schema(runtime.meta, m.options))
    failures = PartWriter(ERROR_SCHEMA)
    pieces = PartWriter(task.piece_schema) if task.piece_schema is not None else None
    done = done_tokens = 0          # records (and their staged tokens) computed so far
    rest: np.ndarray | None = None  # when splitting: staged positions of the records left to children
    chunk = sizing.split_chunk_work()         # 0: no splitting; else at least a batch a chunk
    chunk = chunk and max(chunk, int(getattr(m.options, "max_batch_tokens", 0) or 0))
    watch = Watch(lease, min(WATCH_POLL_SECONDS, settings().heartbeat_seconds))
    base = join(job.work_uri, "attempts", lease.shard_id, f"a{lease.attempt}")
    out_uri, err_uri = join(base, "part.parquet"), join(base, "errors.parquet")
    staging = {"files": AttemptFiles(out_uri, lease.attempt)} if task.stages_files else {}
    progress = 0                    # planned progress units of the records done (Task.progress_unit)
    retrying(leases.computing, lease, True)     # from here a lost worker counts against the records
    try:
        for staged in _staged_chunks(shard.input_uri, task.streams, chunk):
            if watch.stop():
                if not done:
                    raise AttemptReleased(f"job {job.id} stopped before attempt {lease.attempt} finished a record")
                rest = np.arange(done, shard.num_records)
                break
            # split only while the rest is worth handing over (the request may be a chunk old)
            if (chunk and done and done < shard.num_records
                    and shard.num_tokens - done_tokens >= sizing.min_split_work() and watch()):
                rest = np.arange(done, shard.num_records)
                break
            check()
            if chunk and task.streams and heartbeat is not None and done + staged.num_rows >= shard.num_records:
                heartbeat.nearly_done(*sizing.split_bounds(float(job.plan.get("work_per_token", 1.0))))
            c = _columns(staged)
            # a streaming task reports progress per staged batch; a whole-shard one (generate)
            # per finished record, through the callback it calls as each one finishes, and
            # stops starting records once a split is wanted (those left come back `deferred`)
            try:
                run = task.run(c, runtime, m.options, check if task.streams else finished,
                               watch if chunk else _StopOnly(watch), **staging)
            except JobStopped:          # cancelled inside this batch: it is not done, those before are
                rest = np.arange(done, shard.num_records)
                break
            errors = _staged_errors(c, lease.attempt) + _inference_errors(c, run.failures, lease.attempt, run.codes)
            results.write(run.table)
            failures.write(pa.Table.from_pylist(errors, schema=ERROR_SCHEMA))
            if run.pieces is not None and pieces is not None:
                pieces.write(_attempt_of(run.pieces, lease.attempt))
            error_rows += errors
            for k in tokens:
                tokens[k] += run.tokens.get(k, 0)
            if task.streams:
                finished(staged.num_rows)
            if run.deferred:            # the whole shard was `staged`: positions are the shard's
                rest = np.asarray(run.deferred, dtype=np.int64)
            done += staged.num_rows - len(run.deferred)
            progress += task.planned_progress(staged if not run.deferred else staged.filter(
                pa.array(~np.isin(np.arange(staged.num_rows), run.deferred)))) or 0
            done_tokens += sum(c["n_tokens"]) - sum(c["n_tokens"][i] for i in run.deferred)
        if rest is not None and not done:
            raise AttemptReleased(f"job {job.id} stopped before attempt {lease.attempt} finished a record")
        retrying(leases.computing, lease, False)
        children = [] if rest is None else _split_children(job.work_uri, shard, lease, rest)
    except BaseException:
        results.discard()
        failures.discard()
        if pieces is not None:
            pieces.discard()
        raise

    failpoints.hit("execute.before_write")
    footer = None
    if pieces is not None and pieces.rows:
        footer = pieces_footer(*pieces.finish(join(base, PIECES_FILE)))
    elif pieces is not None:
        pieces.discard()
    out_sha, out_rows = results.finish(out_uri, footer)
    err_sha, err_rows = failures.finish(err_uri)
    failpoints.hit("execute.after_write")
    result = ShardResult(
        output_uri=out_uri, output_sha256=out_sha, output_rows=out_rows,
        errors_uri=err_uri, errors_sha256=err_sha, error_rows=err_rows,
        tokens_input=tokens["input"], tokens_output=tokens["output"], tokens_real=tokens["real"],
        tokens_padded=tokens["padded"],
        execute_seconds=time.perf_counter() - t0, errors=error_rows, progress=progress,
        load_seconds=take_load_seconds(job.bundle_digest))
    failpoints.hit("execute.before_commit")
    try:
        if rest is None:
            leases.commit_attempt(lease, result)
        else:
            failpoints.hit("split.before_commit")
            splits.commit_split(lease, result, done, done_tokens, children)
            failpoints.hit("split.after_commit")
    except StaleAttemptError:
        get_store(base).delete_prefix(base)   # a losing attempt leaves nothing behind
        for child in children:
            get_store(child["input_uri"]).delete(child["input_uri"])
        raise
    metrics.shard_committed(job.bundle_digest, result, task.progress_unit)
    failpoints.hit("execute.after_commit")
    return result
