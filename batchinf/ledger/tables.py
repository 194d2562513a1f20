"""Ledger tables (SQLAlchemy Core). Times are UNIX epoch seconds (float) for portable arithmetic.

The schema is created by Alembic (migrations/), never by `metadata.create_all`.
"""

from __future__ import annotations

from sqlalchemy import (Boolean, Column, Float, ForeignKey, Index, Integer, BigInteger, MetaData,
                        String, Table, Text, UniqueConstraint)

metadata = MetaData()

bundles = Table(
    "bundles", metadata,
    Column("digest", String(71), primary_key=True),       # "sha256:<64 hex>" of bundle.json
    Column("name", String(200), nullable=False, index=True),
    Column("uri", Text, nullable=False),                  # where the bundle's files live
    Column("task", String(32), nullable=False),
    Column("family", String(32), nullable=False),
    Column("meta", Text, nullable=False),                 # bundle.json, verbatim
    Column("created_at", Float, nullable=False),
)

bundle_aliases = Table(
    "bundle_aliases", metadata,
    Column("name", String(200), primary_key=True),
    Column("alias", String(200), primary_key=True),
    Column("digest", String(71), ForeignKey("bundles.digest"), nullable=False),
    Column("updated_at", Float, nullable=False),
)

jobs = Table(
    "jobs", metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant", String(100), nullable=False, default="default"),
    Column("name", String(200), nullable=False),
    Column("idempotency_key", String(300), nullable=True),
    Column("status", String(16), nullable=False),
    Column("task", String(32), nullable=False),
    Column("manifest", Text, nullable=False),             # the validated manifest as JSON
    Column("bundle_ref", String(300), nullable=False),    # as written by the user
    Column("bundle_digest", String(71), ForeignKey("bundles.digest"), nullable=False),
    Column("input_uri", Text, nullable=False),
    Column("output_uri", Text, nullable=False),
    Column("work_uri", Text, nullable=False),             # staging + attempt files
    Column("priority", Integer, nullable=False, default=0),
    Column("deadline_at", Float, nullable=True),
    Column("schedule", String(200), nullable=True),
    Column("error", Text, nullable=True),
    Column("plan", Text, nullable=True),                  # bucket bounds and planning stats (JSON)
    Column("records_total", BigInteger, nullable=True),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("started_at", Float, nullable=True),
    Column("finished_at", Float, nullable=True),
    Column("plan_seconds", Float, nullable=True),
    Column("verify_seconds", Float, nullable=True),
    Column("lock_owner", String(200), nullable=True),      # controller holding the job's lease
    Column("lock_expires_at", Float, nullable=True),
    Column("failed_attempts", Integer, nullable=False, default=0),   # attempts that raised: the retry budget
    Column("step_failures", Integer, nullable=False, default=0),     # consecutive failed lifecycle steps
    Column("confined", Boolean, nullable=False, default=False),      # storage checked against the tenant's grants
    Column("retry_of", String(40), nullable=True, index=True),       # the job this one retries (batchinf retry)
    Column("summary", Text, nullable=True),    # the task's summary of its published results (JSON)
    Column("hold", Boolean, nullable=False, default=False),          # a dry run: planned, then held (`batchinf plan`)
    Column("engine", String(32), nullable=False, default="native", server_default="native"),  # what executes it
    Column("device", String(16), nullable=False, default="any", server_default="any"),  # any | cpu | cuda: where
    Column("error_records", BigInteger, nullable=False, default=0),  # failed records so far: validation errors
                                                                     # at planning, then error rows as shards commit
    Column("phases", Text, nullable=True),     # where its wall time goes: marks, then phases (JSON; batchinf/phases.py)
    UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency"),
    Index("ix_jobs_status", "status"),
    Index("ix_jobs_tenant_created", "tenant", "created_at"),
)

job_inputs = Table(
    "job_inputs", metadata,
    Column("job_id", String(40), ForeignKey("jobs.id"), primary_key=True),
    Column("idx", Integer, primary_key=True),             # position in the pinned, sorted list
    Column("uri", Text, nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("etag", String(200), nullable=False),
    Column("version_id", String(300), nullable=True),
    Column("records", BigInteger, nullable=True),         # filled by planning
    Column("dispatched_at", Float, nullable=True),        # last planning task sent (distributed)
    Column("attempts", Integer, nullable=False, server_default="0"),  # planning attempts started
    Column("started_at", Float, nullable=True),           # when the last planning attempt started
    Column("error", Text, nullable=True),                 # why the last planning attempt failed
)

shards = Table(
    "shards", metadata,
    Column("id", String(40), primary_key=True),           # deterministic: job, bucket, ordinal, records
    Column("job_id", String(40), ForeignKey("jobs.id"), nullable=False),
    Column("bucket", Integer, nullable=False),            # -1: records that failed validation
    Column("ordinal", Integer, nullable=False),
    Column("parent_id", String(40), nullable=True),       # a quarantined shard this one was split from
    Column("status", String(16), nullable=False),
    Column("attempt", Integer, nullable=False, default=0),  # fencing token of the current lease
    Column("num_records", Integer, nullable=False),
    Column("num_tokens", BigInteger, nullable=False),
    Column("input_uri", Text, nullable=False),            # staged token ids (Parquet)
    Column("lease_owner", String(200), nullable=True),
    Column("lease_expires_at", Float, nullable=True),
    Column("not_before", Float, nullable=True),           # retry backoff
    Column("dispatched_at", Float, nullable=True),        # last broker message sent
    Column("output_uri", Text, nullable=True),            # winning attempt's files
    Column("output_sha256", String(64), nullable=True),
    Column("output_rows", Integer, nullable=True),
    Column("errors_uri", Text, nullable=True),
    Column("errors_sha256", String(64), nullable=True),
    Column("error_rows", Integer, nullable=True),
    Column("tokens_input", BigInteger, nullable=True),
    Column("tokens_output", BigInteger, nullable=True),
    Column("tokens_real", BigInteger, nullable=True),
    Column("tokens_padded", BigInteger, nullable=True),
    Column("execute_seconds", Float, nullable=True),
    Column("progress_records", Integer, nullable=False, default=0),  # records done by the running attempt
                                                                      # (its heartbeats; migration 0009)
    # progress units (Task.progress_unit: denoising steps x images, audio seconds): the running
    # attempt's so far (its heartbeats), a committed shard's its records' planned (migration 0017)
    Column("progress_steps", BigInteger, nullable=False, default=0),
    Column("split_requested_at", Float, nullable=True),   # the lifecycle asked the running attempt to split
    Column("last_error", Text, nullable=True),
    Column("updated_at", Float, nullable=False),
    UniqueConstraint("job_id", "bucket", "ordinal", name="uq_shards_job_bucket_ordinal"),
    Index("ix_shards_job_status", "job_id", "status"),
)

Index("ix_shards_parent", shards.c.parent_id)      # a quarantined or split shard's children

# dispatch order within a job's pending (or retrying) shards: a ranged index scan, no sort
Index("ix_shards_dispatch_order", shards.c.job_id, shards.c.status, shards.c.bucket.desc(), shards.c.ordinal)

attempts = Table(
    "attempts", metadata,
    Column("shard_id", String(40), ForeignKey("shards.id"), primary_key=True),
    Column("number", Integer, primary_key=True),
    Column("worker", String(200), nullable=False),
    Column("status", String(16), nullable=False),         # running | committed | lost | failed | stale
    Column("started_at", Float, nullable=False),
    Column("heartbeat_at", Float, nullable=True),
    Column("finished_at", Float, nullable=True),
    Column("error", Text, nullable=True),
    Column("host", String(200), nullable=True),         # its worker's failure domain (Celery node, else machine)
    Column("computing_at", Float, nullable=True),       # set while it runs the shard's records (not loading or writing)
    Column("load_seconds", Float, nullable=True),       # the bundle load its worker paid for it (committed attempts)
)

# the attempts still running: a job's live worker seconds without a scan of its finished ones
Index("ix_attempts_open", attempts.c.shard_id, postgresql_where=attempts.c.finished_at.is_(None),
      sqlite_where=attempts.c.finished_at.is_(None))

record_errors = Table(
    "record_errors", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(40), ForeignKey("jobs.id"), nullable=False),
    Column("shard_id", String(40), ForeignKey("shards.id"), nullable=False),
    Column("record_id", Text, nullable=True),
    Column("source", Text, nullable=False),
    Column("ordinal", BigInteger, nullable=False),
    Column("error", String(64), nullable=False),
    Column("message", Text, nullable=False),
    Column("attempts", Integer, nullable=False),
    Index("ix_record_errors_job", "job_id", "id"),
)

# Running totals per job (migration 0014's triggers keep them; `ledger/tallies.py` reads them), so
# status and the tick cost what changed, not the job's size. key: "s:<status>" computed shards,
# "v:<status>" validation-error shards (bucket < 0), "e:<code>" record errors, "w" finished attempts.
TALLY_SUMS = ("n", "records", "output_rows", "error_rows", "tokens_input", "tokens_real", "tokens_padded",
              "execute_seconds", "worker_seconds")


def _tally_columns() -> list[Column]:
    return [Column(name, Float if name.endswith("seconds") else BigInteger, nullable=False,
                   server_default="0") for name in TALLY_SUMS]


job_tallies = Table(
    "job_tallies", metadata,
    Column("job_id", String(40), primary_key=True),
    Column("key", String(80), primary_key=True),
    *_tally_columns(),
)

# PostgreSQL's triggers append here (inserts never wait on each other); the running tick folds
# them into job_tallies (`tallies.compact`). SQLite's triggers write job_tallies directly.
job_tally_deltas = Table(
    "job_tally_deltas", metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("job_id", String(40), nullable=False),
    Column("key", String(80), nullable=False),
    *_tally_columns(),
    Index("ix_job_tally_deltas_job", "job_id"),
)

retry_records = Table(
    "retry_records", metadata,                            # a retry job plans exactly these records
    Column("job_id", String(40), ForeignKey("jobs.id"), primary_key=True),
    Column("source", Text, primary_key=True),             # the pinned input object's uri
    Column("ordinal", BigInteger, primary_key=True),      # the record's index in that object
)

job_events = Table(
    "job_events", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(40), ForeignKey("jobs.id"), nullable=False),
    Column("shard_id", String(40), nullable=True),
    Column("kind", String(32), nullable=False),           # job | shard | attempt | note
    Column("from_status", String(16), nullable=True),
    Column("to_status", String(16), nullable=True),
    Column("detail", Text, nullable=True),
    Column("at", Float, nullable=False),
    Index("ix_job_events_job", "job_id", "id"),
)

schedules = Table(
    "schedules", metadata,
    Column("name", String(200), primary_key=True),
    Column("tenant", String(100), nullable=False, default="default"),
    Column("cron", String(100), nullable=False),
    Column("timezone", String(64), nullable=False, default="UTC"),
    Column("template", Text, nullable=False),
    Column("catchup", Boolean, nullable=False, default=True),
    Column("paused", Boolean, nullable=False, default=False),
    Column("created_at", Float, nullable=False),
    Column("start_at", Float, nullable=True),             # first fire time considered (default created_at)
)

schedule_runs = Table(
    "schedule_runs", metadata,
    Column("schedule", String(200), ForeignKey("schedules.name"), primary_key=True),
    Column("ds", String(10), primary_key=True),           # logical date YYYY-MM-DD: one job per date
    Column("job_id", String(40), ForeignKey("jobs.id"), nullable=False),
    Column("created_at", Float, nullable=False),
)

api_tokens = Table(
    "api_tokens", metadata,
    Column("id", String(40), primary_key=True),           # public handle for list/revoke
    Column("tenant", String(100), nullable=False, index=True),
    Column("name", String(200), nullable=True),
    Column("token_sha256", String(64), nullable=False),   # the token itself is never stored
    Column("created_at", Float, nullable=False),
    Column("last_used_at", Float, nullable=True),
    Column("revoked_at", Float, nullable=True),
    UniqueConstraint("token_sha256", name="uq_api_tokens_sha256"),
)

tenant_grants = Table(
    "tenant_grants", metadata,
    Column("tenant", String(100), primary_key=True),
    Column("prefix", Text, primary_key=True),             # canonical uri prefix, ending in '/' (file://: real path)
    Column("mode", String(8), primary_key=True),          # read | write (write implies read)
    Column("created_at", Float, nullable=False),
)

tenant_limits = Table(
    "tenant_limits", metadata,
    Column("tenant", String(100), primary_key=True),
    Column("name", String(64), primary_key=True),         # a limit of config.LIMITS
    Column("value", BigInteger, nullable=False),
)

files = Table(
    "files", metadata,
    Column("id", String(40), primary_key=True),           # file-<hex>: OpenAI-style file id
    Column("tenant", String(100), nullable=False),
    Column("filename", String(300), nullable=False),
    Column("purpose", String(32), nullable=False),        # batch (uploaded) | batch_output (a batch's output)
    Column("bytes", BigInteger, nullable=False),
    Column("uri", Text, nullable=True),                   # an uploaded file's object
    Column("parts", Text, nullable=True),                 # a batch output file: JSON list of object uris, in order
    Column("meta", Text, nullable=True),                  # what the upload's line-by-line scan found (JSON)
    Column("created_at", Float, nullable=False),
    Column("deleted_at", Float, nullable=True),
    Index("ix_files_tenant_created", "tenant", "created_at"),
)

batches = Table(
    "batches", metadata,
    Column("id", String(40), primary_key=True),           # batch_<hex>
    Column("tenant", String(100), nullable=False),
    Column("input_file_id", String(40), nullable=False),
    Column("endpoint", String(64), nullable=False),
    Column("completion_window", String(32), nullable=False),
    Column("model", String(300), nullable=True),          # the bundle reference the lines named
    Column("metadata", Text, nullable=True),              # the caller's metadata (JSON)
    Column("job_id", String(40), ForeignKey("jobs.id"), nullable=True),   # null: failed validation
    Column("errors", Text, nullable=True),                # validation errors (JSON list)
    Column("output_file_id", String(40), nullable=True),
    Column("error_file_id", String(40), nullable=True),
    Column("created_at", Float, nullable=False),
    Column("failed_at", Float, nullable=True),
    Column("cancelling_at", Float, nullable=True),
    Column("finalized_at", Float, nullable=True),         # output and error files recorded
    Index("ix_batches_tenant_created", "tenant", "created_at"),
)
