"""Where a job's wall time goes (batchinf/phases.py): a finished embedded job's `_MANIFEST.json`,
its `status --json` and the REST status carry the same phases, each present and non-negative,
summing to at most the wall time; every worker's own account too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from batchinf.phases import PHASES
from tests.helpers.corpus import manifest, write_jsonl

pytestmark = pytest.mark.integration


def bi(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env=dict(os.environ),
                          capture_output=True, text=True, timeout=300)


def check_phases(ph: dict, wall_at_most: float, workers: int) -> None:
    assert set(PHASES) | {"wall", "workers"} == set(ph), ph
    assert all(ph[k] is not None and ph[k] >= 0 for k in PHASES), ph
    assert sum(ph[k] for k in PHASES) <= ph["wall"] + 0.001 * len(PHASES), ph   # rounding to the ms each
    assert ph["wall"] <= wall_at_most, (ph, wall_at_most)
    assert ph["startup"] > 0 and ph["execute"] > 0 and ph["publish"] > 0
    assert len(ph["workers"]) == workers, ph["workers"]
    for w in ph["workers"]:
        assert all(w[k] is not None and w[k] >= 0 for k in ("busy", "idle", "shards")), w
        if w["start"] is None:      # still loading when the job ended (a small job on a loaded machine)
            assert w["model_load"] is None and w["shards"] == 0 and w["idle"] > 0, w
        else:
            assert w["start"] > 0 and w["model_load"] is not None and w["model_load"] > 0, w
    assert any(w["start"] and w["model_load"] for w in ph["workers"]), ph["workers"]
    assert sum(w["shards"] for w in ph["workers"]) >= 1
    assert sum(w["busy"] for w in ph["workers"]) > 0


def test_finished_job_reports_its_phases(tmp_path: Path, tiny_bundle: str) -> None:
    write_jsonl(tmp_path / "in.jsonl", 60, seed=3, bad=False)
    m = tmp_path / "m.yaml"
    m.write_text(yaml.safe_dump(manifest(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                                         shards={"max_records": 20})))
    t0 = time.time()
    r = bi("run", str(m), "--workers", "2", "--threads", "1", "--json")
    wall = time.time() - t0
    assert r.returncode == 0, r.stderr
    ran = json.loads(r.stdout)
    written = json.loads((tmp_path / "out" / "_MANIFEST.json").read_text())["phases"]
    check_phases(written, wall, workers=2)
    assert ran["phases"] == written                      # `run --json` prints the status: the same numbers
    shown = json.loads(bi("status", ran["job_id"], "--json").stdout)
    assert shown["phases"] == written

    from fastapi.testclient import TestClient

    from batchinf.api.app import create_app
    from batchinf.api.schemas import JobView
    from batchinf.tenants import create_token

    token = create_token(ran["tenant"])["token"]
    with TestClient(create_app()) as client:
        got = client.get(f"/v1/jobs/{ran['job_id']}", headers={"Authorization": f"Bearer {token}"})
    assert got.status_code == 200, got.text
    assert JobView.model_validate(got.json()).phases.model_dump() == written


def test_running_job_shows_the_phases_that_ended(tmp_path: Path, tiny_bundle: str) -> None:
    """While a job runs its status shows the phases that ended, the same at every read: not the
    execute phase in progress, no publish yet, no worker's busy time."""
    from batchinf.ledger import jobs as job_repo
    from batchinf.ledger.events import now
    from batchinf.ledger.states import JobStatus
    from batchinf.ledger.status import status
    from batchinf.manifest import parse_manifest
    from batchinf.phases import process_started_at
    from batchinf.submit import submit
    from tests.helpers.env import OPERATOR
    from tests.helpers.stages import plan_job

    write_jsonl(tmp_path / "in.jsonl", 30, seed=4, bad=False)
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in.jsonl"), str(tmp_path / "out"))), OPERATOR,
                       process_started_at=process_started_at())
    plan_job(job_id)
    assert job_repo.status_of(job_id) == JobStatus.RUNNING
    job_repo.note_workers(job_id, {"w:1": {"spawned_at": now() - 2.0, "ready_at": now() - 1.0,
                                           "loaded_at": now() - 0.5}})
    ph = status(job_id)["phases"]
    assert ph["startup"] > 0 and ph["pin"] >= 0 and ph["plan"] >= 0 and ph["pool_start"] >= 0
    assert ph["wall"] is ph["execute"] is ph["publish"] is None
    assert status(job_id)["phases"] == ph
    assert ph["workers"] == [{"worker": "w:1", "start": 1.0, "model_load": 0.5, "busy": None, "idle": None,
                              "shards": None}]
