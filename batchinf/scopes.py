"""Storage scopes: which prefixes a tenant may read and write, and which outputs no job may take.

An operator grants each tenant prefixes (`batchinf tenant grant`); every URI a job names is
checked against them after normalisation (`store.normalize_uri`) and, for `file://`, after
resolving its real path, so `/./`, `//`, `..`, case and symlinks cannot make one prefix look like
another. Outputs are checked for every job: an output prefix never equals, contains or lies inside
another job's output or input prefix, the bundle store, BATCHINF_HOME or the ledger's files.

The two choke points:
- `Caller`: who asks for a job. `submit.submit` takes one (no default), so every path that creates
  a job (CLI, REST, OpenAI batches, retries, schedules, dry runs) states it: a tenant's request is
  always confined (with no grants it may touch nothing); the operator's CLI acting for a tenant is
  confined once that tenant has grants.
- `Storage`: a job's reads of the objects its tenant names (input prefixes, input manifests, S3
  Inventory files, the objects they list, image URIs), checked against the grants before any byte
  is read or hashed. Only `planning/pin.py` and the planning readers hold one; nothing else reads
  tenant-named objects (tests/unit/test_architecture.py keeps it so).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from batchinf.config import settings
from batchinf.errors import ManifestError, StoreError
from batchinf.ledger import grants
from batchinf.store import ObjectPin, get_store, join, normalize_uri, parse_uri

READ, WRITE = "read", "write"


def real(uri: str) -> str:
    """The canonical uri; for file:// the real path (symlinks resolved, existing or not)."""
    uri = normalize_uri(uri)
    scheme, _, path = parse_uri(uri)
    if scheme != "file":
        return uri
    resolved = os.path.realpath(path)
    return "file://" + resolved + ("/" if uri.endswith("/") and resolved != "/" else "")


def as_prefix(uri: str) -> str:
    return uri if uri.endswith("/") else uri + "/"


def within(uri: str, prefix: str) -> bool:
    """Whether `uri` (an object or a prefix) is `prefix` or lies under it, segment-wise."""
    return as_prefix(uri).startswith(as_prefix(prefix))


def overlap(a: str, b: str) -> bool:
    """One equals, contains or lies inside the other."""
    return within(a, b) or within(b, a)


# --- grants --------------------------------------------------------------------------------------


def grant(tenant: str, *, read: list[str] = (), write: list[str] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    from batchinf.tenants import check_tenant

    check_tenant(tenant)
    for prefixes, mode in ((read, READ), (write, WRITE)):
        for p in prefixes:
            grants.grant(tenant, as_prefix(real(p)), mode)
    return show(tenant)


def revoke(tenant: str, prefix: str) -> dict[str, Any]:
    removed = grants.revoke(tenant, as_prefix(real(prefix)))
    return {**show(tenant), "revoked": removed}


def show(tenant: str) -> dict[str, Any]:
    return {"tenant": tenant, "grants": [{"prefix": p, "mode": m} for p, m in grants.of_tenant(tenant)],
            "limits": grants.limits_of(tenant)}


@dataclass(frozen=True)
class Caller:
    """Who asks for a job: a tenant's request (`operator=False`: the REST API, OpenAI batches, a
    retry asked through the API) or the operator's CLI acting for a tenant (`batchinf run`,
    `submit`, `retry`, schedules and their backfills)."""

    tenant: str
    operator: bool = False

    @property
    def confined(self) -> bool:
        """Whether the job is checked against the tenant's grants: always for a tenant's request;
        for the operator, once the tenant has a grant."""
        return not self.operator or bool(grants.of_tenant(self.tenant))


@dataclass(frozen=True)
class Storage:
    """Reads of the objects a job's tenant names, scoped by the tenant's grants (when the job is
    confined): each uri is checked before any byte of it is read, hashed or even HEADed, so a
    refusal says nothing about whether the object exists."""

    tenant: str
    confined: bool

    def check(self, uri: str, what: str, mode: str = READ) -> None:
        if self.confined:
            check(self.tenant, uri, mode, what)

    def checker(self, what: str) -> Callable[[str], None] | None:
        """`check` for `what` as a callable (planning tasks carry it), None when unconfined."""
        return _Checker(self, what) if self.confined else None

    def list(self, prefix: str, what: str, keep: Callable[[str], bool] = lambda uri: True,
             each: Callable[[str, int], None] | None = None) -> list[ObjectPin]:
        """The objects under `prefix` that `keep` keeps, every one checked, and passed to `each` (a
        bound) with its size, before any byte of it is read."""
        self.check(prefix, what)

        def gate(uri: str, size: int) -> bool:
            if not keep(uri):
                return False
            self.check(uri, what + " object")
            if each is not None:
                each(uri, size)
            return True
        return get_store(prefix).list(prefix, check=gate)

    def head(self, uri: str, what: str, version_id: str | None = None) -> ObjectPin:
        self.check(uri, what)
        return get_store(uri).head(uri, version_id=version_id)

    def get_bytes(self, uri: str, what: str, limit: int) -> bytes:
        self.check(uri, what)
        return get_store(uri).get_bytes(uri, limit=limit)


@dataclass(frozen=True)
class _Checker:
    """A picklable `Storage.check` bound to what is checked (planning tasks run in other processes)."""

    storage: Storage
    what: str

    def __call__(self, uri: str) -> None:
        self.storage.check(uri, self.what)


def own_space(tenant: str) -> str:
    """The tenant's own space in batchinf's files store (uploaded OpenAI batch files and the
    outputs of their batches): every tenant may read and write there, and only there of it."""
    return as_prefix(real(join(settings().files_uri, tenant)))


FILES_SCHEME = "files://"


def shown(uri: str, tenant: str) -> str:
    """A uri as the tenant sees it: one in its own space as files://<path inside it>, so the
    server's paths (BATCHINF_HOME, the files store) never show."""
    space = own_space(tenant)
    return FILES_SCHEME + uri[len(space):] if within(uri, space) else uri


def check(tenant: str, uri: str, mode: str, what: str) -> None:
    """Raise ManifestError unless the tenant's grants allow `mode` on `uri` (write implies read)."""
    target = real(uri)
    held = grants.of_tenant(tenant)
    if within(target, own_space(tenant)) or any(within(target, p) and (m == WRITE or mode == READ) for p, m in held):
        return
    have = ", ".join(f"{m} {p}" for p, m in held) or "none"
    raise ManifestError(f"{what} {uri} is outside the prefixes tenant {tenant!r} may {mode} (its grants: {have}); "
                        f"use a granted prefix, or ask the operator for "
                        f"`batchinf tenant grant {tenant} --{mode} PREFIX`")


# --- output ownership ----------------------------------------------------------------------------


def _reserved() -> list[tuple[str, str]]:
    """Prefixes no output may touch, the most specific first (the message names the first hit)."""
    s = settings()
    out = [("the bundle store", real(as_prefix(s.bundle_store))), ("the files store", real(as_prefix(s.files_uri)))]
    if s.database_url.startswith("sqlite:///"):
        out.append(("the ledger's files", real(s.database_url.removeprefix("sqlite:///"))))
    return out + [("BATCHINF_HOME", real(str(s.home) + "/"))]


def check_output(tenant: str, output_uri: str, input_uri: str) -> None:
    """Refuse an output prefix that equals, contains or lies inside another job's output or input
    prefix (any tenant, any state), this job's own input, the bundle store, BATCHINF_HOME or the
    ledger's files. Another tenant's job is never named."""
    out = as_prefix(real(output_uri))
    if overlap(out, real(input_uri)):
        raise ManifestError(f"output {output_uri} overlaps this job's own input {input_uri}; write the "
                            "output to a prefix of its own, outside the input")
    for name, prefix in ([] if within(out, own_space(tenant)) else _reserved()):   # its own batches' outputs
        if overlap(out, prefix):
            raise ManifestError(f"output {output_uri} overlaps {name}; choose an output.uri outside it")
    for job_id, owner, status, which, uri in grants.overlapping_jobs(out):
        if not overlap(out, real(uri)):
            continue
        if owner == tenant:
            raise ManifestError(f"output {output_uri} overlaps the {which} prefix {uri} of job {job_id} "
                                f"({status}); every job writes to a prefix of its own: choose another output.uri")
        raise ManifestError(f"output {output_uri} overlaps a prefix that another job reads or writes; "
                            "choose another output.uri")


def canonical(uri: str, where: str, plain_paths: bool = True) -> str:
    """normalize_uri, with its refusal named after the manifest field. Without `plain_paths` (a
    tenant's request) a relative path or `~` is refused: resolving it would use, and name in the
    answer, the server's working directory or home."""
    if not plain_paths and "://" not in uri and not uri.startswith("/"):
        raise ManifestError(f"{where} {uri[:200]!r} is neither a URI nor an absolute path; write "
                            "s3://bucket/prefix/ or file:///absolute/path/")
    try:
        return normalize_uri(uri)
    except StoreError as exc:
        raise ManifestError(f"{where}: {exc}") from None
