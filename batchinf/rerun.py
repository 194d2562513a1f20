"""`batchinf retry` (a rerun): a new job over exactly the failed (by error code) and/or unfinished records of
a finished job, with the same pinned bundle and input objects and a new output prefix.

The records are chosen here, by (source object, ordinal): the old job's error rows of the codes
asked for, and the records staged for its shards that never finished (the `staged_records` files
`_PARTIAL.json` lists). They are stored with the new job in one transaction (`retry_records`);
the planner pins the old job's objects and plans only them, and verification checks that each
appears exactly once in the new output. Lineage: the new job's `retry_of`, the old job's
`retries` (status objects, `_MANIFEST.json` / `_PARTIAL.json`).
"""

from __future__ import annotations

import json

from batchinf.errors import BatchinfError, LedgerError, ManifestError, NotFoundError
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import retry_records
from batchinf.ledger.models import Job
from batchinf.ledger.states import JOB_TERMINAL
from batchinf.ledger.status import status
from batchinf.parts import read_table
from batchinf.store import get_store, join
from batchinf.scopes import Caller
from batchinf.submit import submit

ALL = "all"
LINEAGE_FILES = ("_MANIFEST.json", "_PARTIAL.json")


class RerunConflict(LedgerError):
    """The job cannot be rerun in its current state (it is still active)."""


def select_records(job_id: str, codes: list[str] | None, not_done: bool) -> list[tuple[str, int]] | None:
    """The (source, ordinal) records to run again, sorted; None means every pinned record (the
    job never got as far as planning shards)."""
    chosen: set[tuple[str, int]] = set()
    if codes is not None:
        chosen.update(retry_records.error_records(job_id, None if ALL in codes else codes))
    if not_done:
        if not retry_records.has_shards(job_id):
            return None
        for uri in retry_records.unfinished_shard_files(job_id):
            try:
                t = read_table(uri, columns=["source", "ordinal"])
            except (OSError, BatchinfError) as exc:
                raise ManifestError(f"cannot read the staged records {uri} of job {job_id}'s unfinished "
                                    f"shard ({exc}); its work prefix may have been deleted") from exc
            chosen.update(zip(t.column("source").to_pylist(), (int(o) for o in t.column("ordinal").to_pylist())))
    return sorted(chosen)


def rerun_job(old: Job, caller: Caller, *, errors: list[str] | None = None, not_done: bool = False,
              output: str | None = None) -> str:
    """Create the retry job for `caller` (through `submit`, like every job: a tenant's request is
    confined, so its `output` must be a prefix it may write) and record the lineage; returns the
    new job's id."""
    job_id = old.id
    if caller.tenant != old.tenant:
        raise NotFoundError(f"no job {job_id!r}")
    if old.status not in JOB_TERMINAL:
        raise RerunConflict(f"job {job_id} is {old.status}; retry runs over a finished job: wait for it, "
                            f"or `batchinf cancel {job_id}` first")
    if errors is None and not not_done:
        raise ManifestError("say what to run again: --errors CODE,... (or --errors all) for error rows, "
                            "and/or --not-done for records that never finished")
    selection = select_records(job_id, errors, not_done)
    if selection == []:
        what = " and ".join(w for w in (f"no error rows with code {', '.join(errors)}" if errors else "",
                                        "no unfinished records" if not_done else "") if w)
        raise ManifestError(f"nothing to retry: job {job_id} has {what}")
    n = len(status(job_id)["retries"]) + 1
    out = output or old.output_uri.rstrip("/") + f"-retry-{n}/"
    manifest = old.manifest.model_copy(update={
        "output_uri": out, "bundle": old.bundle_digest, "idempotency_key": f"retry-{n}-of-{job_id}"})
    new_id, _ = submit(manifest, caller, retry_of=job_id, selection=selection)
    _note_retry(old.output_uri, {"job_id": new_id, "output_uri": job_repo.get(new_id).output_uri})
    return new_id


def _note_retry(output_uri: str, entry: dict[str, str]) -> None:
    """Add the retry to the `retries` list of the old job's _MANIFEST.json or _PARTIAL.json."""
    store = get_store(output_uri)
    for name in LINEAGE_FILES:
        uri = join(output_uri, name)
        if store.exists(uri):
            doc = json.loads(store.get_bytes(uri))
            doc["retries"] = [r for r in doc.get("retries", []) if r.get("job_id") != entry["job_id"]] + [entry]
            store.put_bytes(uri, json.dumps(doc, indent=1).encode())
