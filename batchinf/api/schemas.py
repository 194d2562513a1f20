"""Response models: the OpenAPI document is generated from these, and every response is validated
against them. `JobView` mirrors `jobs.status()` field for field (a test holds them equal)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ShardCounts(BaseModel):
    total: int
    done: int = Field(description="committed + quarantined")
    committed: int
    running: int
    pending: int = Field(description="pending, queued or retrying")
    quarantined: int
    failed: int


class RecordCounts(BaseModel):
    records_total: int | None = Field(description="known once planning finished")
    records_done: int
    records_succeeded: int
    records_failed: int


class Tokens(BaseModel):
    input: int
    real: int
    padded: int = Field(description="token positions computed, padding included")
    padding_efficiency: float | None = Field(description="real / padded")


class Progress(BaseModel):
    elapsed_seconds: float | None = Field(description="since planning started")
    records_per_second: float | None
    tokens_per_second: float | None
    eta_seconds: float | None = Field(description="remaining records at the rate so far; null when "
                                      "finished or unknown")
    steps_done: int | None = Field(None, description="denoising steps x images done (generate_image: committed "
                                   "shards' and running attempts' so far); null for a task without steps")
    steps_planned: int | None = Field(None, description="denoising steps x images the plan counted; null for a "
                                      "task without steps")
    audio_seconds_done: int | None = Field(None, description="seconds of audio transcribed (transcribe: committed "
                                           "shards' and running attempts' so far); null for a task without audio")
    audio_seconds_planned: int | None = Field(None, description="seconds of audio the plan counted (each staged "
                                              "file or piece in whole seconds); null for a task without audio")
    audio_seconds_per_second: float | None = Field(None, description="audio seconds transcribed per second since "
                                                   "planning started (the ETA of a transcribe job is the audio "
                                                   "left at this rate)")


class Cost(BaseModel):
    price_per_worker_hour: float
    total: float
    per_1000_records: float | None


class ErrorSummary(BaseModel):
    records: int = Field(description="error rows committed so far")
    by_code: dict[str, int]


class WorkerPhases(BaseModel):
    worker: str = Field(description="host:pid")
    start: float | None = Field(description="its process spawned -> ready (imports done); null unless an "
                                "embedded driver started it")
    model_load: float | None = Field(description="seconds it spent loading the job's bundle")
    busy: float | None = Field(description="seconds it ran the job's shards (its attempts); null while the job runs")
    idle: float | None = Field(description="up within the job (spawned, or the execute phase's start, -> every "
                               "shard done) and neither starting, loading nor running a shard; null while the job runs")
    shards: int | None = Field(description="attempts it ran of the job's shards; null while the job runs")


class Phases(BaseModel):
    """Where the job's wall time goes (batchinf/phases.py): consecutive phases, seconds to the ms,
    null where not reached or not measured; they sum to `wall` when all are measured."""
    wall: float | None = Field(description="the creating process's start (else the job's creation) -> published "
                               "or ended; null while the job runs (as is the phase in progress)")
    startup: float | None = Field(description="the creating process's start -> the job's creation (`batchinf run`, "
                                  "`submit`); null when created another way")
    pin: float | None = Field(description="-> inputs pinned")
    plan: float | None = Field(description="-> shards planned")
    pool_start: float | None = Field(description="-> the first ready worker started, past planning")
    model_load: float | None = Field(description="-> it had the bundle loaded, past planning")
    execute: float | None = Field(description="-> every shard done")
    publish: float | None = Field(description="-> published (verified, _MANIFEST.json written), or ended")
    workers: list[WorkerPhases]


class JobView(BaseModel):
    job_id: str
    name: str
    status: str
    tenant: str
    task: str
    output_uri: str
    input_uri: str
    bundle: str = Field(description="the bundle reference as submitted")
    bundle_digest: str = Field(description="what the job runs, resolved at submit")
    engine: str = Field("native", description="what executes the bundle (native, vllm, openai-http), resolved at submit")
    device: str = Field("any", description="the device its shards need (any, cpu, cuda), resolved at submit")
    waiting: str | None = Field(None, description="while shards are queued and none runs: what they wait for (a "
                                "worker with the job's engine and device)")
    schedule: str | None
    idempotency_key: str | None
    priority: int
    shards: ShardCounts
    counts: RecordCounts
    tokens: Tokens
    progress: Progress
    worker_seconds: float = Field(description="sum of the durations of every attempt of every shard")
    cost: Cost | None = Field(description="present when BATCHINF_PRICE_PER_WORKER_HOUR is set")
    errors: ErrorSummary
    summary: dict[str, Any] | None = Field(description="once published, the task's summary of its results, as in "
                                           "_MANIFEST.json counts: `labels` (classify, classify_image: records "
                                           "per label), `score_histogram` and `scores` (score), `audio_seconds` "
                                           "and `pieces` (transcribe: files stitched from pieces, counted in "
                                           "`counts` once published)")
    phases: Phases = Field(description="where its wall time goes, as in _MANIFEST.json `phases` once it ended")
    error: str | None = Field(description="why the job failed or stopped")
    deadline_at: float | None = Field(description="UNIX seconds, like every timestamp here")
    created_at: float
    updated_at: float
    started_at: float | None
    finished_at: float | None
    retry_of: str | None = Field(description="the job this one retries (`batchinf retry`)")
    retries: list[str] = Field(description="the jobs that retry this one, oldest first")


class JobPage(BaseModel):
    items: list[JobView]
    next_cursor: str | None = Field(description="pass as cursor= for the next page; null on the last")
    next: str | None = Field(description="the next page's URL path and query")


class Shard(BaseModel):
    id: str
    bucket: int = Field(description="length bucket; -1 holds records that failed validation")
    ordinal: int
    parent_id: str | None
    status: str
    attempt: int
    num_records: int
    num_tokens: int
    output_rows: int | None
    error_rows: int | None
    tokens_real: int | None
    tokens_padded: int | None
    execute_seconds: float | None
    last_error: str | None
    lease_owner: str | None
    lease_expires_at: float | None
    updated_at: float


class ShardPage(BaseModel):
    items: list[Shard]
    next_cursor: str | None
    next: str | None


class RecordError(BaseModel):
    shard_id: str
    record_id: str | None
    source: str
    ordinal: int
    error: str = Field(description="a code such as malformed_json, missing_id, too_long, poison")
    message: str
    attempts: int


class ErrorPage(BaseModel):
    items: list[RecordError]
    next_cursor: str | None
    next: str | None


class Bundle(BaseModel):
    """A bundle as a tenant sees it: no `uri` (where the server keeps its files is the operator's business)."""
    digest: str
    name: str
    task: str
    family: str
    created_at: float
    aliases: list[str]


class Health(BaseModel):
    status: str
    ledger: str


class ErrorBody(BaseModel):
    error: str = Field(description="a stable code: unauthorized, not_found, invalid_manifest, ...")
    message: str = Field(description="what went wrong and how to fix it")


class Attempt(BaseModel):
    shard_id: str
    bucket: int
    shard_ordinal: int
    number: int = Field(description="the attempt number (its fencing token)")
    worker: str
    status: str = Field(description="running, committed, failed, lost, superseded or swept")
    outcome: str = Field(description="what the shard timeline shows: running, committed, retried, failed, "
                                     "lost, quarantined or superseded (a swept loser: what it lost as)")
    started_at: float
    heartbeat_at: float | None
    finished_at: float | None
    error: str | None


class AttemptPage(BaseModel):
    items: list[Attempt]
    next_cursor: str | None
    next: str | None


class ThroughputPoint(BaseModel):
    t: float = Field(description="start of the interval, UNIX seconds")
    records: int = Field(description="records of shards committed in the interval")
    tokens: int
    records_per_second: float


class Throughput(BaseModel):
    job_id: str
    start: float
    end: float
    interval_seconds: float
    points: list[ThroughputPoint]


class RetryRequest(BaseModel):
    """What to run again: error rows of these codes (["all"]: every code) and/or the records of
    shards that never finished."""
    errors: list[str] | None = Field(None, description="error codes, or [\"all\"]")
    not_done: bool = Field(False, description="also the records of shards that did not finish")
    output: str | None = Field(None, description="the new output prefix; default: the old one + -retry-N/")
