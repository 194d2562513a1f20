"""Settings from the environment: the one place batchinf reads environment variables.

`settings()` loads them once per process (a forked child loads them afresh); tests change
variables, then call `settings.cache_clear()`. An empty variable counts as unset. A value that
cannot be used raises ConfigError naming the variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from batchinf.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Settings:
    # --- where state lives
    home: Path                      # BATCHINF_HOME: embedded ledger, bundle store, caches
    database_url: str               # BATCHINF_DATABASE_URL; default SQLite under home
    broker_url: str                 # BATCHINF_BROKER_URL (distributed mode)
    bundle_store: str               # BATCHINF_BUNDLE_STORE: where imported bundles live
    max_expansion: int              # BATCHINF_MAX_EXPANSION: a compressed input may expand this many times
    # --- leases, retries, speculation
    lease_seconds: float            # BATCHINF_LEASE_SECONDS: a shard lease not heartbeated this long is expired
    heartbeat_seconds: float        # BATCHINF_HEARTBEAT_SECONDS: how often a running shard renews its lease
    max_attempts: int               # BATCHINF_MAX_ATTEMPTS: attempts per shard before it fails
    job_retry_budget: int           # BATCHINF_JOB_RETRY_BUDGET: failed attempts per job before it fails;
                                    # 0: max(10, shards)
    speculate_factor: float         # BATCHINF_SPECULATE_FACTOR: a tail shard running this many times its
    speculate_min_seconds: float    # bucket's median (and BATCHINF_SPECULATE_MIN_SECONDS at least) gets a
                                    # speculative attempt; 0: off
    max_step_failures: int          # BATCHINF_MAX_STEP_FAILURES: consecutive failed lifecycle steps of one job
                                    # before it fails (default 10)
    plan_time_limit: float          # BATCHINF_PLAN_TIME_LIMIT: seconds one planning task may run (distributed);
                                    # past it the task is stopped and counts as a failed attempt
    price_per_worker_hour: float | None  # BATCHINF_PRICE_PER_WORKER_HOUR: cost in status
    # --- distributed mode (Celery)
    queue: str                      # BATCHINF_QUEUE: the broker queue controllers send to, workers read
    visibility_timeout: int         # BATCHINF_VISIBILITY_TIMEOUT: seconds an unacked message waits before
                                    # redelivery; above the longest shard (a dead worker's lease expires sooner)
    device: str                     # BATCHINF_DEVICE: a Celery worker's device, auto | cpu | cuda (set by
                                    # `batchinf worker --device`)
    # --- object storage
    s3_endpoint_url: str | None     # BATCHINF_S3_ENDPOINT_URL: MinIO or another S3-compatible server; unset: AWS
    s3_region: str                  # AWS_DEFAULT_REGION, default us-east-1 (credentials: the usual AWS_* chain)
    # --- metrics
    metrics_token: str | None       # BATCHINF_METRICS_TOKEN: the bearer token /metrics requires; unset: open
    metrics_job_window: float       # BATCHINF_METRICS_JOB_WINDOW: seconds a finished job keeps its per-job series
    prometheus_multiproc_dir: str | None  # PROMETHEUS_MULTIPROC_DIR: set, a metrics server reports all forked
                                          # children (prometheus_client's multiprocess mode)
    # --- model runtime
    pack_weights: bool              # BATCHINF_PACK_WEIGHTS: CPU generation keeps an MKL-prepacked copy of the
                                    # weights; 0 saves that memory
    # --- fault injection (tests, chaos)
    failpoints: str                 # BATCHINF_FAILPOINTS: "point=action;..." (batchinf/failpoints.py)
    failpoints_seed: str | None     # BATCHINF_FAILPOINTS_SEED: seeds the probabilistic failpoints' draws

    @property
    def embedded(self) -> bool:
        return self.database_url.startswith("sqlite")


def _text(name: str) -> str | None:
    """The variable's value; None when it is unset or empty."""
    return os.environ.get(name) or None


def _float(name: str, default: float) -> float:
    value = _optional_float(name)
    return default if value is None else value


def _optional_float(name: str) -> float | None:
    raw = _text(name)
    try:
        return None if raw is None else float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number; set it to one or unset it") from None


def _int(name: str, default: int) -> int:
    raw = _text(name)
    try:
        return default if raw is None else int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; set it to one (default {default}) or unset it") from None


def _flag(name: str, default: bool) -> bool:
    raw = _text(name)
    if raw is None:
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a flag; set it to 1 or 0, or unset it")


@lru_cache(maxsize=1)
def settings() -> Settings:
    """This process's settings, loaded once (tests: settings.cache_clear() after changing variables)."""
    return load_settings()


def load_settings() -> Settings:
    """Settings read from the environment now, not cached."""
    home = Path(_text("BATCHINF_HOME") or ".batchinf").expanduser().resolve()
    return Settings(
        home=home,
        database_url=_text("BATCHINF_DATABASE_URL") or f"sqlite:///{home / 'ledger.db'}",
        broker_url=_text("BATCHINF_BROKER_URL") or "redis://127.0.0.1:6379/0",
        bundle_store=_text("BATCHINF_BUNDLE_STORE") or (home / "bundles").as_uri(),
        max_expansion=_int("BATCHINF_MAX_EXPANSION", 200),
        lease_seconds=_float("BATCHINF_LEASE_SECONDS", 60.0),
        heartbeat_seconds=_float("BATCHINF_HEARTBEAT_SECONDS", 5.0),
        max_attempts=_int("BATCHINF_MAX_ATTEMPTS", 3),
        job_retry_budget=_int("BATCHINF_JOB_RETRY_BUDGET", 0),
        speculate_factor=_float("BATCHINF_SPECULATE_FACTOR", 3.0),
        speculate_min_seconds=_float("BATCHINF_SPECULATE_MIN_SECONDS", 30.0),
        max_step_failures=_int("BATCHINF_MAX_STEP_FAILURES", 10),
        plan_time_limit=_float("BATCHINF_PLAN_TIME_LIMIT", 3600.0),
        price_per_worker_hour=_optional_float("BATCHINF_PRICE_PER_WORKER_HOUR"),
        queue=_text("BATCHINF_QUEUE") or "batchinf",
        visibility_timeout=_int("BATCHINF_VISIBILITY_TIMEOUT", 6 * 3600),
        device=_text("BATCHINF_DEVICE") or "auto",
        s3_endpoint_url=_text("BATCHINF_S3_ENDPOINT_URL"),
        s3_region=_text("AWS_DEFAULT_REGION") or "us-east-1",
        metrics_token=_text("BATCHINF_METRICS_TOKEN"),
        metrics_job_window=_float("BATCHINF_METRICS_JOB_WINDOW", 86400.0),
        prometheus_multiproc_dir=_text("PROMETHEUS_MULTIPROC_DIR"),
        pack_weights=_flag("BATCHINF_PACK_WEIGHTS", True),
        failpoints=_text("BATCHINF_FAILPOINTS") or "",
        failpoints_seed=_text("BATCHINF_FAILPOINTS_SEED"),
    )


# A forked child (a Celery prefork worker) loads its own: its parent may have cached settings
# before setting a variable for its children (`batchinf worker` sets BATCHINF_DEVICE so).
os.register_at_fork(after_in_child=settings.cache_clear)
