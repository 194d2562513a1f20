"""Bounds on every number a tenant sets, and on what a job may cost in error rows.

The operator sets each bound of `config.LIMITS` (an environment variable, overridden per tenant with
`batchinf tenant limit TENANT NAME VALUE`); `check_manifest` refuses, at submit, a manifest past any
of them with a message naming the field, the value, the limit and the fix. For a generate job it
also computes the KV cache the options imply from the bundle's shape (layers x 2 x kv_heads x
head_dim x bytes per value x tokens) and refuses one over `kv_cache_bytes`: `max_batch_tokens:
10**12` would otherwise have a worker allocate tens of GB of zeros.

`error_budget_problem` is the running tick's check of a job's failed records: past
BATCHINF_MAX_ERROR_ROWS, or past the manifest's `max_error_fraction` of its planned records, the
job fails instead of going green over a mountain of error rows.
"""

from __future__ import annotations

import json
from functools import lru_cache

from batchinf.bundles import get_info
from batchinf.config import LIMITS, settings
from batchinf.errors import BundleError, ManifestError, StoreError
from batchinf.ledger import grants
from batchinf.ledger import shards as shard_repo
from batchinf.ledger.models import Job
from batchinf.manifest import GenerateOptions, JobManifest
from batchinf.tasks.generate_image import GenerateImageOptions
from batchinf.store import get_store, join

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def effective(tenant: str) -> dict[str, int]:
    """The tenant's bounds: the operator's defaults, overridden by the tenant's own."""
    return {**settings().limits, **overrides(tenant)}


def overrides(tenant: str) -> dict[str, int]:
    """The bounds set for this tenant alone."""
    return {k: v for k, v in grants.limits_of(tenant).items() if k in LIMITS}


def set_tenant_limit(tenant: str, name: str, value: int | None) -> dict[str, int]:
    """Set (None: remove) one of the tenant's bounds; returns the tenant's effective bounds."""
    from batchinf.tenants import check_tenant

    check_tenant(tenant)
    if name not in LIMITS:
        raise ManifestError(f"no limit {name!r}; limits: {', '.join(LIMITS)}")
    if value is not None and not -(1 << 63) <= value < (1 << 63):
        raise ManifestError(f"limit {name} {value} does not fit in 64 bits")
    grants.set_limit(tenant, name, value)
    return effective(tenant)


def _fix(tenant: str, name: str) -> str:
    return f"or ask the operator to raise it (`batchinf tenant limit {tenant} {name} VALUE`)"


def _at_most(where: str, value: int, name: str, bounds: dict[str, int], tenant: str) -> None:
    if value > bounds[name]:
        raise ManifestError(f"{where} {value} is over the limit {name} = {bounds[name]}; use at most "
                            f"{bounds[name]}, {_fix(tenant, name)}")


@lru_cache(maxsize=64)
def bundle_shape(digest: str) -> tuple[int, int, str]:
    """(KV values per token: layers x 2 x kv_heads x head_dim, context length, dtype) of a generate
    bundle, read once per process from its config.json and bundle.json (bundles never change)."""
    uri = get_info(digest).uri
    try:
        store = get_store(uri)
        meta = json.loads(store.get_bytes(join(uri, "bundle.json")))
        values = kv_values_per_token(json.loads(store.get_bytes(join(uri, "config.json"))))
        context = int(meta["context_length"])
    except (StoreError, OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        # the bundle store's location is the operator's: not named to a tenant
        raise BundleError(f"bundle {digest} cannot be read ({type(exc).__name__}); the operator can check it "
                          f"with `batchinf bundle verify {digest}`") from None
    return values, context, str(meta.get("dtype", "float32"))


def kv_values_per_token(config: dict) -> int:
    """K and V values one token position holds across every layer of a Llama-family config.json
    (the fields as runtime.llama.LlamaConfig reads them, without importing torch)."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return int(config["num_hidden_layers"]) * 2 * kv_heads * head_dim


def kv_cache_bytes(opts: GenerateOptions, digest: str) -> tuple[int, int]:
    """(bytes of the largest KV cache these options let a worker allocate, bytes per token). On a
    CPU (device cpu or auto) values are float32; on cuda, the bundle's dtype."""
    values, context, dtype = bundle_shape(digest)
    per_token = values * (DTYPE_BYTES.get(dtype, 4) if opts.device == "cuda" else 4)
    tokens = min(opts.max_batch_tokens, opts.max_slots * context)
    return tokens * per_token, per_token


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "bytes" else f"{int(n)} bytes"
        n /= 1024
    return f"{n:.1f} TiB"


def check_manifest(m: JobManifest, digest: str, tenant: str) -> None:
    """ManifestError when a number of the manifest is past the tenant's bounds."""
    b = effective(tenant)
    if not b["min_priority"] <= m.priority <= b["max_priority"]:
        raise ManifestError(f"priority {m.priority} is outside the allowed range [{b['min_priority']}, "
                            f"{b['max_priority']}] (limits min_priority, max_priority); use a priority in "
                            f"that range, {_fix(tenant, 'max_priority')}")
    _at_most("shards.max_records", m.shards.max_records, "shard_max_records", b, tenant)
    _at_most("shards.max_tokens", m.shards.max_tokens, "shard_max_tokens", b, tenant)
    if hasattr(m.options, "max_batch_tokens"):    # image tasks batch by images instead
        _at_most("options.max_batch_tokens", m.options.max_batch_tokens, "max_batch_tokens", b, tenant)
    if isinstance(m.options, GenerateImageOptions):
        o = m.options
        _at_most("options.max_pixels", o.max_pixels, "image_pixels", b, tenant)
        if o.width is not None and o.height is not None:
            _at_most(f"options.width x options.height ({o.width}x{o.height})", o.width * o.height, "image_pixels", b,
                     tenant)
        _at_most("options.max_steps", o.max_steps, "image_steps", b, tenant)
        if o.steps is not None:
            _at_most("options.steps", o.steps, "image_steps", b, tenant)
        _at_most("options.max_images", o.max_images, "images_per_record", b, tenant)
        _at_most("options.num_images", o.num_images, "images_per_record", b, tenant)
    if isinstance(m.options, GenerateOptions):
        _at_most("options.max_slots", m.options.max_slots, "max_slots", b, tenant)
        _at_most("options.max_tokens", m.options.max_tokens, "max_tokens", b, tenant)
        need, per_token = kv_cache_bytes(m.options, digest)
        if need > b["kv_cache_bytes"]:
            fits = b["kv_cache_bytes"] // per_token
            raise ManifestError(
                f"options.max_batch_tokens {m.options.max_batch_tokens} with max_slots {m.options.max_slots} "
                f"lets a worker allocate a KV cache of {_size(need)} ({per_token} bytes per token for bundle "
                f"{m.bundle}), over the limit kv_cache_bytes = {b['kv_cache_bytes']} ({_size(b['kv_cache_bytes'])}); "
                f"set options.max_batch_tokens to at most {fits}, {_fix(tenant, 'kv_cache_bytes')}")


def error_budget_problem(job: Job) -> str | None:
    """Why the job must fail for its failed records (None: it may go on). One aggregate query."""
    failed = shard_repo.failed_records(job.id)
    if failed == 0:
        return None
    cap = settings().max_error_rows
    if failed > cap:
        return (f"too many errors: {failed} records failed, over the limit of {cap} error rows per job "
                "(BATCHINF_MAX_ERROR_ROWS); fix the input (see GET /v1/jobs/{id}/errors or errors/ of the "
                "output) and submit again").replace("{id}", job.id)
    fraction = job.manifest.max_error_fraction
    total = job.records_total or 0
    if fraction is not None and total and failed >= fraction * total:
        return (f"too many errors: {failed} of {total} records failed ({failed / total:.1%}), at least "
                f"max_error_fraction {fraction:g} of the job's records; check the input and its fields "
                "(a misspelled input.text_field fails every record; see the job's errors), or raise "
                "max_error_fraction")
    return None
