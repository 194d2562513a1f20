"""What the ledger's reads return: frozen domain objects, never rows. A `Job` carries its
manifest, parsed once per process (`parsed_manifest`), so the stages that take it never re-read
or re-parse the job."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any

from batchinf.checks import clip
from batchinf.engines import Route
from batchinf.manifest import JobManifest, manifest_from_dict
from batchinf.store import ObjectPin


def _from_mapping(cls: type, m: Any) -> Any:
    return cls(**{f.name: m[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class Job:
    id: str
    tenant: str
    name: str
    idempotency_key: str | None
    status: str
    task: str
    manifest_json: str                # as stored at submit; `manifest` is it, parsed
    bundle_ref: str
    bundle_digest: str
    input_uri: str
    output_uri: str
    work_uri: str
    priority: int
    deadline_at: float | None
    schedule: str | None
    error: str | None
    plan: dict[str, Any]              # bucket bounds and planning stats
    records_total: int | None
    created_at: float
    updated_at: float
    started_at: float | None
    finished_at: float | None
    plan_seconds: float | None
    verify_seconds: float | None
    failed_attempts: int
    step_failures: int
    confined: bool                    # its storage is checked against the tenant's grants
    retry_of: str | None              # the job this one retries (`batchinf retry`)
    hold: bool = False                # a dry run's job: planning ends `planned`, not `running`
    engine: str = "native"            # what executes its shards (batchinf/engines): native | vllm | openai-http
    device: str = "any"               # the device its shards need: any | cpu | cuda (engines.job_device)
    phases: dict[str, Any] = field(default_factory=dict)   # where its wall time goes: marks (batchinf/phases.py)

    @property
    def route(self) -> Route:
        return Route(self.engine, self.device)

    @property
    def manifest(self) -> JobManifest:
        return parsed_manifest(self.manifest_json)

    @classmethod
    def from_row(cls, row: Any) -> Job:
        m = dict(row._mapping)
        m["manifest_json"] = m["manifest"]
        m["plan"] = json.loads(m["plan"] or "{}")
        m["phases"] = json.loads(m["phases"] or "{}")
        return _from_mapping(cls, m)


@lru_cache(maxsize=256)
def parsed_manifest(text: str) -> JobManifest:
    """A job's manifest as stored, parsed once per process for each stored text (at the first
    use, not at each read of the row): it was validated at submit (`submit.submit`, the choke
    point) and a job's manifest never changes, so every later read of the row shares one parsed
    model (never mutated: stages only read it)."""
    return manifest_from_dict(json.loads(text))


@dataclass(frozen=True)
class InputObject:
    """One pinned input object of a job, in pinned order."""
    idx: int
    pin: ObjectPin
    records: int | None          # filled by planning
    dispatched_at: float | None  # last planning task sent (distributed)
    attempts: int = 0            # planning attempts started
    started_at: float | None = None  # when the last one started
    error: str | None = None     # why the last one failed (None: it succeeded, runs, or died silently)

    @classmethod
    def from_row(cls, row: Any) -> InputObject:
        return cls(row.idx, ObjectPin(uri=row.uri, size=row.size, etag=row.etag, version_id=row.version_id),
                   row.records, row.dispatched_at, row.attempts, row.started_at, row.error)


@dataclass(frozen=True)
class Shard:
    id: str
    job_id: str
    bucket: int
    ordinal: int
    parent_id: str | None
    status: str
    attempt: int
    num_records: int
    num_tokens: int
    input_uri: str
    lease_owner: str | None
    lease_expires_at: float | None
    output_uri: str | None
    output_sha256: str | None
    output_rows: int | None
    errors_uri: str | None
    errors_sha256: str | None
    error_rows: int | None
    tokens_input: int | None
    tokens_output: int | None
    tokens_real: int | None
    tokens_padded: int | None
    execute_seconds: float | None
    last_error: str | None
    updated_at: float

    @classmethod
    def from_row(cls, row: Any) -> Shard:
        return _from_mapping(cls, row._mapping)


@dataclass(frozen=True)
class Lease:
    """A claimed attempt: its identity (shard, job, fencing token, worker) and what its worker
    runs, read in the claim's own transaction, so the worker never reads them again."""
    shard_id: str
    job_id: str
    attempt: int          # fencing token
    worker: str
    shard: Shard = field(compare=False, repr=False)    # as the claim left it (running)
    job: Job = field(compare=False, repr=False)


@dataclass(frozen=True)
class ShardResult:
    output_uri: str
    output_sha256: str
    output_rows: int
    errors_uri: str
    errors_sha256: str
    error_rows: int
    tokens_input: int
    tokens_output: int
    tokens_real: int
    tokens_padded: int
    execute_seconds: float
    errors: list[dict]    # record error rows: record_id, source, ordinal, error, message, attempts
    progress: int = 0     # its records' planned progress units (Task.progress_unit; else 0)
    load_seconds: float = 0.0   # the bundle load its worker paid for it (the first attempt a worker runs of a bundle)


@dataclass(frozen=True)
class Demand:
    """A running job's claim on dispatch slots (see lifecycle.share_slots)."""
    job_id: str
    priority: int
    deadline_at: float | None
    created_at: float
    in_flight: int        # queued or running shards
    ready: int            # shards that could be queued now
    route: Route = Route()  # the workers that can run them (its engine and device)


@dataclass(frozen=True)
class BundleInfo:
    digest: str
    name: str
    uri: str
    task: str
    family: str
    created_at: float
    aliases: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "name": self.name, "uri": self.uri, "task": self.task,
                "family": self.family, "created_at": self.created_at, "aliases": list(self.aliases)}


ERROR_ID_CHARS = 1024          # an error row keeps this much of a record id ...
ERROR_MESSAGE_CHARS = 4096     # ... and of its message; the full length is noted in the cut


def bounded_error(row: dict[str, Any]) -> dict[str, Any]:
    """An error row with its record id and message cut to their bounds: three records with 8 MB
    ids would otherwise put 48 MB into record_errors and into every GET of their page."""
    return {**row, "record_id": clip(row.get("record_id"), ERROR_ID_CHARS),
            "message": clip(row.get("message"), ERROR_MESSAGE_CHARS) or ""}
