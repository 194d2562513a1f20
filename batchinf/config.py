"""Settings from the environment, loaded once per process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class Settings:
    home: Path                      # BATCHINF_HOME: embedded ledger, bundle store, caches
    database_url: str               # BATCHINF_DATABASE_URL; default SQLite under home
    broker_url: str                 # BATCHINF_BROKER_URL (distributed mode)
    bundle_store: str               # BATCHINF_BUNDLE_STORE: where imported bundles live
    max_expansion: int              # BATCHINF_MAX_EXPANSION: a compressed input may expand this many times
    lease_seconds: float            # a shard lease not heartbeated for this long is expired
    heartbeat_seconds: float
    max_attempts: int               # attempts per shard before it fails
    job_retry_budget: int           # failed attempts per job before it fails; 0: max(10, shards)
    speculate_factor: float         # a tail shard running this many times its bucket's median
    speculate_min_seconds: float    # (and at least this long) gets a speculative attempt; 0: off
    max_step_failures: int = 10     # consecutive failed lifecycle steps of one job before it fails
    price_per_worker_hour: float | None = None  # BATCHINF_PRICE_PER_WORKER_HOUR: cost in status
    files_uri: str = ""             # BATCHINF_FILES_URI: OpenAI API files and batch outputs, per tenant
    max_file_bytes: int = 200 << 20  # BATCHINF_MAX_FILE_BYTES: largest file POST /v1/files accepts
    openai_models: str = ""         # BATCHINF_OPENAI_MODELS: "gpt-4o-mini=smollm2@prod,..." model -> bundle
    openai_shard_records: int = 1000  # BATCHINF_OPENAI_SHARD_RECORDS: requests per shard of a batch's job

    @property
    def embedded(self) -> bool:
        return self.database_url.startswith("sqlite")


def _float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@lru_cache(maxsize=1)
def settings() -> Settings:
    home = Path(os.environ.get("BATCHINF_HOME", ".batchinf")).expanduser().resolve()
    return Settings(
        home=home,
        database_url=os.environ.get("BATCHINF_DATABASE_URL") or f"sqlite:///{home / 'ledger.db'}",
        broker_url=os.environ.get("BATCHINF_BROKER_URL", "redis://127.0.0.1:6379/0"),
        bundle_store=os.environ.get("BATCHINF_BUNDLE_STORE") or (home / "bundles").as_uri(),
        max_expansion=int(os.environ.get("BATCHINF_MAX_EXPANSION", 200)),
        lease_seconds=_float("BATCHINF_LEASE_SECONDS", 60.0),
        heartbeat_seconds=_float("BATCHINF_HEARTBEAT_SECONDS", 5.0),
        max_attempts=int(os.environ.get("BATCHINF_MAX_ATTEMPTS", 3)),
        job_retry_budget=int(os.environ.get("BATCHINF_JOB_RETRY_BUDGET", 0)),
        speculate_factor=_float("BATCHINF_SPECULATE_FACTOR", 3.0),
        speculate_min_seconds=_float("BATCHINF_SPECULATE_MIN_SECONDS", 30.0),
        max_step_failures=int(os.environ.get("BATCHINF_MAX_STEP_FAILURES", 10)),
        price_per_worker_hour=float(os.environ["BATCHINF_PRICE_PER_WORKER_HOUR"])
        if os.environ.get("BATCHINF_PRICE_PER_WORKER_HOUR") else None,
        files_uri=os.environ.get("BATCHINF_FILES_URI") or (home / "files").as_uri(),
        max_file_bytes=int(os.environ.get("BATCHINF_MAX_FILE_BYTES", 200 << 20)),
        openai_models=os.environ.get("BATCHINF_OPENAI_MODELS", ""),
        openai_shard_records=int(os.environ.get("BATCHINF_OPENAI_SHARD_RECORDS", 1000)),
    )
