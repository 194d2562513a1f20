"""`batchinf verify --publish JOB`: a job whose shards are all committed but which failed in
verification because the store failed for a moment (the old classification, forced here through
the ledger) is published again, once, by the real CLI; a real verification failure (a tampered
part) still fails the job for good, at once and again when asked to publish."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchinf.controller import drive
from batchinf.errors import VerificationError
from batchinf.ledger import jobs, shards
from batchinf.store import get_store, join
from batchinf.verify import MANIFEST, SUCCESS, verify_output
from tests.helpers.env import subprocess_env
from tests.helpers.publishing import job_moves, part_keys, published_ids, set_failpoints, small_job, while_verifying

pytestmark = pytest.mark.integration


def _verify_publish(job_id: str) -> tuple[int, dict[str, Any]]:
    r = subprocess.run([sys.executable, "-m", "batchinf.cli", "verify", "--publish", job_id, "--json"],
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.stdout, r.stderr
    return r.returncode, json.loads(r.stdout)



def test_a_job_failed_in_verification_by_a_store_fault_is_published_again(
        tmp_path: Path, tiny_bundle: str, s3_bucket: str) -> None:
    out = f"{s3_bucket}/out"
    job_id, ids = small_job(tmp_path, out)

    def old_behaviour(n: int) -> None:
        """Publishing gets as far as promoting the parts, then the store "fails" and the job is
        failed for good, as a store fault in verification used to fail it."""
        if n == 1:
            set_failpoints("verify.before_publish=raise")
        else:
            set_failpoints(None)
            jobs.fail(job_id, "verification failed: part s3://… cannot be read: injected storage fault at store.get")
    try:
        assert drive(job_id, workers=1, threads=1, on_tick=while_verifying(job_id, old_behaviour)) == "failed"
    finally:
        set_failpoints(None)
    promoted = part_keys(out)
    assert promoted and MANIFEST not in promoted and SUCCESS not in promoted    # half published

    code, report = _verify_publish(job_id)
    assert code == 0 and report["ok"] and report["status"] == "succeeded", report
    assert report["counts"]["records_succeeded"] == len(ids)
    assert job_moves(job_id)[-3:] == [("verifying", "failed"), ("failed", "verifying"), ("verifying", "succeeded")]
    job = jobs.get(job_id)
    assert job.error is None and job.step_failures == 0
    assert sorted(published_ids(out)) == sorted(ids)                      # every record exactly once
    assert part_keys(out) == sorted(promoted + [MANIFEST, SUCCESS])      # no part twice, nothing left over
    assert not get_store(out).list(join(out, "_work/"))

    manifest = get_store(out).get_bytes(join(out, MANIFEST))
    code, again = _verify_publish(job_id)                                 # idempotent: nothing to do
    assert code == 0 and again["ok"] and again["status"] == "succeeded"
    assert get_store(out).get_bytes(join(out, MANIFEST)) == manifest
    assert job_moves(job_id)[-1] == ("verifying", "succeeded")


def test_a_tampered_part_still_fails_the_job_for_good(tmp_path: Path, tiny_bundle: str, s3_bucket: str) -> None:
    out = f"{s3_bucket}/out"
    job_id, _ = small_job(tmp_path, out)
    tampered: list[str] = []

    def tamper(n: int) -> None:
        if n == 1:
            part = next(s.output_uri for s in shards.of_job(job_id) if s.output_rows)
            get_store(part).put_bytes(part, b"PAR1 not the committed part PAR1")
            tampered.append(part)
    assert drive(job_id, workers=1, threads=1, on_tick=while_verifying(job_id, tamper)) == "failed"
    job = jobs.get(job_id)
    assert tampered and job.step_failures == 0, job.error                  # failed at once, not retried
    assert job.error.startswith("verification failed: ") and tampered[0] in job.error
    assert SUCCESS not in part_keys(out)

    code, report = _verify_publish(job_id)                                # verified again: still tampered
    assert code == 1 and not report["ok"] and report["status"] == "failed", report
    assert tampered[0] in report["error"]
    assert job_moves(job_id)[-2:] == [("failed", "verifying"), ("verifying", "failed")]
    with pytest.raises(VerificationError, match="_MANIFEST.json"):
        verify_output(out)
