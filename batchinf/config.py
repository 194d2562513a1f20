"""Settings from the environment: the one place batchinf reads environment variables.

`settings()` loads them once per process (a forked child loads them afresh); tests change
variables, then call `settings.cache_clear()`. An empty variable counts as unset. A value that
cannot be used raises ConfigError naming the variable.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from batchinf.errors import ConfigError

# Bounds on the numbers a tenant sets in a manifest: name -> (variable, default, what it bounds).
# The variable sets the operator's default; `batchinf tenant limit TENANT NAME VALUE` overrides it
# for one tenant (the ledger's tenant_limits table). Enforced at submit by batchinf/limits.py.
LIMITS: dict[str, tuple[str, int, str]] = {
    "min_priority": ("BATCHINF_MIN_PRIORITY", -100, "priority, lowest allowed"),
    "max_priority": ("BATCHINF_MAX_PRIORITY", 100, "priority, highest allowed"),
    "max_batch_tokens": ("BATCHINF_LIMIT_MAX_BATCH_TOKENS", 1 << 17, "options.max_batch_tokens"),
    "max_slots": ("BATCHINF_LIMIT_MAX_SLOTS", 256, "options.max_slots (generate)"),
    "max_tokens": ("BATCHINF_LIMIT_MAX_TOKENS", 32768, "options.max_tokens (generate)"),
    "shard_max_records": ("BATCHINF_LIMIT_SHARD_RECORDS", 100_000, "shards.max_records"),
    "shard_max_tokens": ("BATCHINF_LIMIT_SHARD_TOKENS", 50_000_000, "shards.max_tokens"),
    "input_objects": ("BATCHINF_MAX_INPUT_OBJECTS", 100_000, "input objects a job pins (a prefix listed or an "
                      "input manifest's entries)"),
    "input_bytes": ("BATCHINF_MAX_INPUT_BYTES", 1 << 40, "bytes of the input objects a job pins, all together"),
    "image_pixels": ("BATCHINF_LIMIT_IMAGE_PIXELS", 4 << 20, "options.max_pixels: width x height of an image "
                     "(generate_image)"),
    "image_steps": ("BATCHINF_LIMIT_IMAGE_STEPS", 200, "options.max_steps and options.steps (generate_image)"),
    "images_per_record": ("BATCHINF_LIMIT_IMAGES_PER_RECORD", 16, "options.max_images and options.num_images "
                          "(generate_image)"),
    "kv_cache_bytes": ("BATCHINF_MAX_KV_CACHE_BYTES", 8 << 30, "the KV cache a generate job's options imply; "
                       "also each worker's budget per generate call, and per batch of generate_image (latents and activations)"),
}


@dataclass(frozen=True, kw_only=True)
class Settings:
    # --- where state lives
    home: Path                      # BATCHINF_HOME: embedded ledger, bundle store, caches; default: the
                                    # platform's data directory ($XDG_DATA_HOME/batchinf, ~/.local/share/batchinf)
    database_url: str               # BATCHINF_DATABASE_URL; default SQLite under home
    broker_url: str                 # BATCHINF_BROKER_URL (distributed mode)
    bundle_store: str               # BATCHINF_BUNDLE_STORE: where imported bundles live
    max_expansion: int              # BATCHINF_MAX_EXPANSION: a compressed input may expand this many times
    max_manifest_bytes: int         # BATCHINF_MAX_INPUT_MANIFEST_BYTES: the largest input manifest, and S3
                                    # Inventory data file, a job may name (64 MiB)
    plan_range_bytes: int           # BATCHINF_PLAN_RANGE_BYTES: a larger uncompressed JSONL / Parquet input
                                    # is planned in parts of about this size (planning/ranges.py)
    # --- leases, retries, speculation
    lease_seconds: float            # BATCHINF_LEASE_SECONDS: a shard lease not heartbeated this long is expired
    heartbeat_seconds: float        # BATCHINF_HEARTBEAT_SECONDS: how often a running shard renews its lease
    max_attempts: int               # BATCHINF_MAX_ATTEMPTS: attempts per shard before it fails
    job_retry_budget: int           # BATCHINF_JOB_RETRY_BUDGET: failed attempts per job before it fails;
                                    # 0: max(10, shards)
    retry_elsewhere_seconds: float  # BATCHINF_RETRY_ELSEWHERE_SECONDS: for this long after an attempt failed or
                                    # lost its worker on a host, that host leaves the shard to others (if any)
    speculate_factor: float         # BATCHINF_SPECULATE_FACTOR: a tail shard running this many times its
    speculate_min_seconds: float    # bucket's median (and BATCHINF_SPECULATE_MIN_SECONDS at least) gets a
                                    # speculative attempt; 0: off
    min_shard_tokens: int           # BATCHINF_MIN_SHARD_TOKENS: no shard is cut (planned or split) below this work
    split_chunk_tokens: int         # BATCHINF_SPLIT_CHUNK_TOKENS: a streaming attempt may split its shard
                                    # after each chunk of this much work; 0: dynamic splitting off
    max_step_failures: int          # BATCHINF_MAX_STEP_FAILURES: consecutive failed lifecycle steps of one job
                                    # before it fails (default 10)
    pin_time_limit: float           # BATCHINF_PIN_TIME_LIMIT: seconds pinning a job's inputs (listing, HEAD,
                                    # hashing) may take before the job fails (600)
    step_retry_cap: float           # BATCHINF_STEP_RETRY_CAP: most seconds a failed step waits before it runs
                                    # again (backoff from 0.5 s, doubling, full jitter; 0: at once)
    plan_time_limit: float          # BATCHINF_PLAN_TIME_LIMIT: seconds one planning task may run (distributed);
                                    # past it the task is stopped and counts as a failed attempt
    price_per_worker_hour: float | None  # BATCHINF_PRICE_PER_WORKER_HOUR: cost in status
    # --- distributed mode (Celery)
    queue: str                      # BATCHINF_QUEUE: the broker queue controllers send to, workers read
    visibility_timeout: int         # BATCHINF_VISIBILITY_TIMEOUT: seconds an unacked message waits before
                                    # redelivery; above the longest shard (a dead worker's lease expires sooner)
    engines: tuple[str, ...]        # BATCHINF_ENGINES: the engines a worker has, comma-separated (set by
                                    # `batchinf worker --engine`; default native, and onnxruntime where it is
                                    # installed): it claims only their jobs
    device: str                     # BATCHINF_DEVICE: a Celery worker's device, auto | cpu | cuda (set by
                                    # `batchinf worker --device`)
    dispatch_ahead: int             # BATCHINF_DISPATCH_AHEAD: shards the broker may hold beyond the worker processes
                                    # that consume the queue (at least this many, or a quarter of those processes;
                                    # default 2): what workers are about to take, so an urgent job's shards wait
                                    # behind little
    broker_timeout: float           # BATCHINF_BROKER_TIMEOUT: seconds a broker connect, read or publish may take
                                    # (socket timeouts; a publish retries within it), and a control reply is awaited
                                    # at most a tenth of it (default 10)
    # --- object storage
    s3_endpoint_url: str | None     # BATCHINF_S3_ENDPOINT_URL: MinIO or another S3-compatible server; unset: AWS
    s3_region: str | None           # BATCHINF_S3_REGION, else AWS_REGION; unset: boto3's chain (AWS_DEFAULT_REGION,
                                    # the profile's region), then us-east-1 (credentials: the usual AWS chain)
    s3_sse: str | None              # BATCHINF_S3_SSE: ServerSideEncryption on uploads, AES256 | aws:kms | aws:kms:dsse
    s3_sse_kms_key_id: str | None   # BATCHINF_S3_SSE_KMS_KEY_ID: the KMS key for aws:kms (implies aws:kms)
    s3_expected_bucket_owner: str | None  # BATCHINF_S3_EXPECTED_BUCKET_OWNER: account id every request asserts
    s3_put_extra: dict[str, str]    # BATCHINF_S3_PUT_EXTRA: JSON object of extra PutObject arguments, e.g.
                                    # {"StorageClass": "INTELLIGENT_TIERING", "ACL": "bucket-owner-full-control"}
    s3_connect_timeout: float       # BATCHINF_S3_CONNECT_TIMEOUT: seconds to connect to S3 (default 5)
    s3_read_timeout: float          # BATCHINF_S3_READ_TIMEOUT: seconds S3 may stay silent mid-request (default 30)
    s3_max_attempts: int            # BATCHINF_S3_MAX_ATTEMPTS: tries per S3 request, the first included (default 4);
                                    # a server silent through all of them is a TransientError naming the object
    store_warn_seconds: float       # BATCHINF_STORE_WARN_SECONDS: a storage call running this long is logged
                                    # ("still waiting for s3 GET URI (job ID) after N s"), and again as often
                                    # (default 10; 0: off)
    # --- metrics
    metrics_token: str | None       # BATCHINF_METRICS_TOKEN: the bearer token /metrics requires
    metrics_public: bool            # BATCHINF_METRICS_PUBLIC: 1 serves /metrics without a token (with neither
                                    # set, /metrics answers 401)
    metrics_job_window: float       # BATCHINF_METRICS_JOB_WINDOW: seconds a finished job keeps its per-job series
    prometheus_multiproc_dir: str | None  # PROMETHEUS_MULTIPROC_DIR: set, a metrics server reports all forked
                                          # children (prometheus_client's multiprocess mode)
    # --- logs
    log_format: str                 # BATCHINF_LOG_FORMAT: text | json (set by `batchinf --log-format`)
    log_level: str | None           # BATCHINF_LOG_LEVEL: DEBUG | INFO | WARNING | ERROR (`batchinf --log-level`);
                                    # unset: INFO for long-running processes, WARNING for other commands
    # --- model runtime
    pack_weights: bool              # BATCHINF_PACK_WEIGHTS: CPU float32 models keep a prepacked copy of their
                                    # projections (generation: MKL; BERT-family encoders: oneDNN); 0 saves that memory
    block_weights: bool             # BATCHINF_BLOCK_WEIGHTS (default on): a CPU float32 decoder keeps weights that are
                                    # exact GGUF blocks (Q4_1, Q8_0: a GGUF import) as those blocks, expanded at each
                                    # call (runtime/block_weights.py); 0: float32
    c_compiler: str                 # CC: the C compiler that builds that expansion kernel (default cc)
    malloc_keep_bytes: int          # BATCHINF_MALLOC_KEEP_BYTES: a process that loads a model serves allocations up
                                    # to this size from the heap and keeps this much freed memory (runtime/malloc.py);
                                    # 0 leaves glibc's defaults
    template_memory_bytes: int      # BATCHINF_TEMPLATE_MEMORY_BYTES: address space of the process that renders a
                                    # bundle's chat template (runtime/template_sandbox.py; default 512 MiB)
    template_seconds: float         # BATCHINF_TEMPLATE_SECONDS: one record's chat-template render, at most (5 s:
                                    # the in-sandbox deadline; CPU limit one second more, the parent kills at +2 s)
    # --- bounds (see LIMITS)
    limits: dict[str, int]          # LIMITS' variables: the operator's default of each tenant-overridable bound
    max_kv_cache_bytes: int         # BATCHINF_MAX_KV_CACHE_BYTES: a worker's KV-cache budget per generate call
    max_error_rows: int             # BATCHINF_MAX_ERROR_ROWS: error rows per job before it fails (default 1,000,000)
    max_audio_seconds: float        # BATCHINF_MAX_AUDIO_SECONDS: longest audio file a transcribe job decodes (4 h);
                                    # a header claiming more is refused before decoding
    # --- OpenAI Files and Batches API
    files_uri: str                  # BATCHINF_FILES_URI: OpenAI API files and batch outputs, per tenant
                                    # (default: files/ under BATCHINF_HOME)
    max_file_bytes: int             # BATCHINF_MAX_FILE_BYTES: largest file POST /v1/files accepts (200 MiB)
    openai_models: str              # BATCHINF_OPENAI_MODELS: "gpt-4o-mini=smollm2@prod,..." model -> bundle
    openai_shard_records: int       # BATCHINF_OPENAI_SHARD_RECORDS: requests per shard of a batch's job (1000)
    # --- fault injection (tests, chaos)
    failpoints: str                 # BATCHINF_FAILPOINTS: "point=action;..." (batchinf/failpoints.py)
    failpoints_seed: str | None     # BATCHINF_FAILPOINTS_SEED: seeds the probabilistic failpoints' draws

    @property
    def embedded(self) -> bool:
        return self.database_url.startswith("sqlite")


def _default_engines() -> str:
    """native, and onnxruntime where this environment has it (a bundle declares it where it is faster)."""
    import importlib.util

    return "native,onnxruntime" if importlib.util.find_spec("onnxruntime") is not None else "native"


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


def _choice(name: str, allowed: tuple[str, ...], default: str | None, *, upper: bool = False) -> str | None:
    raw = _text(name)
    if raw is None:
        return default
    value = raw.upper() if upper else raw
    if value not in allowed:
        raise ConfigError(f"{name}={raw!r} is not one of {', '.join(allowed)}; set it to one or unset it")
    return value


def _json_object(name: str) -> dict[str, str]:
    raw = _text(name)
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(f"{name}={raw!r} is not a JSON object; e.g. {name}='{{\"StorageClass\": \"STANDARD_IA\"}}'")
    return value


def default_home() -> Path:
    """Where batchinf keeps its state when BATCHINF_HOME is unset: the platform's data directory
    ($XDG_DATA_HOME/batchinf, else ~/.local/share/batchinf; ~/Library/Application Support/batchinf
    on macOS; %LOCALAPPDATA%\\batchinf on Windows), the same from every working directory."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "batchinf"
    if sys.platform == "win32":
        return Path(_text("LOCALAPPDATA") or Path.home() / "AppData" / "Local") / "batchinf"
    return Path(_text("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "batchinf"


@lru_cache(maxsize=1)
def settings() -> Settings:
    """This process's settings, loaded once (tests: settings.cache_clear() after changing variables)."""
    return load_settings()


def load_settings() -> Settings:
    """Settings read from the environment now, not cached."""
    home = Path(_text("BATCHINF_HOME") or default_home()).expanduser().resolve()
    return Settings(
        home=home,
        database_url=_text("BATCHINF_DATABASE_URL") or f"sqlite:///{home / 'ledger.db'}",
        broker_url=_text("BATCHINF_BROKER_URL") or "redis://127.0.0.1:6379/0",
        bundle_store=_text("BATCHINF_BUNDLE_STORE") or (home / "bundles").as_uri(),
        max_expansion=_int("BATCHINF_MAX_EXPANSION", 200),
        max_manifest_bytes=_int("BATCHINF_MAX_INPUT_MANIFEST_BYTES", 64 << 20),
        plan_range_bytes=max(1, _int("BATCHINF_PLAN_RANGE_BYTES", 64 << 20)),
        lease_seconds=_float("BATCHINF_LEASE_SECONDS", 60.0),
        heartbeat_seconds=_float("BATCHINF_HEARTBEAT_SECONDS", 5.0),
        max_attempts=_int("BATCHINF_MAX_ATTEMPTS", 3),
        job_retry_budget=_int("BATCHINF_JOB_RETRY_BUDGET", 0),
        retry_elsewhere_seconds=_float("BATCHINF_RETRY_ELSEWHERE_SECONDS", 30.0),
        speculate_factor=_float("BATCHINF_SPECULATE_FACTOR", 3.0),
        speculate_min_seconds=_float("BATCHINF_SPECULATE_MIN_SECONDS", 30.0),
        min_shard_tokens=max(1, _int("BATCHINF_MIN_SHARD_TOKENS", 10_000)),
        split_chunk_tokens=max(0, _int("BATCHINF_SPLIT_CHUNK_TOKENS", 2048)),
        max_step_failures=_int("BATCHINF_MAX_STEP_FAILURES", 10),
        pin_time_limit=_float("BATCHINF_PIN_TIME_LIMIT", 600.0),
        step_retry_cap=max(0.0, _float("BATCHINF_STEP_RETRY_CAP", 60.0)),
        plan_time_limit=_float("BATCHINF_PLAN_TIME_LIMIT", 3600.0),
        price_per_worker_hour=_optional_float("BATCHINF_PRICE_PER_WORKER_HOUR"),
        queue=_text("BATCHINF_QUEUE") or "batchinf",
        visibility_timeout=_int("BATCHINF_VISIBILITY_TIMEOUT", 6 * 3600),
        engines=tuple(e.strip() for e in (_text("BATCHINF_ENGINES") or _default_engines()).split(",") if e.strip()),
        device=_text("BATCHINF_DEVICE") or "auto",
        dispatch_ahead=max(0, _int("BATCHINF_DISPATCH_AHEAD", 2)),
        broker_timeout=max(0.1, _float("BATCHINF_BROKER_TIMEOUT", 10.0)),
        s3_endpoint_url=_text("BATCHINF_S3_ENDPOINT_URL"),
        s3_region=_text("BATCHINF_S3_REGION") or _text("AWS_REGION"),
        s3_sse=_choice("BATCHINF_S3_SSE", ("AES256", "aws:kms", "aws:kms:dsse"), None),
        s3_sse_kms_key_id=_text("BATCHINF_S3_SSE_KMS_KEY_ID"),
        s3_expected_bucket_owner=_text("BATCHINF_S3_EXPECTED_BUCKET_OWNER"),
        s3_put_extra=_json_object("BATCHINF_S3_PUT_EXTRA"),
        s3_connect_timeout=max(0.1, _float("BATCHINF_S3_CONNECT_TIMEOUT", 5.0)),
        s3_read_timeout=max(0.1, _float("BATCHINF_S3_READ_TIMEOUT", 30.0)),
        s3_max_attempts=max(1, _int("BATCHINF_S3_MAX_ATTEMPTS", 4)),
        store_warn_seconds=max(0.0, _float("BATCHINF_STORE_WARN_SECONDS", 10.0)),
        log_format=_choice("BATCHINF_LOG_FORMAT", ("text", "json"), "text") or "text",
        log_level=_choice("BATCHINF_LOG_LEVEL", ("DEBUG", "INFO", "WARNING", "ERROR"), None, upper=True),
        metrics_token=_text("BATCHINF_METRICS_TOKEN"),
        metrics_public=_flag("BATCHINF_METRICS_PUBLIC", False),
        metrics_job_window=_float("BATCHINF_METRICS_JOB_WINDOW", 86400.0),
        prometheus_multiproc_dir=_text("PROMETHEUS_MULTIPROC_DIR"),
        pack_weights=_flag("BATCHINF_PACK_WEIGHTS", True),
        block_weights=_flag("BATCHINF_BLOCK_WEIGHTS", True),
        c_compiler=_text("CC") or "cc",
        malloc_keep_bytes=_int("BATCHINF_MALLOC_KEEP_BYTES", 1 << 30),
        template_memory_bytes=_int("BATCHINF_TEMPLATE_MEMORY_BYTES", 512 << 20),
        template_seconds=_float("BATCHINF_TEMPLATE_SECONDS", 5.0),
        limits={name: _int(var, default) for name, (var, default, _) in LIMITS.items()},
        max_kv_cache_bytes=_int("BATCHINF_MAX_KV_CACHE_BYTES", LIMITS["kv_cache_bytes"][1]),
        max_error_rows=_int("BATCHINF_MAX_ERROR_ROWS", 1_000_000),
        max_audio_seconds=_float("BATCHINF_MAX_AUDIO_SECONDS", 4 * 3600.0),
        files_uri=_text("BATCHINF_FILES_URI") or (home / "files").as_uri(),
        max_file_bytes=_int("BATCHINF_MAX_FILE_BYTES", 200 << 20),
        openai_models=_text("BATCHINF_OPENAI_MODELS") or "",
        openai_shard_records=_int("BATCHINF_OPENAI_SHARD_RECORDS", 1000),
        failpoints=_text("BATCHINF_FAILPOINTS") or "",
        failpoints_seed=_text("BATCHINF_FAILPOINTS_SEED"),
    )


def sandbox_environment() -> dict[str, str]:
    """All a chat template's sandbox process (runtime/template_sandbox.py) gets of the environment:
    where Python finds modules (PYTHONPATH) and the time zone (TZ: strftime_now answers in the
    parent's). Never credentials or a ledger URL."""
    return {name: value for name in ("PYTHONPATH", "TZ") if (value := _text(name))}


def foreign_environment() -> dict[str, str]:
    """This process's environment less batchinf's and AWS's own variables: what a process that
    batchinf starts with a configuration of its own (`batchinf dev cluster`) inherits besides it."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("BATCHINF_", "AWS_"))}


# A forked child (a Celery prefork worker) loads its own: its parent may have cached settings
# before setting a variable for its children (`batchinf worker` sets BATCHINF_DEVICE so).
os.register_at_fork(after_in_child=settings.cache_clear)


def engine_secret(name: str) -> str | None:
    """An engine's credential from this worker's environment (the openai-http engine's API key), read
    when used: `name` is the variable its bundle names, which must be a BATCHINF_OPENAI_HTTP_* one."""
    if not name.startswith("BATCHINF_OPENAI_HTTP_"):
        raise ConfigError(f"{name}: an engine's key may be read only from a BATCHINF_OPENAI_HTTP_* variable")
    return os.environ.get(name) or None
