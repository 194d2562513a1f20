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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Rerun:
    job_id: str                             # the new job
    input_errors: dict[str, int]            # the old job's input errors by code, not run again


def _input_codes_refused(job_id: str, codes: list[str], input_errors: dict[str, int]) -> None:
    """Codes asked for by name that only input errors have: running them again cannot change them."""
    named = [c for c in codes if c in input_errors and not retry_records.error_records(job_id, [c])]
    if named:
        raise ManifestError(
            f"{', '.join(named)} {'is an input error' if len(named) == 1 else 'are input errors'} of job {job_id}: "
            "planning refused those records, and the same pinned input gives the same error again. Fix the "
            "input and submit it as a new job (with a new idempotency_key); the job output's errors/ rows "
            f"(or GET /v1/jobs/{job_id}/errors?code={named[0]}) name each record and its fix")


def select_records(job_id: str, codes: list[str] | None, not_done: bool) -> list[tuple[str, int]] | None:
    """The (source, ordinal) records to run again, sorted; None means every pinned record (the
    job never got as far as planning shards). Input errors are never selected (`Rerun`)."""
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
              output: str | None = None) -> Rerun:
    """Create the retry job for `caller` (through `submit`, like every job: a tenant's request is
    confined, so its `output` must be a prefix it may write) and record the lineage."""
    job_id = old.id
    if caller.tenant != old.tenant:
        raise NotFoundError(f"no job {job_id!r}")
    if old.status not in JOB_TERMINAL:
        raise RerunConflict(f"job {job_id} is {old.status}; retry runs over a finished job: wait for it, "
                            f"or `batchinf cancel {job_id}` first")
    if errors is None and not not_done:
        raise ManifestError("say what to run again: --errors CODE,... (or --errors all) for error rows, "
                            "and/or --not-done for records that never finished")
    input_errors = retry_records.input_error_counts(job_id) if errors else {}
    if errors and ALL not in errors:
        _input_codes_refused(job_id, errors, input_errors)
    selection = select_records(job_id, errors, not_done)
    if selection == []:
        what = " and ".join(w for w in (f"no error rows with code {', '.join(errors)}" if errors else "",
                                        "no unfinished records" if not_done else "") if w)
        if input_errors:
            what += f" (only input errors, which a retry cannot change: {_counts(input_errors)})"
        raise ManifestError(f"nothing to retry: job {job_id} has {what}")
    n = len(status(job_id)["retries"]) + 1
    out = output or old.output_uri.rstrip("/") + f"-retry-{n}/"
    manifest = old.manifest.model_copy(update={
        "output_uri": out, "bundle": old.bundle_digest, "idempotency_key": f"retry-{n}-of-{job_id}"})
    new_id, _ = submit(manifest, caller, retry_of=job_id, selection=selection)
    _note_retry(old.output_uri, {"job_id": new_id, "output_uri": job_repo.get(new_id).output_uri})
    return Rerun(new_id, input_errors if errors and ALL in errors else {})


def _counts(by_code: dict[str, int]) -> str:
    return ", ".join(f"{code}: {n}" for code, n in by_code.items())


def input_errors_note(rerun: Rerun) -> str | None:
    """What `--errors all` left out, for the CLI to say."""
    if not rerun.input_errors:
        return None
    return (f"not retried: {sum(rerun.input_errors.values())} input errors ({_counts(rerun.input_errors)}); "
            "the same pinned input gives the same errors again: fix the input and submit a new job")


def _note_retry(output_uri: str, entry: dict[str, str]) -> None:
    """Add the retry to the `retries` list of the old job's _MANIFEST.json or _PARTIAL.json."""
    store = get_store(output_uri)
    for name in LINEAGE_FILES:
        uri = join(output_uri, name)
        if store.exists(uri):
            doc = json.loads(store.get_bytes(uri))
            doc["retries"] = [r for r in doc.get("retries", []) if r.get("job_id") != entry["job_id"]] + [entry]
            store.put_bytes(uri, json.dumps(doc, indent=1).encode())
