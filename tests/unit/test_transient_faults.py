"""One classification of failures (`retry_policy.classify`): a storage, ledger or broker fault is
transient in every stage, verification and publishing included; only a real verification failure
(coverage, a digest or row count that differs, an unreadable or unlisted part) fails a job for good.
Then the lifecycle's backoff of a failed step, and `verify --publish`'s way back for a job that
failed in verification, on an embedded SQLite ledger."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pyarrow as pa
import pytest

from batchinf.controller import republish
from batchinf.errors import (BundleError, DeviceUnavailableError, InputError, LedgerError, ManifestError,
                             StaleAttemptError, StoreError, TransientError, VerificationError)
from batchinf.ledger import jobs, shards
from batchinf.ledger.db import tx
from batchinf.ledger.states import JOB_REOPENINGS, JOB_TERMINAL, JobStatus, job_sources
from batchinf.ledger.tables import shards as shard_table
from batchinf.lifecycle import retry_in, step
from batchinf.manifest import parse_manifest
from batchinf.retry_policy import Outcome, classify
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.verify import SUCCESS, verify_output
from tests.helpers.corpus import manifest, write_jsonl
from tests.helpers.publishing import job_moves, set_failpoints
from tests.helpers.stages import InProcess


def _from(exc: BaseException, cause: BaseException) -> BaseException:
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize("exc, outcome", [
    (TransientError("S3 GetObject failed after retries: InternalError (HTTP 500)"), Outcome.RETRY),
    (_from(VerificationError("part s3://b/p cannot be read"), TransientError("connection reset")), Outcome.RETRY),
    (_from(InputError("x"), _from(ValueError("y"), TransientError("ledger unavailable"))), Outcome.RETRY),
    (DeviceUnavailableError("no CUDA here"), Outcome.RETRY),
    (RuntimeError("a worker bug"), Outcome.RETRY),
    (LedgerError("illegal transition"), Outcome.RETRY),
    (StaleAttemptError("lost the lease"), Outcome.FAIL_SHARD),
    (VerificationError("record 3 of a.jsonl is missing"), Outcome.FAIL_JOB),
    (_from(VerificationError("part p cannot be read"), pa.ArrowInvalid("magic bytes")), Outcome.FAIL_JOB),
    (StoreError("S3 PutObject s3://b/k failed: AccessDenied (HTTP 403)"), Outcome.FAIL_JOB),
    (InputError("object s3://b/k does not exist"), Outcome.FAIL_JOB),
    (ManifestError("unknown key"), Outcome.FAIL_JOB),
    (BundleError("tampered"), Outcome.FAIL_JOB),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v))
def test_classify_is_the_one_policy(exc: BaseException, outcome: Outcome) -> None:
    assert classify(exc) is outcome


def _s3_faults() -> list[tuple[BaseException, type]]:
    from boto3.exceptions import RetriesExceededError, S3UploadFailedError
    from botocore.exceptions import (ClientError, ConnectTimeoutError, EndpointConnectionError, FlexibleChecksumError,
                                     ReadTimeoutError, ResponseStreamingError)

    def client_error(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")

    def upload_failed(cause: BaseException) -> S3UploadFailedError:
        try:
            try:
                raise cause
            except ClientError as e:     # as boto3 raises it: a new error while handling the real one
                raise S3UploadFailedError(f"Failed to upload: {e}")
        except S3UploadFailedError as wrapped:
            return wrapped

    endpoint = "http://127.0.0.1:9"
    return [
        (EndpointConnectionError(endpoint_url=endpoint), TransientError),     # the server died
        (ConnectTimeoutError(endpoint_url=endpoint), TransientError),
        (ReadTimeoutError(endpoint_url=endpoint), TransientError),            # the server stalled
        (ResponseStreamingError(error="connection broken"), TransientError),
        (FlexibleChecksumError(error_msg="sha256 differs"), TransientError),  # broken in transit
        (RetriesExceededError(ReadTimeoutError(endpoint_url=endpoint)), TransientError),  # download_file
        (client_error("InternalError", 500), TransientError),
        (client_error("ServiceUnavailable", 503), TransientError),
        (client_error("SlowDown", 503), TransientError),
        (upload_failed(client_error("InternalError", 500)), TransientError),
        (ConnectionResetError(errno.ECONNRESET, "reset by peer"), TransientError),
        (OSError(errno.ENOSPC, "No space left on device"), TransientError),    # the download's local disk
        (client_error("AccessDenied", 403), StoreError),
        (client_error("NoSuchBucket", 404), StoreError),
        (upload_failed(client_error("AccessDenied", 403)), StoreError),
        (OSError(errno.EACCES, "Permission denied"), StoreError),
        (client_error("NoSuchKey", 404), InputError),
    ]


def test_s3_faults_are_transient_unless_an_operator_must_act() -> None:
    from batchinf.store.s3 import _translate

    for exc, want in _s3_faults():
        got = _translate(exc, "GetObject", "s3://b/part-00000.parquet")
        assert type(got) is want, f"{type(exc).__name__}: {exc} -> {type(got).__name__}: {got}"
        assert "s3://b/part-00000.parquet" in str(got)


@pytest.mark.parametrize("code, want", [
    (errno.EIO, TransientError), (errno.ENOSPC, TransientError), (errno.ESTALE, TransientError),
    (errno.EDQUOT, TransientError), (errno.EACCES, StoreError), (errno.EROFS, StoreError),
], ids=lambda v: errno.errorcode.get(v, v) if isinstance(v, int) else v.__name__)
def test_local_store_faults_by_errno(code: int, want: type) -> None:
    from batchinf.store.local import _os_errors

    with pytest.raises(want, match="local write file:///out/x"):
        with _os_errors("write", "file:///out/x"):
            raise OSError(code, errno.errorcode[code])


def test_an_unreadable_part_fails_verification_but_a_storage_fault_does_not(tmp_path: Path) -> None:
    from batchinf.verify import _readable, read_part

    with pytest.raises(VerificationError, match="missing.parquet"):       # a part that is not there
        with read_part("file://" + str(tmp_path / "missing.parquet")):
            pass
    (tmp_path / "cut.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(VerificationError, match="cut.parquet"):           # a truncated part
        with read_part("file://" + str(tmp_path / "cut.parquet")):
            pass
    for fault, want in [(TransientError("injected storage fault at store.get"), TransientError),
                        (OSError(errno.EIO, "Input/output error"), TransientError),
                        (StoreError("S3 GetObject failed: AccessDenied (HTTP 403)"), StoreError)]:
        with pytest.raises(want) as caught:
            with _readable("part s3://b/part-00000.parquet"):
                raise fault
        assert classify(caught.value) is (Outcome.FAIL_JOB if want is StoreError else Outcome.RETRY)


def test_reopening_is_an_operator_edge_the_lifecycle_never_takes() -> None:
    assert all(s in JOB_TERMINAL for s in JOB_REOPENINGS)
    assert JobStatus.FAILED.value not in job_sources(JobStatus.VERIFYING)   # verify_when_done cannot revive a job
    assert JobStatus.FAILED.value in job_sources(JobStatus.VERIFYING, reopen=True)


# --- the lifecycle, on SQLite ----------------------------------------------------------------------


def _verifying_job(tmp_path: Path, name: str) -> str:
    """A job stepped in this process until every shard is committed and it is verifying."""
    write_jsonl(tmp_path / name / "a.jsonl", 30, bad=False)
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / name / "a.jsonl"), str(tmp_path / name / "out"),
                                               shards={"max_records": 10})), OPERATOR)
    d = InProcess()
    for _ in range(20):
        if jobs.get(job_id).status == JobStatus.VERIFYING:
            return job_id
        assert step(job_id, d)
    raise AssertionError(f"job {job_id} is {jobs.get(job_id).status}, not verifying")


@pytest.fixture
def store_faults():  # noqa: ANN201
    """`turn(True)`: every store call in this process fails as a transient fault; `turn(False)`: none."""
    yield lambda on: set_failpoints("store.put=raise;store.get=raise" if on else None)
    set_failpoints(None)


def test_a_storage_fault_in_verification_is_retried_after_a_backoff(
        tmp_path: Path, tiny_bundle: str, store_faults, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from batchinf.retry_policy import RetryPolicy

    monkeypatch.setattr(RetryPolicy, "backoff", lambda self, stage, attempt: 1.0)   # no jitter: a backoff to test inside
    job_id = _verifying_job(tmp_path, "v")
    store_faults(True)
    assert not step(job_id, InProcess())                # publishing failed: charged, not fatal
    job = jobs.get(job_id)
    assert job.status == JobStatus.VERIFYING and job.step_failures == 1, job.error
    backoff_ends = time.monotonic() + retry_in(job_id)
    assert backoff_ends > time.monotonic()
    # well inside the backoff the job waits: a step does not try again (a margin, so that a step
    # slowed by a loaded machine does not run past the backoff's end)
    while backoff_ends - time.monotonic() > 0.5:
        assert step(job_id, InProcess()) and jobs.get(job_id).step_failures == 1
        time.sleep(0.05)
    time.sleep(max(0.0, backoff_ends - time.monotonic()))
    store_faults(False)
    assert step(job_id, InProcess())
    job = jobs.get(job_id)
    assert job.status == JobStatus.SUCCEEDED and job.step_failures == 0
    assert verify_output(str(tmp_path / "v" / "out"))["ok"]


def test_a_job_failed_in_verification_is_published_again(tmp_path: Path, tiny_bundle: str) -> None:
    job_id = _verifying_job(tmp_path, "r")
    jobs.fail(job_id, "verification failed: S3 GetObject failed after retries (connection)")   # the old behaviour
    assert republish(job_id) == JobStatus.SUCCEEDED
    job = jobs.get(job_id)
    assert job.error is None and job.finished_at is not None
    assert job_moves(job_id)[-3:] == [("verifying", "failed"), ("failed", "verifying"), ("verifying", "succeeded")]
    assert verify_output(str(tmp_path / "r" / "out"))["ok"]
    assert republish(job_id) == JobStatus.SUCCEEDED     # again: nothing to do, nothing moves
    assert job_moves(job_id)[-1] == ("verifying", "succeeded")


def test_only_a_job_failed_in_verification_with_every_shard_done_is_reopened(tmp_path: Path, tiny_bundle: str) -> None:
    write_jsonl(tmp_path / "a.jsonl", 30, bad=False)
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "a.jsonl"), str(tmp_path / "out"),
                                               shards={"max_records": 10})), OPERATOR)
    d = InProcess()
    while jobs.get(job_id).status != JobStatus.RUNNING:
        assert step(job_id, d)
    jobs.fail(job_id, "too many errors")
    with pytest.raises(LedgerError, match="failed while running, not in verification"):
        republish(job_id)
    assert jobs.get(job_id).status == JobStatus.FAILED and not (tmp_path / "out" / SUCCESS).exists()

    other = _verifying_job(tmp_path, "o")
    first = shards.of_job(other)[0].id
    with tx() as conn:                                  # a shard not done: the job failed before verifying
        conn.execute(shard_table.update().where(shard_table.c.id == first).values(status="failed"))
    jobs.fail(other, "verification failed: shard not committed")
    with pytest.raises(LedgerError, match=f"shard {first} is not committed"):
        republish(other)
    assert jobs.get(other).status == JobStatus.FAILED
