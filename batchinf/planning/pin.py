"""Pin a job's inputs: list its prefix or read its input manifest once, and record every object's
key, size, ETag and version, so workers read exactly those versions.

Everything here reads what a tenant named, so it reads through the job's `scopes.Storage`: each
object is checked against the grants before any byte of it is read, hashed or HEADed. And it is
bounded per job, whatever the tenant hands over: objects (`input_objects`, an object named twice
is refused), bytes of all of them together (`input_bytes`), the size of the input manifest and of
each S3 Inventory file (BATCHINF_MAX_INPUT_MANIFEST_BYTES), decompression (formats/compression.py)
and time (BATCHINF_PIN_TIME_LIMIT). A job past a bound fails with a message naming it and the fix.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from batchinf import failpoints
from batchinf.config import settings
from batchinf.errors import InputError, ManifestError
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import retry_records
from batchinf.ledger.models import Job
from batchinf.limits import effective
from batchinf.manifest import InputSpec
from batchinf.scopes import Storage
from batchinf.store import ObjectPin, normalize_uri


class Bounds:
    """One pinning's running tally against its job's bounds: objects, bytes and time."""

    def __init__(self, tenant: str) -> None:
        limits, s = effective(tenant), settings()
        self.tenant, self.max_objects, self.max_bytes = tenant, limits["input_objects"], limits["input_bytes"]
        self.deadline, self.seconds = time.monotonic() + s.pin_time_limit, s.pin_time_limit
        self.objects = self.bytes = 0

    def count(self, uri: str) -> None:
        """One more object (before any byte of it is read)."""
        failpoints.hit("pin.object")
        self.objects += 1
        if self.objects > self.max_objects:
            raise ManifestError(f"the input lists more than {self.max_objects} objects (limit input_objects); "
                                f"split the job, or ask the operator to raise it (`batchinf tenant limit "
                                f"{self.tenant} input_objects VALUE`)")
        self.in_time()

    def add(self, uri: str, size: int) -> None:
        """The object's bytes (before any of them is read, where the listing tells its size)."""
        self.bytes += size
        if self.bytes > self.max_bytes:
            raise ManifestError(f"the input objects hold more than {self.max_bytes} bytes together (limit "
                                f"input_bytes; reached at {uri}); split the job, or ask the operator to raise "
                                f"it (`batchinf tenant limit {self.tenant} input_bytes VALUE`)")
        self.in_time()

    def listed(self, uri: str, size: int) -> None:
        """One more object of a listing, and its bytes."""
        self.count(uri)
        self.add(uri, size)

    def in_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise ManifestError(f"pinning the inputs took longer than BATCHINF_PIN_TIME_LIMIT ({self.seconds:g} s) "
                                f"({self.objects} objects listed); split the job into smaller ones")


def pin_job(job: Job) -> None:
    """submitted -> planning: pin every input object once (a second pinner changes nothing). A
    retry job pins the very objects (same versions) of the job it retries that hold its records."""
    pins = pin_again(job, _retried_pins(job)) if job.retry_of else []
    job_repo.pin(job.id, pins or pin_inputs(job))
    failpoints.hit("plan.after_pin")


def _retried_pins(job: Job) -> list[ObjectPin]:
    chosen = retry_records.selection(job.id)
    return [o.pin for o in job_repo.inputs(job.retry_of or "") if chosen is None or o.pin.uri in chosen]


def pin_inputs(job: Job) -> list[ObjectPin]:
    """The job's input objects, pinned, within its bounds."""
    return list_inputs(job.manifest.input, Storage(job.tenant, job.confined), Bounds(job.tenant))


def pin_again(job: Job, pins: list[ObjectPin]) -> list[ObjectPin]:
    """The objects of an earlier job (a retry's), checked against this job's grants (they may have
    been revoked since) and bounds; nothing is read."""
    storage, bounds = Storage(job.tenant, job.confined), Bounds(job.tenant)
    for pin in pins:
        storage.check(pin.uri, "input object")
        bounds.listed(pin.uri, pin.size)
    return pins


def list_inputs(spec: InputSpec, storage: Storage, bounds: Bounds) -> list[ObjectPin]:
    """List the input once and pin key, size, ETag and version of every object it will read: the
    objects under `input.uri` (hidden ones aside), or those an input manifest names."""
    if spec.uri:
        uri = normalize_uri(spec.uri)
        keep = (lambda u: True) if spec.include_hidden else (lambda u: not hidden(uri, u))
        pins = storage.list(uri, "input", keep=keep, each=bounds.listed)
        if not pins:
            raise InputError(f"input {uri} has no objects; check input.uri (a prefix ends with /)")
        return pins
    return _pins_from_input_manifest(normalize_uri(spec.manifest or ""), storage, bounds)


def hidden(prefix: str, uri: str) -> bool:
    """Whether a listed object is one of the files Spark, Hive, Arrow and batchinf itself keep beside
    the data (`_SUCCESS`, `_common_metadata`, `.part-0.parquet.crc`, `_work/`): a name below the
    prefix with a segment starting with `_` or `.` (read all the same with the manifest's
    `input.include_hidden`). An object named on its own is never hidden."""
    rel = uri[len(prefix):] if uri.startswith(prefix) and uri != prefix else ""
    return any(seg.startswith(("_", ".")) for seg in rel.split("/"))


def _pins_from_input_manifest(uri: str, storage: Storage, bounds: Bounds) -> list[ObjectPin]:
    """A JSONL list of objects or an S3 Inventory manifest.json (formats/inventory.py); every
    listed object is checked against the grants and counted first, then they are HEADed in
    parallel, in the manifest's order."""
    from batchinf.formats.inventory import entries

    limit = settings().max_manifest_bytes
    try:
        listed = entries(uri, storage.get_bytes(uri, "input manifest", limit),
                         lambda u: storage.get_bytes(u, "S3 Inventory file", limit), count=bounds.count)
    except UnicodeDecodeError as exc:
        raise InputError(f"input manifest {uri} is not UTF-8 text (byte {exc.start}); it must be JSONL, one "
                         "object per line: {\"uri\": ...} or {\"bucket\", \"key\"}") from None
    if not listed:
        raise InputError(f"input manifest {uri} lists no objects")
    seen: dict[tuple[str, str | None], int] = {}
    for n, (obj, version) in enumerate(listed, start=1):
        storage.check(obj, "input object")
        if (first := seen.setdefault((obj, version), n)) != n:
            raise ManifestError(f"input manifest {uri} lists {obj} twice (entries {first} and {n}); every record "
                                "is read once: list each object once")
    pins: list[ObjectPin] = []
    with ThreadPoolExecutor(max_workers=min(16, len(listed))) as pool:
        try:
            for pin in pool.map(lambda e: storage.head(e[0], "input object", version_id=e[1]), listed):
                bounds.add(pin.uri, pin.size)
                pins.append(pin)
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    return pins
