"""Chaos: real worker processes under injected faults, over seeds. Every scenario must end
`succeeded` with exactly-once coverage, no lease left held, and no part from a losing attempt.

CI runs the short sweep (BATCHINF_CHAOS_SEEDS unset: 1 seed per scenario). The long mode is
`BATCHINF_CHAOS_SEEDS=20 .venv/bin/python -m pytest -q tests/chaos`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy import select

from batchinf.config import settings
from batchinf.controller import drive
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.ledger.db import tx
from batchinf.ledger.tables import attempts, shards
from batchinf.manifest import parse_manifest
from batchinf.verify import MANIFEST, verify_output
from tests.helpers.corpus import BAD_LINES, manifest, write_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.slow]

SCENARIOS = {
    # crashes (process exits as on SIGKILL) at every execute point, at random
    "crash-anywhere": "execute.before_write=0.15*crash;execute.after_write=0.15*crash;"
                      "execute.before_commit=0.15*crash;execute.after_commit=0.15*crash",
    # storage faults on a fraction of reads and writes
    "storage-faults": "store.put=0.2*raise;store.get=0.1*raise",
    # a record that raises and a record that kills its worker, plus slow commits
    "poison": "execute.record[r13]=raise;execute.record[r77]=crash;execute.before_commit=0.2*sleep(0.2)",
}
SEEDS = range(int(os.environ.get("BATCHINF_CHAOS_SEEDS", "1")))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_chaos(scenario: str, seed: int, tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    good = write_jsonl(tmp_path / "a.jsonl", 240, seed=seed)
    monkeypatch.setenv("BATCHINF_FAILPOINTS", SCENARIOS[scenario])
    monkeypatch.setenv("BATCHINF_FAILPOINTS_SEED", str(seed))
    # enough attempts that random crashes alone (not a poison record) never exhaust a shard
    monkeypatch.setenv("BATCHINF_MAX_ATTEMPTS", "3" if scenario == "poison" else "20")
    monkeypatch.setenv("BATCHINF_JOB_RETRY_BUDGET", "1000")
    settings.cache_clear()
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "a.jsonl"), str(out), shards={"max_records": 24})), OPERATOR)
    # the worker processes read the faults from their environment at start; this process loaded
    # failpoints before they were set, so planning and publishing here run clean
    final = drive(job_id, workers=2, threads=1)
    assert final == "succeeded"

    assert verify_output(str(out))["ok"]           # exactly-once coverage, digests, counts
    results = pq.read_table(out, ignore_prefixes=["_", "errors"]).column("record_id").to_pylist()
    errors = pq.read_table(out / "errors").to_pylist()
    expected_errors = len(BAD_LINES) + (2 if scenario == "poison" else 0)
    assert len(errors) == expected_errors
    assert sorted(results) == sorted(set(good) - ({"r13", "r77"} if scenario == "poison" else set()))
    if scenario == "poison":
        assert {(e["record_id"], e["error"]) for e in errors} >= {("r13", "inference_error"), ("r77", "poison")}
    with tx() as conn:                             # the faults really happened and were retried
        retried = conn.execute(select(attempts.c.status).where(attempts.c.status != "committed")).all()
    assert retried, "no fault was injected; the scenario tested nothing"

    m = json.loads((out / MANIFEST).read_text())
    with tx() as conn:
        assert not conn.execute(select(shards.c.id).where(shards.c.job_id == job_id,
                                                          shards.c.lease_owner.is_not(None))).all()
        winners = {r.id: r for r in conn.execute(select(shards).where(shards.c.job_id == job_id)).all()}
        committed = {(a.shard_id, a.number) for a in conn.execute(
            select(attempts).where(attempts.c.status == "committed")).all()}
    for p in m["parts"]:                           # every part is its shard's winning attempt's file
        sh = winners[p["shard"]]
        sha = sh.output_sha256 if p["kind"] == "results" else sh.errors_sha256
        assert p["sha256"] == sha
        assert sh.status == "quarantined" or (sh.id, sh.attempt) in committed
