"""Execute: run one leased shard and checkpoint it under its fencing token.

Outputs go to attempt-scoped keys (`<work>/attempts/<shard>/a<N>/...`); only the committed
attempt's keys are recorded in the ledger, and only those are promoted at publish.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pyarrow as pa
from sqlalchemy import select

from batchinf import failpoints, metrics
from batchinf.bundles import open_runtime
from batchinf.config import settings
from batchinf.errors import BundleError, StaleAttemptError
from batchinf.jobs import job_manifest
from batchinf.ledger import ops
from batchinf.ledger.db import tx
from batchinf.ledger.tables import jobs, shards
from batchinf.parts import ERROR_SCHEMA, STAGE_ROW_GROUP, PartWriter, embedding_schema, open_parquet
from batchinf.store import get_store, join


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


@dataclass
class EmbedOutcome:
    vectors: dict[int, np.ndarray] = field(default_factory=dict)   # position -> embedding
    failures: dict[int, str] = field(default_factory=dict)        # position -> exception text
    padded: int = 0


def embed_isolating(embed: Callable[[list[list[int]]], tuple[np.ndarray, int]], ids: list[list[int]],
                    positions: list[int], record_ids: list[str], out: EmbedOutcome) -> None:
    """Embed a batch; if it raises, split it in halves until only the failing records fail."""
    try:
        if failpoints.active():
            for p in positions:
                failpoints.hit(f"execute.record[{record_ids[p]}]")
        vecs, padded = embed([ids[p] for p in positions])
    except (BundleError, StaleAttemptError):
        raise
    except Exception as exc:  # noqa: BLE001 -- any model/runtime fault on a record is isolated
        if len(positions) == 1:
            out.failures[positions[0]] = f"{type(exc).__name__}: {exc}"
            return
        mid = len(positions) // 2
        embed_isolating(embed, ids, positions[:mid], record_ids, out)
        embed_isolating(embed, ids, positions[mid:], record_ids, out)
        return
    out.padded += padded
    for p, v in zip(positions, vecs):
        out.vectors[p] = v


class Heartbeat(threading.Thread):
    """Extends the lease while the attempt runs; flags `lost` when the fencing token is gone."""

    def __init__(self, lease: ops.Lease, parent_pid: int | None = None) -> None:
        super().__init__(daemon=True)
        self.lease, self.parent_pid = lease, parent_pid
        self.lost = threading.Event()
        self._stop = threading.Event()

    def run(self) -> None:
        s = settings()
        while not self._stop.wait(s.heartbeat_seconds):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                os._exit(1)  # embedded driver died: do not outlive it
            try:
                if not ops.heartbeat(self.lease, s.lease_seconds):
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
    errors = [{"record_id": c["record_id"][i], "source": c["source"][i], "ordinal": c["ordinal"][i],
               "error": e, "message": c["message"][i], "attempts": attempt}
              for i, e in enumerate(c["error"]) if e is not None]
    valid = [i for i, e in enumerate(c["error"]) if e is None]
    out = EmbedOutcome()
    for batch in token_budget_batches([c["n_tokens"][i] for i in valid], max_batch_tokens):
        embed_isolating(runtime.embed, c["input_ids"], [valid[j] for j in batch], c["record_id"], out)
    for i, msg in sorted(out.failures.items()):
        errors.append({"record_id": c["record_id"][i], "source": c["source"][i], "ordinal": c["ordinal"][i],
                       "error": "inference_error", "message": f"record {c['record_id'][i]!r}: {msg}",
                       "attempts": attempt})
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


def execute_shard(lease: ops.Lease, *, device: str = "cpu", heartbeat: Heartbeat | None = None) -> ops.ShardResult:
    """Compute one shard under `lease`, write attempt-scoped files, and commit them.

    Memory stays bounded by one staged row group and one token-budget batch, whatever the
    shard's size: rows stream from the staged file to the part file."""
    t0 = time.perf_counter()
    with tx() as conn:
        job = conn.execute(select(jobs).where(jobs.c.id == lease.job_id)).one()
        shard = conn.execute(select(shards).where(shards.c.id == lease.shard_id)).one()
    m = job_manifest(job)
    if m.options.device != "auto":
        device = m.options.device
    runtime = open_runtime(job.bundle_digest, device=device, with_model=shard.bucket >= 0)
    dim = len(runtime.meta["fixtures"][0]["embedding"])
    results, failures = PartWriter(embedding_schema(dim)), PartWriter(ERROR_SCHEMA)
    error_rows: list[dict[str, Any]] = []
    real = padded = 0
    try:
        with open_parquet(shard.input_uri) as pf:
            for rb in pf.iter_batches(batch_size=STAGE_ROW_GROUP):
                if heartbeat is not None and heartbeat.lost.is_set():
                    raise StaleAttemptError(f"attempt {lease.attempt} of shard {lease.shard_id} lost its lease")
                table, errors, n_padded = _embed_rows(rb, runtime, m.options.max_batch_tokens,
                                                      lease.attempt, dim)
                results.write(table)
                failures.write(pa.Table.from_pylist(errors, schema=ERROR_SCHEMA))
                error_rows += errors
                real += sum(table.column("input_tokens").to_pylist())
                padded += n_padded
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
    result = ops.ShardResult(
        output_uri=out_uri, output_sha256=out_sha, output_rows=out_rows,
        errors_uri=err_uri, errors_sha256=err_sha, error_rows=err_rows,
        tokens_input=real, tokens_output=0, tokens_real=real, tokens_padded=padded,
        execute_seconds=time.perf_counter() - t0, errors=error_rows)
    failpoints.hit("execute.before_commit")
    try:
        ops.commit_attempt(lease, result)
    except StaleAttemptError:
        get_store(base).delete_prefix(base)   # a losing attempt leaves nothing behind
        raise
    metrics.shard_committed(job.bundle_digest, result)
    failpoints.hit("execute.after_commit")
    return result
