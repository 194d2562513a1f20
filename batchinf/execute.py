"""Execute: run one leased shard and checkpoint it under its fencing token.

Outputs go to attempt-scoped keys (`<work>/attempts/<shard>/a<N>/...`); only the committed
attempt's keys are recorded in the ledger, and only those are promoted at publish.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import numpy as np
import pyarrow as pa
from batchinf import failpoints, metrics
from batchinf.bundles import open_runtime
from batchinf.config import settings
from batchinf.errors import BundleError, StaleAttemptError
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import leases
from batchinf.ledger import shards as shard_repo
from batchinf.ledger.models import Lease, ShardResult
from batchinf.parts import (
    ERROR_SCHEMA,
    GENERATION_SCHEMA,
    STAGE_ROW_GROUP,
    PartWriter,
    embedding_schema,
    error_row,
    open_parquet,
    read_table,
)
from batchinf.store import get_store, join

T = TypeVar("T")


def token_budget_batches(lengths: list[int], max_batch_tokens: int, min_fill: float = 0.95) -> list[list[int]]:
    """Group positions of records sorted ascending by length into batches whose padded size
    (len(batch) * longest) stays within max_batch_tokens and whose fill (real / padded tokens)
    stays at or above min_fill. A record longer than the budget runs alone."""
    batches: list[list[int]] = []
    cur: list[int] = []
    real = longest = 0
    for i, n in enumerate(lengths):
        top = max(longest, n)
        if cur and ((len(cur) + 1) * top > max_batch_tokens or (real + n) < min_fill * (len(cur) + 1) * top):
            batches.append(cur)
            cur, real, top = [], 0, n
        cur.append(i)
        real += n
        longest = top
    if cur:
        batches.append(cur)
    return batches


def isolate(run: Callable[[list[T]], None], items: list[T], *, done: Callable[[T], bool],
            failed: Callable[[T, str], None]) -> None:
    """Run `items`; if it raises, the items not yet done are run again in halves, recursively,
    until only the records that fail fail, each alone (`failed(item, error)`)."""
    try:
        run(items)
    except (BundleError, StaleAttemptError):
        raise
    except Exception as exc:  # noqa: BLE001 -- any model/runtime fault on a record is isolated
        rest = [i for i in items if not done(i)]
        if len(rest) == 1:
            failed(rest[0], f"{type(exc).__name__}: {exc}")
            return
        mid = len(rest) // 2
        for half in (rest[:mid], rest[mid:]):
            if half:
                isolate(run, half, done=done, failed=failed)


def _hit_record_failpoints(record_ids: list[str]) -> None:
    if failpoints.active():
        for rid in record_ids:
            failpoints.hit(f"execute.record[{rid}]")


@dataclass
class EmbedOutcome:
    vectors: dict[int, np.ndarray] = field(default_factory=dict)   # position -> embedding
    failures: dict[int, str] = field(default_factory=dict)        # position -> exception text
    padded: int = 0


def embed_isolating(embed: Callable[[list[list[int]]], tuple[np.ndarray, int]], ids: list[list[int]],
                    positions: list[int], record_ids: list[str], out: EmbedOutcome) -> None:
    """Embed a batch; if it raises, split it in halves until only the failing records fail."""
    def run(batch: list[int]) -> None:
        _hit_record_failpoints([record_ids[p] for p in batch])
        vecs, padded = embed([ids[p] for p in batch])
        out.padded += padded
        out.vectors.update(zip(batch, vecs))

    isolate(run, positions, done=out.vectors.__contains__, failed=out.failures.__setitem__)


@dataclass
class GenOutcome:
    results: dict[int, Any] = field(default_factory=dict)      # position -> GenResult
    failures: dict[int, str] = field(default_factory=dict)     # position -> exception text


def generate_isolating(generate: Callable[[list[Any]], Any], requests: list[Any], record_ids: list[str],
                       out: GenOutcome, check: Callable[[], None] = lambda: None) -> None:
    """Generate for `requests` (continuous batching over all of them); if it raises, the results
    already finished are kept and the unfinished requests are split in halves until only the
    failing records fail. `check` runs after every finished sequence (lease still held?)."""
    def run(reqs: list[Any]) -> None:
        _hit_record_failpoints([record_ids[r.key] for r in reqs])
        for res in generate(reqs):
            out.results[res.key] = res
            check()

    isolate(run, requests, done=lambda r: r.key in out.results,
            failed=lambda r, error: out.failures.__setitem__(r.key, error))


class Heartbeat(threading.Thread):
    """Extends the lease while the attempt runs; flags `lost` when the fencing token is gone."""

    def __init__(self, lease: Lease, parent_pid: int | None = None) -> None:
        super().__init__(daemon=True)
        self.lease, self.parent_pid = lease, parent_pid
        self.lost = threading.Event()
        self.records_done = 0       # records of the shard finished so far, sent with each heartbeat
        self._stop = threading.Event()

    def run(self) -> None:
        s = settings()
        while not self._stop.wait(s.heartbeat_seconds):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                os._exit(1)  # embedded driver died: do not outlive it
            try:
                if not leases.heartbeat(self.lease, s.lease_seconds, self.records_done):
                    self.lost.set()
                    return
            except Exception:  # noqa: BLE001 -- a missed heartbeat is retried on the next tick
                continue

    def stop(self) -> None:
        self._stop.set()


def _embed_rows(rb: pa.RecordBatch, runtime: Any, max_batch_tokens: int, attempt: int,
                dim: int) -> tuple[pa.Table, list[dict[str, Any]], int]:
    """One staged row group -> (result rows, error rows, padded tokens computed)."""
    c = {name: rb.column(name).to_pylist() for name in
         ("record_id", "ordinal", "error", "message", "n_tokens", "truncated", "input_ids")}
    c["source"] = rb.column("source").cast(pa.string()).to_pylist()
    errors = _staged_errors(c, attempt)
    valid = [i for i, e in enumerate(c["error"]) if e is None]
    out = EmbedOutcome()
    for batch in token_budget_batches([c["n_tokens"][i] for i in valid], max_batch_tokens):
        embed_isolating(runtime.embed, c["input_ids"], [valid[j] for j in batch], c["record_id"], out)
    errors += _inference_errors(c, out.failures, attempt)
    ok = [i for i in valid if i in out.vectors]
    vectors = np.concatenate([out.vectors[i] for i in ok]) if ok else np.zeros(0, np.float32)
    table = pa.table({
        "record_id": [c["record_id"][i] for i in ok], "source": [c["source"][i] for i in ok],
        "ordinal": [c["ordinal"][i] for i in ok],
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors, pa.float32()), dim),
        "input_tokens": [c["n_tokens"][i] for i in ok], "output_tokens": [0] * len(ok),
        "truncated": [c["truncated"][i] for i in ok],
    }, schema=embedding_schema(dim))
    return table, errors, out.padded


def _staged_errors(c: dict[str, list[Any]], attempt: int) -> list[dict[str, Any]]:
    """Records that failed validation at planning: their error rows, as staged."""
    return [error_row(c["record_id"][i], c["source"][i], c["ordinal"][i], e, c["message"][i], attempt)
            for i, e in enumerate(c["error"]) if e is not None]


def _inference_errors(c: dict[str, list[Any]], failures: dict[int, str], attempt: int) -> list[dict[str, Any]]:
    return [error_row(c["record_id"][i], c["source"][i], c["ordinal"][i], "inference_error",
                      f"record {c['record_id'][i]!r}: {msg}", attempt) for i, msg in sorted(failures.items())]


def _generate_rows(staged: pa.Table, runtime: Any, opts: Any, attempt: int,
                   check: Callable[[], None]) -> tuple[pa.Table, list[dict[str, Any]], Any]:
    """A whole staged shard -> (result rows, error rows, GenStats). One continuous batch runs over
    all of the shard's records in staged order (by prompt length), so slots freed by short
    answers are refilled from the whole shard; rows are written in staged order, whatever order
    sequences finish in. Each record samples with its own staged seed: a retry is identical."""
    from batchinf.runtime.generate import GenRequest, GenStats, SamplingParams

    c = staged.drop_columns(["source"]).to_pydict()
    c["source"] = staged.column("source").cast(pa.string()).to_pylist()
    errors = _staged_errors(c, attempt)
    valid = [i for i, e in enumerate(c["error"]) if e is None]
    requests = [GenRequest(i, c["input_ids"][i], SamplingParams(
        max_tokens=c["max_tokens"][i], temperature=c["temperature"][i], top_k=c["top_k"][i],
        top_p=c["top_p"][i], seed=c["seed"][i], stop=tuple(c["stop"][i] or ()),
        stop_token_ids=tuple(c["stop_token_ids"][i] or ()))) for i in valid]
    stats, out = GenStats(), GenOutcome()

    def generate(reqs: list[Any]) -> Any:
        return runtime.generate(reqs, max_batch_tokens=opts.max_batch_tokens, max_slots=opts.max_slots,
                                stats=stats)

    if requests:
        generate_isolating(generate, requests, c["record_id"], out, check)
    errors += _inference_errors(c, out.failures, attempt)
    ok = [i for i in valid if i in out.results]
    res = [out.results[i] for i in ok]
    table = pa.table({
        "record_id": [c["record_id"][i] for i in ok], "source": [c["source"][i] for i in ok],
        "ordinal": [c["ordinal"][i] for i in ok], "kind": [c["kind"][i] for i in ok],
        "text": [r.text for r in res], "finish_reason": [r.finish_reason for r in res],
        "input_tokens": [r.input_tokens for r in res], "output_tokens": [r.output_tokens for r in res],
        "seed": [c["seed"][i] for i in ok], "output_ids": [r.token_ids for r in res],
    }, schema=GENERATION_SCHEMA)
    return table, errors, stats


def execute_shard(lease: Lease, *, device: str = "cpu", heartbeat: Heartbeat | None = None) -> ShardResult:
    """Compute one shard under `lease`, write attempt-scoped files, and commit them.

    Embed: memory stays bounded by one staged row group and one token-budget batch, whatever the
    shard's size: rows stream from the staged file to the part file. Generate: the shard is one
    continuous batch (its size is bounded by shards.max_records)."""
    t0 = time.perf_counter()
    job, shard = job_repo.get(lease.job_id), shard_repo.get(lease.shard_id)
    m = job.manifest
    if m.options.device != "auto":
        device = m.options.device
    runtime = open_runtime(job.bundle_digest, device=device, with_model=shard.bucket >= 0)

    def check() -> None:
        if heartbeat is not None and heartbeat.lost.is_set():
            raise StaleAttemptError(f"attempt {lease.attempt} of shard {lease.shard_id} lost its lease")

    def finished(n: int = 1) -> None:
        """n more records are done (the heartbeat reports them), then `check`."""
        if heartbeat is not None:
            heartbeat.records_done += n
        check()

    error_rows: list[dict[str, Any]] = []
    tokens = {"input": 0, "output": 0, "real": 0, "padded": 0}
    if m.task == "generate":
        results = PartWriter(GENERATION_SCHEMA)
    else:
        dim = len(runtime.meta["fixtures"][0]["embedding"])
        results = PartWriter(embedding_schema(dim))
    failures = PartWriter(ERROR_SCHEMA)
    try:
        if m.task == "generate":
            table, error_rows, stats = _generate_rows(read_table(shard.input_uri), runtime, m.options,
                                                      lease.attempt, finished)
            results.write(table)
            failures.write(pa.Table.from_pylist(error_rows, schema=ERROR_SCHEMA))
            tokens = {"input": sum(table.column("input_tokens").to_pylist()),
                      "output": sum(table.column("output_tokens").to_pylist()),
                      "real": stats.real_positions, "padded": stats.computed_positions}
        else:
            with open_parquet(shard.input_uri) as pf:
                for rb in pf.iter_batches(batch_size=STAGE_ROW_GROUP):
                    check()
                    table, errors, n_padded = _embed_rows(rb, runtime, m.options.max_batch_tokens,
                                                          lease.attempt, dim)
                    results.write(table)
                    failures.write(pa.Table.from_pylist(errors, schema=ERROR_SCHEMA))
                    error_rows += errors
                    finished(rb.num_rows)
                    n = sum(table.column("input_tokens").to_pylist())
                    tokens["input"] += n
                    tokens["real"] += n
                    tokens["padded"] += n_padded
    except BaseException:
        results.discard()
        failures.discard()
        raise

    base = join(job.work_uri, "attempts", lease.shard_id, f"a{lease.attempt}")
    out_uri, err_uri = join(base, "part.parquet"), join(base, "errors.parquet")
    failpoints.hit("execute.before_write")
    out_sha, out_rows = results.finish(out_uri)
    err_sha, err_rows = failures.finish(err_uri)
    failpoints.hit("execute.after_write")
    result = ShardResult(
        output_uri=out_uri, output_sha256=out_sha, output_rows=out_rows,
        errors_uri=err_uri, errors_sha256=err_sha, error_rows=err_rows,
        tokens_input=tokens["input"], tokens_output=tokens["output"], tokens_real=tokens["real"],
        tokens_padded=tokens["padded"],
        execute_seconds=time.perf_counter() - t0, errors=error_rows)
    failpoints.hit("execute.before_commit")
    try:
        leases.commit_attempt(lease, result)
    except StaleAttemptError:
        get_store(base).delete_prefix(base)   # a losing attempt leaves nothing behind
        raise
    metrics.shard_committed(job.bundle_digest, result)
    failpoints.hit("execute.after_commit")
    return result
