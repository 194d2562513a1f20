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


def _slow_job(tmp_path: Path, n: int, secs: float) -> tuple[dict, str]:
    """One shard of n records, each taking `secs` (a failpoint), under a long lease: an attempt
    that is not given back holds its shard for a minute."""
    write_jsonl(tmp_path / "a.jsonl", n, bad=False)
    points = ";".join(f"execute.record[r{i}]=sleep({secs})" for i in range(n))
    return manifest(str(tmp_path / "a.jsonl"), str(tmp_path / "out"), shards={"max_records": 10_000}), points


def _attempts(job_id: str) -> list[tuple[str, str]]:
    from batchinf.ledger.tables import attempts

    with tx() as conn:
        return [tuple(r) for r in conn.execute(
            select(attempts.c.status, attempts.c.error).join(shards, shards.c.id == attempts.c.shard_id)
            .where(shards.c.job_id == job_id).order_by(attempts.c.started_at)).all()]


def test_a_cancel_stops_running_attempts_at_their_next_batch_and_keeps_what_they_finished(
        tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    m, points = _slow_job(tmp_path, 400, 0.02)
    monkeypatch.setenv("BATCHINF_LEASE_SECONDS", "60")
    monkeypatch.setenv("BATCHINF_FAILPOINTS", points)
    job_id, _ = submit(parse_manifest(m), OPERATOR)
    final: list[str] = []
    runner = threading.Thread(target=lambda: final.append(drive(job_id, workers=1, threads=1)), daemon=True)
    runner.start()
    deadline = time.monotonic() + 120
    while status(job_id)["counts"]["records_done"] < 40:
        assert time.monotonic() < deadline and runner.is_alive(), status(job_id)
        time.sleep(0.1)
    t0 = time.monotonic()
    assert cancel(job_id, finish=False) == "cancelling"
    runner.join(timeout=60)
    took = time.monotonic() - t0
    print(f"cancel to cancelled: {took:.1f} s")
    assert final == ["cancelled"] and took < 30, (final, took)     # not the 60 s lease
    p = _check_partial(tmp_path / "out", "cancelled")
    done = p["counts"]["records_done"]
    assert 40 <= done < 400, p["counts"]                            # the one shard's finished records stayed
    assert [s for s, _ in _attempts(job_id)] == ["committed"]     # committed what it had, nothing lost


def test_ctrl_c_gives_the_leases_back_and_the_next_run_starts_at_once(
        tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    from batchinf.ledger.tables import attempts

    m, points = _slow_job(tmp_path, 300, 0.05)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(m))
    monkeypatch.setenv("BATCHINF_LEASE_SECONDS", "60")
    env = dict(os.environ, BATCHINF_FAILPOINTS=points)
    # SIGINT as a terminal delivers it, whatever this process inherited: a shell that starts a
    # command in the background without job control (`bash .ci/run &`) ignores SIGINT for it, its
    # children inherit that, and Python then installs no KeyboardInterrupt handler (the job ran
    # on to success through three Ctrl-Cs in such a CI run)
    proc = subprocess.Popen([sys.executable, "-m", "batchinf.cli", "run", str(path), "--workers", "1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not [s for s, _ in _job_attempts_any()] or "running" not in [s for s, _ in _job_attempts_any()]:
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.1)
    time.sleep(1.0)
    # Ctrl-C, and again (as a user would) if the run still goes on 10 s later
    for _ in range(3):
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=10)
            break
        except subprocess.TimeoutExpired:
            continue
    else:
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err, err
    with tx() as conn:
        job_id = conn.execute(select(shards.c.job_id)).scalar()
    assert [s for s, _ in _attempts(job_id)] == ["released"], _attempts(job_id)
    t0 = time.time()
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "")
    assert drive(job_id, workers=1, threads=1) == "succeeded"
    with tx() as conn:
        second = conn.execute(select(attempts.c.started_at).join(shards, shards.c.id == attempts.c.shard_id)
                              .where(shards.c.job_id == job_id, attempts.c.number == 2)).scalar()
    print(f"resumed run to its first attempt: {second - t0:.1f} s")
    assert second - t0 < 30, second - t0                           # not after the 60 s lease
    assert status(job_id)["counts"]["records_succeeded"] == 300


def _job_attempts_any() -> list[tuple[str, str]]:
    from batchinf.ledger.tables import attempts

    with tx() as conn:
        return [tuple(r) for r in conn.execute(select(attempts.c.status, attempts.c.error)).all()]
