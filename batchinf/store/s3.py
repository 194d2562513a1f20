"""s3:// backend (AWS, MinIO, moto) on boto3.

Endpoint from ``BATCHINF_S3_ENDPOINT_URL`` (unset: AWS). Region: ``BATCHINF_S3_REGION``, else ``AWS_REGION``,
else boto3's own chain (``AWS_DEFAULT_REGION``, the profile's ``region``), and us-east-1 only when nothing is
configured. Credentials from the usual AWS chain. Clients are created lazily and per process (forked workers make
their own).

Uploads carry the SHA-256 of their bytes as the object checksum (``ChecksumSHA256``, which S3 verifies on receipt;
above SINGLE_PUT_MAX, a multipart upload with per-part SHA-256 checksums), and the operator's options:
``BATCHINF_S3_SSE`` / ``BATCHINF_S3_SSE_KMS_KEY_ID`` (SSE-S3 or SSE-KMS), ``BATCHINF_S3_EXPECTED_BUCKET_OWNER``
(sent with every request) and ``BATCHINF_S3_PUT_EXTRA`` (more PutObject arguments, e.g. StorageClass).

Listing uses ListObjectVersions (latest versions only): one request per 1000 versions yields key, size, ETag and
VersionId from one consistent record, instead of a HeadObject per object. Where a store refuses it (no
s3:ListBucketVersions permission, or an S3-compatible store without versioning), it falls back to ListObjectsV2
with version_id None: reads are then pinned by If-Match on the ETag, still exact, but an overwrite fails the read
instead of reading the old version.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import boto3
from boto3.exceptions import Boto3Error, RetriesExceededError, S3UploadFailedError
from botocore.config import Config
from botocore.exceptions import (BotoCoreError, ChecksumError, ClientError, FlexibleChecksumError, HTTPClientError,
                                 IncompleteReadError)
from botocore.exceptions import ConnectionError as BotoConnectionError

from batchinf.config import settings
from batchinf.errors import BatchinfError, InputError, StoreError, TransientError
from batchinf.store.base import (ObjectPin, Store, as_path, changed_error, missing_error, os_fault, parse_uri,
                                 too_big_error)

SPOOL_MEMORY = 64 << 20  # open_read keeps up to this much in memory, then spills to a temp file
_MISSING = {"NoSuchKey", "404", "NotFound"}
_CHANGED = _MISSING | {"412", "PreconditionFailed", "NoSuchVersion"}
_TRANSIENT = {"SlowDown", "RequestTimeout", "RequestTimeTooSkewed", "Throttling", "ThrottlingException", "InternalError",
              "ServiceUnavailable"}
_NO_VERSION_LISTING = {"AccessDenied", "NotImplemented", "MethodNotAllowed", "InvalidRequest"}

SINGLE_PUT_MAX = 1 << 30  # files up to this size go in one PutObject with their full-object SHA-256
_clients: dict[tuple[int, int, str | None, str | None], Any] = {}
_for: list[Any] = [None]   # the settings object _clients were made for
_lock = threading.Lock()
os.register_at_fork(after_in_child=lambda: globals().update(_lock=threading.Lock()))


def client() -> Any:
    """This process's S3 client for the current endpoint and region (cached by pid)."""
    s = settings()
    endpoint = s.s3_endpoint_url
    if _for[0] is not s:    # settings reloaded (tests): the region chain may resolve differently
        _for[0] = s
        _clients.clear()
    key = (os.getpid(), 0, endpoint, s.s3_region)
    if key not in _clients:
        with _lock:
            if key not in _clients:
                session = boto3.session.Session()
                region = s.s3_region or session.region_name or "us-east-1"
                config = Config(    # a silent server costs at most max_attempts x read_timeout, then TransientError
                    retries={"total_max_attempts": s.s3_max_attempts, "mode": "adaptive"},
                    connect_timeout=s.s3_connect_timeout,
                    read_timeout=s.s3_read_timeout,
                    s3={"addressing_style": "path"} if endpoint else None,
                )
                _clients[key] = session.client("s3", endpoint_url=endpoint, region_name=region, config=config)
    return _clients[key]


def _owner() -> dict[str, str]:
    """ExpectedBucketOwner for every request, when the operator set one."""
    owner = settings().s3_expected_bucket_owner
    return {"ExpectedBucketOwner": owner} if owner else {}


def put_args() -> dict[str, Any]:
    """The operator's arguments for every upload: encryption, bucket owner, extra PutObject arguments."""
    s = settings()
    args: dict[str, Any] = {**_owner(), **s.s3_put_extra}
    if s.s3_sse or s.s3_sse_kms_key_id:
        args["ServerSideEncryption"] = s.s3_sse or "aws:kms"
    if s.s3_sse_kms_key_id:
        args["SSEKMSKeyId"] = s.s3_sse_kms_key_id
    return args


def _sha256_b64(data: bytes | None = None, path: Path | None = None) -> str:
    h = hashlib.sha256()
    if data is not None:
        h.update(data)
    else:
        with open(path, "rb") as f:  # type: ignore[arg-type]
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return base64.b64encode(h.digest()).decode()


def _code(exc: ClientError) -> tuple[str, int]:
    return str(exc.response.get("Error", {}).get("Code", "")), int(
        exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    )


def _translate(exc: BaseException, op: str, uri: str) -> BatchinfError:
    """TransientError for what may pass (5xx, throttling, a lost, refused or timed-out connection, a
    checksum broken in transit, a local disk fault), else StoreError or InputError."""
    if isinstance(exc, (S3UploadFailedError, RetriesExceededError)):   # boto3's wrappers of the real fault
        inner = getattr(exc, "last_exception", None) or exc.__cause__ or exc.__context__
        exc = inner if inner is not None else exc
    if isinstance(exc, (BotoConnectionError, HTTPClientError, IncompleteReadError, ChecksumError,
                        FlexibleChecksumError)):
        return TransientError(f"S3 {op} {uri} failed after retries (connection): {exc}")
    if isinstance(exc, OSError):    # a socket error, or the local file of a download
        return os_fault(f"S3 {op} {uri}", exc)
    if isinstance(exc, ClientError):
        code, status = _code(exc)
        if code == "NoSuchBucket":
            return StoreError(f"S3 {op} {uri} failed: the bucket does not exist")
        if code in _MISSING:
            return missing_error(uri)
        if status >= 500 or code in _TRANSIENT:
            return TransientError(f"S3 {op} {uri} failed after retries: {code} (HTTP {status})")
        return StoreError(f"S3 {op} {uri} failed: {code} (HTTP {status}): {exc}")
    return StoreError(f"S3 {op} {uri} failed: {exc}")


@contextlib.contextmanager
def _errors(op: str, uri: str) -> Iterator[None]:
    try:
        yield
    except (ClientError, BotoCoreError, Boto3Error, OSError) as exc:
        raise _translate(exc, op, uri) from exc


def _bucket_key(uri: str) -> tuple[str, str]:
    scheme, bucket, key = parse_uri(uri)
    if scheme != "s3":
        raise StoreError(f"S3Store cannot handle {uri}: only s3:// uris")
    return bucket, key


def _version(vid: str | None) -> str | None:
    return None if vid in (None, "", "null") else vid


def _checked(check: Callable[[str, int], bool] | None) -> Callable[[str, int], bool]:
    return check if check is not None else (lambda uri, size: True)


class S3Store(Store):
    """Objects are S3 keys; 'prefixes' are key prefixes ending in '/'."""

    def list(self, prefix_uri: str, check: Callable[[str, int], bool] | None = None) -> list[ObjectPin]:
        bucket, key = _bucket_key(prefix_uri)
        if key and not key.endswith("/"):
            try:
                pin = self.head(prefix_uri)         # a HEAD reads no byte of it
                return [pin] if check is None or check(pin.uri, pin.size) else []
            except InputError:
                key += "/"
        checked = _checked(check)
        with _errors("ListObjectVersions", prefix_uri):
            try:
                pins = [
                    ObjectPin(f"s3://{bucket}/{v['Key']}", v["Size"], v["ETag"].strip('"'), _version(v.get("VersionId")))
                    for page in client().get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=key, **_owner())
                    for v in page.get("Versions", [])
                    if v["IsLatest"] and not v["Key"].endswith("/") and checked(f"s3://{bucket}/{v['Key']}", v["Size"])
                ]
            except ClientError as exc:
                if _code(exc)[0] not in _NO_VERSION_LISTING:
                    raise
                pins = [
                    ObjectPin(f"s3://{bucket}/{o['Key']}", o["Size"], o["ETag"].strip('"'), None)
                    for page in client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key, **_owner())
                    for o in page.get("Contents", [])
                    if not o["Key"].endswith("/") and checked(f"s3://{bucket}/{o['Key']}", o["Size"])
                ]
        return sorted(pins, key=lambda pin: pin.uri)

    def head(self, uri: str, version_id: str | None = None) -> ObjectPin:
        bucket, key = _bucket_key(uri)
        with _errors("HeadObject", uri):
            r = client().head_object(Bucket=bucket, Key=key, **_owner(),
                                     **({"VersionId": version_id} if version_id else {}))
        return ObjectPin(uri, r["ContentLength"], r["ETag"].strip('"'), _version(r.get("VersionId")))

    @contextlib.contextmanager
    def open_read(self, pin: ObjectPin) -> Iterator[BinaryIO]:
        """GetObject with VersionId when pinned, else If-Match on the ETag; spooled so the file is seekable."""
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY) as spool:
            with _errors("GetObject", pin.uri):
                for chunk in self._get_pinned(pin)["Body"].iter_chunks(1 << 20):
                    spool.write(chunk)
            if spool.tell() != pin.size:
                raise TransientError(f"S3 GetObject {pin.uri} returned {spool.tell()} bytes, pinned {pin.size}")
            spool.seek(0)
            yield spool  # type: ignore[misc]

    def read_range(self, pin: ObjectPin, start: int, length: int) -> bytes:
        """One ranged GetObject, pinned like `open_read`."""
        if length <= 0 or start >= pin.size:
            return b""
        stop = min(pin.size, start + length)
        with _errors("GetObject", pin.uri):
            data = self._get_pinned(pin, Range=f"bytes={start}-{stop - 1}")["Body"].read()
        if len(data) != stop - start:
            raise TransientError(f"S3 GetObject {pin.uri} bytes {start}-{stop - 1} returned {len(data)} bytes")
        return data

    def _get_pinned(self, pin: ObjectPin, **extra: str) -> Any:
        """GetObject of exactly the pinned version: VersionId when pinned, else If-Match on the
        ETag; InputError naming the object if it changed or vanished."""
        bucket, key = _bucket_key(pin.uri)
        exact = {"VersionId": pin.version_id} if pin.version_id else {"IfMatch": pin.etag}
        try:
            r = client().get_object(Bucket=bucket, Key=key, **exact, **extra, **_owner())
        except ClientError as exc:
            if _code(exc)[0] in _CHANGED or _code(exc)[1] in (404, 412):
                raise changed_error(pin, self._current_etag(pin.uri)) from exc
            raise
        if r["ETag"].strip('"') != pin.etag:
            raise changed_error(pin, r["ETag"].strip('"'))
        return r

    def _current_etag(self, uri: str) -> str | None:
        try:
            return self.head(uri).etag
        except InputError:
            return None
        except BatchinfError:
            return "unknown"

    def get_bytes(self, uri: str, limit: int | None = None) -> bytes:
        bucket, key = _bucket_key(uri)
        with _errors("GetObject", uri):
            r = client().get_object(Bucket=bucket, Key=key, **_owner())
            if limit is not None and r["ContentLength"] > limit:
                r["Body"].close()
                raise too_big_error(uri, r["ContentLength"], limit)
            return r["Body"].read()

    def put_bytes(self, uri: str, data: bytes, durable: bool = True) -> None:
        bucket, key = _bucket_key(uri)
        with _errors("PutObject", uri):
            client().put_object(Bucket=bucket, Key=key, Body=data, ChecksumAlgorithm="SHA256",
                                ChecksumSHA256=_sha256_b64(data), **put_args())

    def put_file(self, uri: str, path: str | Path) -> None:
        bucket, key = _bucket_key(uri)
        local = as_path(path)
        with _errors("PutObject", uri):
            if local.stat().st_size <= SINGLE_PUT_MAX:
                checksum = _sha256_b64(path=local)
                with open(local, "rb") as body:
                    client().put_object(Bucket=bucket, Key=key, Body=body, ChecksumAlgorithm="SHA256",
                                        ChecksumSHA256=checksum, **put_args())
            else:
                client().upload_file(str(local), bucket, key, ExtraArgs={"ChecksumAlgorithm": "SHA256", **put_args()})

    def download_file(self, uri: str, path: str | Path) -> None:
        """s3transfer writes a temp file next to ``path`` and renames it, so ``path`` is never partial."""
        bucket, key = _bucket_key(uri)
        with _errors("GetObject", uri):
            as_path(path).parent.mkdir(parents=True, exist_ok=True)
            client().download_file(bucket, key, str(as_path(path)), ExtraArgs=_owner() or None)

    def copy(self, src_uri: str, dst_uri: str) -> None:
        (src_bucket, src_key), (dst_bucket, dst_key) = _bucket_key(src_uri), _bucket_key(dst_uri)
        with _errors("CopyObject", src_uri):
            extra = put_args()
            if extra.get("ExpectedBucketOwner"):
                extra["ExpectedSourceBucketOwner"] = extra["ExpectedBucketOwner"]
            client().copy({"Bucket": src_bucket, "Key": src_key}, dst_bucket, dst_key,
                          ExtraArgs={"ChecksumAlgorithm": "SHA256", **extra})

    def delete(self, uri: str) -> None:
        """On a versioned bucket this adds a delete marker; pins with a VersionId still read their version."""
        bucket, key = _bucket_key(uri)
        with _errors("DeleteObject", uri):
            client().delete_object(Bucket=bucket, Key=key, **_owner())

    def delete_prefix(self, prefix_uri: str) -> None:
        """Every version of every object under the prefix, delete markers included: batchinf
        deletes only its own scratch (a job's work prefix, `_work/`, losing attempts), and on a
        versioned bucket plain deletes would keep all of it as non-current versions behind delete
        markers. Without s3:DeleteObjectVersion the objects are deleted plainly (markers stay)."""
        bucket, key = _bucket_key(prefix_uri)
        under = key if not key or key.endswith("/") else key + "/"
        with _errors("DeleteObjects", prefix_uri):
            pages = client().get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=key)
            objects = [{"Key": v["Key"], "VersionId": v["VersionId"]} for p in pages
                       for v in p.get("Versions", []) + p.get("DeleteMarkers", [])
                       if v["Key"] == key or v["Key"].startswith(under)]
            denied = self._delete_objects(bucket, objects, prefix_uri)
            if denied:
                self._delete_objects(bucket, [{"Key": k} for k in sorted({o["Key"] for o in denied})], prefix_uri)

    def _delete_objects(self, bucket: str, objects: list[dict[str, str]], prefix_uri: str) -> list[dict[str, str]]:
        """Delete in batches of 1,000; returns the objects refused as AccessDenied (others raise)."""
        denied = []
        for i in range(0, len(objects), 1000):
            batch = objects[i : i + 1000]
            r = client().delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True}, **_owner())
            errors = [e for e in r.get("Errors", []) if e["Code"] != "AccessDenied" or "VersionId" not in e]
            denied += [e for e in r.get("Errors", []) if e not in errors]
            if errors:
                e = errors[0]
                kind = TransientError if e["Code"] in _TRANSIENT else StoreError
                raise kind(f"S3 DeleteObjects {prefix_uri}: {len(errors)} failed, e.g. {e['Key']}: {e['Code']}")
        return denied
