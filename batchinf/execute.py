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

from batchinf import failpoints
from batchinf.bundles import open_runtime
from batchinf.config import settings
from batchinf.errors import BundleError, StaleAttemptError
from batchinf.jobs import job_manifest
from batchinf.ledger import ops
from batchinf.ledger.db import tx
from batchinf.ledger.tables import jobs, shards
from batchinf.parts import ERROR_SCHEMA, embedding_schema, read_table, write_table
from batchinf.store import get_store, join


def token_budget_batches(lengths: list[int], max_batch_tokens: int, min_fill: float = 0.9) -> list[list[int]]:
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


def execute_shard(lease: ops.Lease, *, device: str = "cpu", heartbeat: Heartbeat | None = None) -> ops.ShardResult:
    """Compute one shard under `lease`, write attempt-scoped files, and commit them."""
    t0 = time.perf_counter()
    with tx() as conn:
        job = conn.execute(select(jobs).where(jobs.c.id == lease.job_id)).one()
        shard = conn.execute(select(shards).where(shards.c.id == lease.shard_id)).one()
    m = job_manifest(job)
    if m.options.device != "auto":
        device = m.options.device
    staged = read_table(shard.input_uri)
    errors_col = staged.column("error").to_pylist()
    record_ids = staged.column("record_id").to_pylist()
    sources = staged.column("source").cast(pa.string()).to_pylist()
    ordinals = staged.column("ordinal").to_pylist()
    valid = [i for i, e in enumerate(errors_col) if e is None]

    out = EmbedOutcome()
    dim = 0
    if valid:
        runtime = open_runtime(job.bundle_digest, device=device)
        ids_col = staged.column("input_ids").to_pylist()
        lengths = [len(ids_col[i]) for i in valid]
        for batch in token_budget_batches(lengths, m.options.max_batch_tokens):
            if heartbeat is not None and heartbeat.lost.is_set():
                raise StaleAttemptError(f"attempt {lease.attempt} of shard {lease.shard_id} lost its lease")
            embed_isolating(runtime.embed, ids_col, [valid[j] for j in batch], record_ids, out)
        dim = len(runtime.meta["fixtures"][0]["embedding"])

    ok = [i for i in valid if i in out.vectors]
    n_tokens = staged.column("n_tokens").to_pylist()
    truncated = staged.column("truncated").to_pylist()
    result_table = pa.table({
        "record_id": [record_ids[i] for i in ok], "source": [sources[i] for i in ok],
        "ordinal": [ordinals[i] for i in ok],
        "embedding": pa.FixedSizeListArray.from_arrays(
            pa.array(np.concatenate([out.vectors[i] for i in ok]) if ok else np.zeros(0, np.float32),
                     pa.float32()), dim or 1),
        "input_tokens": [n_tokens[i] for i in ok], "output_tokens": [0] * len(ok),
        "truncated": [truncated[i] for i in ok],
    }, schema=embedding_schema(dim or 1))
    error_rows: list[dict[str, Any]] = []
    for i, e in enumerate(errors_col):
        if e is not None:
            error_rows.append({"record_id": record_ids[i], "source": sources[i], "ordinal": ordinals[i],
                               "error": e, "message": staged.column("message")[i].as_py(),
                               "attempts": lease.attempt})
    for i, msg in out.failures.items():
        error_rows.append({"record_id": record_ids[i], "source": sources[i], "ordinal": ordinals[i],
                           "error": "inference_error", "message": f"record {record_ids[i]!r}: {msg}",
                           "attempts": lease.attempt})
    errors_table = pa.Table.from_pylist(error_rows, schema=ERROR_SCHEMA)

    base = join(job.work_uri, "attempts", lease.shard_id, f"a{lease.attempt}")
    out_uri, err_uri = join(base, "part.parquet"), join(base, "errors.parquet")
    failpoints.hit("execute.before_write")
    out_sha = write_table(out_uri, result_table)
    err_sha = write_table(err_uri, errors_table)
    failpoints.hit("execute.after_write")
    real = sum(n_tokens[i] for i in ok)
    result = ops.ShardResult(
        output_uri=out_uri, output_sha256=out_sha, output_rows=result_table.num_rows,
        errors_uri=err_uri, errors_sha256=err_sha, error_rows=errors_table.num_rows,
        tokens_input=real, tokens_output=0, tokens_real=real, tokens_padded=out.padded,
        execute_seconds=time.perf_counter() - t0, errors=error_rows)
    failpoints.hit("execute.before_commit")
    try:
        ops.commit_attempt(lease, result)
    except StaleAttemptError:
        store = get_store(base)
        store.delete_prefix(base)   # a losing attempt leaves nothing behind
        raise
    failpoints.hit("execute.after_commit")
    return result
