"""Deadlines and cancellation: partial results stay, `_PARTIAL.json` says what is done, and
`_MANIFEST.json` / `_SUCCESS` are never written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from sqlalchemy import select

from batchinf.controller import cancel, drive
from batchinf.errors import LedgerError
from batchinf.ledger.jobs import get as job_row
from batchinf.ledger.status import status
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.ledger.db import tx
from batchinf.ledger.tables import shards
from batchinf.manifest import parse_manifest
from batchinf.verify import MANIFEST, PARTIAL, SUCCESS
from tests.helpers.corpus import manifest, write_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _check_partial(out: Path, final: str) -> dict:
    assert not (out / SUCCESS).exists() and not (out / MANIFEST).exists()
    p = json.loads((out / PARTIAL).read_text())
    assert p["status"] == final
    c = p["counts"]
    assert c["records_done"] + c["records_not_done"] == c["records_total"]
    assert c["records_succeeded"] + c["records_failed"] == c["records_done"]
    rows = sum(pq.ParquetFile(out / part["key"]).metadata.num_rows for part in p["parts"])
    assert rows == c["records_done"]
    assert p["shards_not_done"], "the job should have been stopped before finishing"
    with tx() as conn:
        assert not conn.execute(select(shards.c.id).where(shards.c.status == "running")).all()
    return p


def test_deadline_expires_the_job(tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    write_jsonl(tmp_path / "a.jsonl", 1000, bad=False)
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.after_write=sleep(1)")
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "a.jsonl"), str(out), deadline="8s",
                                               shards={"max_records": 50})), OPERATOR)
    t0 = time.monotonic()
    assert drive(job_id, workers=1, threads=1) == "expired"
    assert time.monotonic() - t0 < 25, "running attempts must stop within a bounded time"
    p = _check_partial(out, "expired")
    assert "deadline" in p["reason"]


def test_cancel_a_running_job(tmp_path: Path, tiny_bundle: str, bi_home: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", 1000, bad=False)
    path = tmp_path / "job.yaml"
    out = tmp_path / "out"
    path.write_text(yaml.safe_dump(manifest(str(tmp_path / "a.jsonl"), str(out), shards={"max_records": 50})))
    env = dict(os.environ, BATCHINF_FAILPOINTS="execute.after_write=sleep(0.5)")
    proc = subprocess.Popen([sys.executable, "-m", "batchinf.cli", "run", str(path), "--json"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    job_id = None
    while time.monotonic() < deadline:
        with tx() as conn:
            job_id = conn.execute(select(shards.c.job_id).where(shards.c.status == "committed")).scalar()
        if job_id:
            break
        time.sleep(0.1)
    assert job_id
    r = subprocess.run([sys.executable, "-m", "batchinf.cli", "cancel", job_id, "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and json.loads(stdout)["status"] == "cancelled"
    _check_partial(out, "cancelled")
    with pytest.raises(LedgerError):
        cancel(job_id)                                   # already cancelled


def test_cancel_a_job_nobody_runs(tmp_path: Path, tiny_bundle: str) -> None:
    write_jsonl(tmp_path / "a.jsonl", 10, bad=False)
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "a.jsonl"), str(tmp_path / "out"))), OPERATOR)
    assert cancel(job_id) == "cancelled"
    assert job_row(job_id).error == "cancelled by request"
    assert json.loads((tmp_path / "out" / PARTIAL).read_text())["counts"]["records_done"] == 0
    assert status(job_id)["status"] == "cancelled"
