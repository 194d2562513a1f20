"""`batchinf retry`: a new job over exactly the failed and unfinished records of a stopped job,
exactly once, with lineage; `run` of a finished job says how to get a new one; a changed manifest
under a used idempotency key is a conflict naming the fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from batchinf.controller import cancel, drive
from batchinf.errors import ManifestError
from batchinf.ledger import retry_records
from batchinf.ledger.status import status
from batchinf.manifest import parse_manifest
from batchinf.rerun import RerunConflict, input_errors_note, rerun_job
from batchinf.submit import IdempotencyConflict, submit
from batchinf.ledger import jobs as job_repo
from tests.helpers.env import OPERATOR
from batchinf.verify import MANIFEST, PARTIAL, verify_output
from tests.helpers.corpus import BAD_LINES, manifest, write_jsonl

pytestmark = pytest.mark.integration


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "BATCHINF_FAILPOINTS"}
    return subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def _records(out: Path, parts: list[dict]) -> list[tuple[str, int, str | None, str | None]]:
    """(source, ordinal, record_id, error code or None) of every row of these Parquet parts."""
    rows = []
    for p in parts:
        if p["kind"] == "openai":
            continue
        t = pq.read_table(out / p["key"]).to_pylist()
        rows += [(r["source"], r["ordinal"], r["record_id"], r.get("error") if p["kind"] == "errors" else None)
                 for r in t]
    return rows


def test_retry_runs_exactly_the_failed_and_unfinished_records(tmp_path: Path, tiny_bundle: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    good = write_jsonl(tmp_path / "in" / "a.jsonl", 600, seed=3)
    good.update(write_jsonl(tmp_path / "in" / "b.jsonl", 150, seed=4, bad=False, prefix="b"))
    n_lines = {"a.jsonl": 600 + 6, "b.jsonl": 150}
    victim = max(good, key=lambda r: len(good[r]))       # longest: its shard is dispatched first
    out = tmp_path / "out"
    m = manifest(str(tmp_path / "in") + "/", str(out), shards={"max_records": 40})
    monkeypatch.setenv("BATCHINF_FAILPOINTS", f"execute.record[{victim}]=raise;execute.after_write=sleep(0.3)")
    old, _ = submit(parse_manifest(m), OPERATOR)
    runner = threading.Thread(target=drive, args=(old,), kwargs={"workers": 1, "threads": 1}, daemon=True)
    runner.start()
    deadline = time.monotonic() + 120
    while not retry_records.error_records(old, ["inference_error"]):
        assert time.monotonic() < deadline, status(old)
        time.sleep(0.2)
    with pytest.raises(RerunConflict, match="is running"):
        rerun_job(job_repo.get(old), OPERATOR, errors=["inference_error"])           # still active: nothing to retry yet
    cancel(old, finish=False)
    runner.join(timeout=60)
    monkeypatch.delenv("BATCHINF_FAILPOINTS")
    assert status(old)["status"] == "cancelled"

    # the oracle, from the old output alone: its inference_error rows, and every line it never wrote
    partial = json.loads((out / PARTIAL).read_text())
    done = _records(out, partial["parts"])
    every = {(str(tmp_path / "in" / f), o) for f, n in n_lines.items() for o in range(n)}
    seen = {(s.removeprefix("file://"), o) for s, o, _, _ in done}
    not_done = every - seen
    failed = {(s.removeprefix("file://"), o) for s, o, _, e in done if e == "inference_error"}
    assert failed and not_done, "the scenario must leave both failed and unfinished records"

    r = _cli("retry", old, "--errors", "inference_error", "--not-done", "--workers", "1", "--device", "cpu",
             "--json")
    assert r.returncode == 0, r.stderr
    new = json.loads(r.stdout)
    assert new["status"] == "succeeded" and new["retry_of"] == old
    assert new["counts"]["records_total"] == len(failed | not_done)
    new_out = Path(new["output_uri"].removeprefix("file://"))
    assert new_out == Path(str(out) + "-retry-1")

    published = json.loads((new_out / MANIFEST).read_text())
    rows = _records(new_out, published["parts"])
    got = [(s.removeprefix("file://"), o) for s, o, _, _ in rows]
    assert len(got) == len(set(got)), "a record ran twice"
    assert set(got) == failed | not_done, "exactly the selected records, nothing else"
    assert victim in {rid for _, _, rid, e in rows if e is None}, "the failed record now has its result"
    assert verify_output(new["output_uri"])["ok"]

    # lineage, both ways, in the status objects and the output manifests
    assert published["retry_of"]["job_id"] == old
    assert status(old)["retries"] == [new["job_id"]]
    assert [x["job_id"] for x in json.loads((out / PARTIAL).read_text())["retries"]] == [new["job_id"]]
    assert published["inputs"] and all(i["ordinals"] for i in published["inputs"])
    old_pins = {(i["uri"], i["etag"], i["size"]) for i in partial["inputs"]}
    assert {(i["uri"], i["etag"], i["size"]) for i in published["inputs"]} <= old_pins   # same versions

    with pytest.raises(ManifestError, match="nothing to retry"):
        rerun_job(job_repo.get(new["job_id"]), OPERATOR, errors=["inference_error"])
    with pytest.raises(ManifestError, match="say what to run again"):
        rerun_job(job_repo.get(old), OPERATOR)


def test_errors_all_leaves_out_input_errors_and_says_so(tmp_path: Path, tiny_bundle: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A retry runs the same pinned input and bundle: an input error (malformed JSON, no id, ...)
    would come back the same, so `--errors all` runs only errors that running can change, says
    what it left out, and naming an input error's code is refused with the fix."""
    write_jsonl(tmp_path / "in" / "a.jsonl", 20, seed=5)
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.record[r3]=raise")
    old, _ = submit(parse_manifest(manifest(str(tmp_path / "in") + "/", str(tmp_path / "out"))), OPERATOR)
    drive(old, workers=1, threads=1)
    monkeypatch.delenv("BATCHINF_FAILPOINTS")
    codes = dict(sorted((code, 1) for _, code in BAD_LINES))
    assert retry_records.input_error_counts(old) == codes
    with pytest.raises(ManifestError, match="malformed_json, missing_id are input errors of job .*Fix the input"):
        rerun_job(job_repo.get(old), OPERATOR, errors=["malformed_json", "missing_id"])
    every = rerun_job(job_repo.get(old), OPERATOR, errors=["all"])
    assert every.input_errors == codes
    picked = retry_records.selection(every.job_id)
    assert [(s.removeprefix("file://"), o) for s, ords in picked.items() for o in ords] == [
        (str(tmp_path / "in" / "a.jsonl"), 3)]                                      # r3's inference_error only
    note = input_errors_note(every)
    assert note.startswith(f"not retried: {len(BAD_LINES)} input errors (duplicate_id: 1, empty_text: 1,")
    assert "fix the input" in note


def test_run_of_a_failed_manifest_says_how_to_get_a_new_job(tmp_path: Path, tiny_bundle: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(str(tmp_path / "missing") + "/", str(tmp_path / "out"))))
    first = _cli("run", str(path), "--json")
    assert first.returncode == 1 and json.loads(first.stdout)["status"] == "failed"
    again = _cli("run", str(path))
    job_id = json.loads(first.stdout)["job_id"]
    assert again.returncode == 1
    assert "resuming" not in again.stderr
    flat = " ".join(again.stderr.split())
    assert f"{job_id} already failed" in flat
    assert f"batchinf retry {job_id} --not-done" in flat and "new idempotency_key" in flat


def test_a_changed_manifest_under_a_used_key_is_a_conflict(tmp_path: Path, tiny_bundle: str) -> None:
    write_jsonl(tmp_path / "a.jsonl", 5, bad=False)
    m = manifest(str(tmp_path / "a.jsonl"), str(tmp_path / "out"), idempotency_key="nightly-1")
    job_id, created = submit(parse_manifest(m), OPERATOR)
    assert created
    assert submit(parse_manifest(m), OPERATOR) == (job_id, False)          # the same manifest: the same job
    changed = {**m, "output": {"uri": str(tmp_path / "out2")}, "options": {"max_length": 64}}
    with pytest.raises(IdempotencyConflict) as err:
        submit(parse_manifest(changed), OPERATOR)
    assert "output.uri" in str(err.value) and "options.max_length" in str(err.value)
    assert "bundle" not in str(err.value).split("differ:")[1]
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump(changed))
    r = _cli("submit", str(path))
    assert r.returncode == 2
    flat = " ".join(r.stderr.split())
    assert f"idempotency_key 'nightly-1' was used by job {job_id}" in flat and "differ: options.max_length, output.uri." in flat
