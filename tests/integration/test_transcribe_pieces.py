"""Task transcribe with a long file staged in pieces, with the real Whisper tiny.en: a file longer
than a shard (`shards.max_tokens`, in audio seconds) is planned as consecutive runs of its
windows, run on several shards (and workers), and published as one row stitched from them, equal
to the row one unsplit run gives; a piece that fails fails its file alone, with the window's
times; a cancelled job does not publish a file whose pieces did not all commit."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from batchinf import failpoints
from batchinf.bundles import import_bundle
from batchinf.config import settings
from batchinf.controller import cancel, drive
from batchinf.dispatch import run_shard
from batchinf.ledger import retry_records
from batchinf.ledger import shards as shard_repo
from batchinf.ledger.jobs import get as job_row
from batchinf.ledger.states import JobStatus
from batchinf.ledger.status import page_errors, status
from batchinf.manifest import parse_manifest
from batchinf.parts import read_table
from batchinf.scopes import Caller
from batchinf.submit import submit
from batchinf.verify import PARTIAL, verify_output
from tests.helpers.real_models import whisper_tiny_en_dir
from tests.helpers.speech import SENTENCES, long_clip, synth, wer
from tests.helpers.stages import plan_job

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LONG = "long-0.wav"
SHORT = {"a.wav": synth(SENTENCES[1], "en-us", 160), "b.wav": synth(SENTENCES[7], "en-gb", 170)}


@pytest.fixture
def tiny_en(bi_home: Path) -> str:
    return import_bundle(whisper_tiny_en_dir(), "tiny-en", alias="prod").digest


@pytest.fixture
def audio(tmp_path: Path) -> Path:
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / LONG).write_bytes(long_clip(0)[1])       # 157 s: six windows of 24-28 s
    for key, data in SHORT.items():
        (inp / key).write_bytes(data)
    return inp


def _manifest(inp: Path, out: Path, shards: dict, **options: object) -> dict:
    return {"name": out.name, "task": "transcribe", "bundle": "tiny-en@prod", "output": {"uri": str(out)},
            "input": {"uri": str(inp) + "/", "format": "audio"}, "shards": shards, "options": options}


def _run(inp: Path, out: Path, shards: dict, workers: int = 1, on_tick: Any = None,
         **options: object) -> tuple[str, dict, dict, dict]:
    job_id, _ = submit(parse_manifest(_manifest(inp, out, shards, **options)), Caller("default", operator=True))
    assert drive(job_id, workers=workers, threads=1, on_tick=on_tick) == JobStatus.SUCCEEDED
    res = {r["record_id"]: r for r in pq.read_table(out, ignore_prefixes=["_", "errors", "srt", "vtt"]).to_pylist()}
    errs = {e["record_id"]: e for e in pq.read_table(out / "errors").to_pylist()} if (out / "errors").exists() else {}
    return job_id, res, errs, json.loads((out / "_MANIFEST.json").read_text())


def test_a_long_file_runs_on_several_shards_and_is_published_as_the_unsplit_row(
        tiny_en: str, audio: Path, tmp_path: Path) -> None:
    # shards of at most 60 s of audio: the file is staged as pieces of at most 60 s (two windows each)
    job_id, res, errs, manifest = _run(audio, tmp_path / "out-pieces", {"max_records": 8, "max_tokens": 60},
                                       workers=2, formats=["srt", "vtt"])
    # shards of up to an hour: the file is one row (a piece holds up to a model batch of windows)
    whole_id, whole, _, whole_manifest = _run(audio, tmp_path / "out-whole", {"max_records": 8, "max_tokens": 3600},
                                              formats=["srt", "vtt"])
    assert errs == {} and sorted(res) == sorted([LONG, *SHORT]) == sorted(whole)
    plan = job_row(job_id).plan
    assert plan["records"] == 3 and plan["pieces"] >= 2 and "pieces" not in job_row(whole_id).plan

    # the ledger: the file's pieces ran in three shards or more, each committed by its own attempt
    assembled = [p for p in manifest["parts"] if "assembled_from" in p]
    assert [p["kind"] for p in assembled] == ["results"] and assembled[0]["rows"] == 1
    ran = {s.id: s for s in shard_repo.of_job(job_id)}
    assert len(assembled[0]["assembled_from"]) >= 3
    assert all(ran[s].status == "committed" and ran[s].bucket >= 0 for s in assembled[0]["assembled_from"])

    # one row, equal to the unsplit run's: segments in order, times monotonic, text joined from them
    long, ref = res[LONG], whole[LONG]
    times = [x for s in long["segments"] for x in (s["start"], s["end"])]
    assert times == sorted(times) and times[-1] <= long["duration_seconds"] + 0.02 and long["duration_seconds"] > 150
    assert [s["id"] for s in long["segments"]] == list(range(len(long["segments"])))
    assert long["text"] == "".join(s["text"] for s in long["segments"]).strip()
    assert {k: v for k, v in long.items() if k != "source"} == {k: v for k, v in ref.items() if k != "source"}
    assert wer([long_clip(0)[0]], [long["text"]]) <= 0.15       # the unsplit run's transcript, as good
    for key in SHORT:
        assert {k: v for k, v in res[key].items() if k != "source"} == {k: v for k, v in whole[key].items()
                                                                         if k != "source"}
    # subtitles rendered from the stitched row: the very bytes of the unsplit run's
    subs = {p["key"]: p["sha256"] for p in manifest["parts"] if p["kind"] in ("srt", "vtt")}
    assert subs == {p["key"]: p["sha256"] for p in whole_manifest["parts"] if p["kind"] in ("srt", "vtt")}
    assert f"srt/{LONG}.srt" in subs

    # counts are of files, never pieces, in the manifest and in the status
    c = manifest["counts"]
    assert (c["records_total"], c["records_succeeded"], c["records_failed"]) == (3, 3, 0)
    assert c["audio_seconds"] == pytest.approx(whole_manifest["counts"]["audio_seconds"])
    assert c["pieces"]["records"] == 1 and c["pieces"]["rows"] == plan["pieces"] + 1
    st = status(job_id)["counts"]
    assert (st["records_total"], st["records_done"], st["records_succeeded"], st["records_failed"]) == (3, 3, 3, 0)
    assert manifest["tokens"]["output"] == whole_manifest["tokens"]["output"]
    assert verify_output(str(tmp_path / "out-pieces"))["ok"]

    # again, each worker process killed (exit 137, as SIGKILL leaves it) right after writing its
    # first shard's files; their replacements run without the failpoint. The retried attempts
    # commit once each and the published parts are the same bytes
    os.environ["BATCHINF_FAILPOINTS"] = "execute.after_write=crash"
    try:
        killed_id, again, _, killed = _run(audio, tmp_path / "out-killed", {"max_records": 8, "max_tokens": 60},
                                           workers=2, on_tick=lambda: os.environ.pop("BATCHINF_FAILPOINTS", None),
                                           formats=["srt", "vtt"])
    finally:
        os.environ.pop("BATCHINF_FAILPOINTS", None)
    assert any(a == "lost" for a in _attempt_statuses(killed_id)), "a worker died and its attempt was retried"
    assert [(p["key"], p["kind"], p["sha256"], p["rows"]) for p in killed["parts"]] == \
        [(p["key"], p["kind"], p["sha256"], p["rows"]) for p in manifest["parts"]]
    assert killed["counts"] == manifest["counts"] and again == res


def _attempt_statuses(job_id: str) -> list[str]:
    from sqlalchemy import select

    from batchinf.ledger.db import tx
    from batchinf.ledger.tables import attempts, shards

    with tx() as conn:
        return list(conn.execute(select(attempts.c.status).join(shards, shards.c.id == attempts.c.shard_id)
                                 .where(shards.c.job_id == job_id)).scalars())


def test_a_failed_piece_fails_its_file_with_the_reason_and_the_others_succeed(
        tiny_en: str, audio: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINF_FAILPOINTS", f"execute.piece[{LONG}:1]=raise")
    failpoints.reload()
    try:
        job_id, res, errs, manifest = _run(audio, tmp_path / "out", {"max_records": 8, "max_tokens": 60})
    finally:
        monkeypatch.delenv("BATCHINF_FAILPOINTS")
        failpoints.reload()
    assert sorted(res) == sorted(SHORT) and list(errs) == [LONG]
    e = errs[LONG]
    assert e["error"] == "inference_error" and e["attempts"] == 1
    # the failed piece's first window, numbered and timed in the file (pieces of two windows each)
    at = re.search(r"failed at window 2 \((\d+\.\d\d)-(\d+\.\d\d) s\): FailpointError", e["message"])
    assert at and 45.0 < float(at[1]) < float(at[2]) <= 90.0, e["message"]     # the third window's times
    assert LONG in e["message"] and str(tmp_path / "in") in e["message"]
    assert [p for p in manifest["parts"] if "assembled_from" in p][0]["kind"] == "errors"
    c = manifest["counts"]
    assert (c["records_succeeded"], c["records_failed"]) == (2, 1) and c["pieces"]["failed"] == 1
    st = status(job_id)
    assert (st["counts"]["records_succeeded"], st["counts"]["records_failed"]) == (2, 1)
    assert st["errors"] == {"records": 1, "by_code": {"inference_error": 1}}
    page, _ = page_errors(job_id)
    assert [(r["record_id"], r["error"]) for r in page] == [(LONG, "inference_error")]
    # so `batchinf retry --errors inference_error` selects the file (all its pieces are planned again)
    assert retry_records.error_records(job_id, ["inference_error"]) == [(f"file://{tmp_path / 'in' / LONG}", 0)]
    assert verify_output(str(tmp_path / "out"))["ok"]


def test_a_cancelled_job_does_not_publish_a_file_whose_pieces_did_not_all_commit(
        tiny_en: str, audio: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(_manifest(audio, out, {"max_records": 8, "max_tokens": 60})),
                       Caller("default", operator=True))
    plan_job(job_id)
    shard_repo.dispatch_ready(job_id)
    planned = shard_repo.of_job(job_id)
    holds = {s.id: read_table(s.input_uri, columns=["record_id", "piece"]).to_pylist() for s in planned}
    pieces = [s for s in planned if any(r["record_id"] == LONG for r in holds[s.id])]
    assert len(pieces) >= 3
    left = pieces[-1]           # a shard with a piece of the long file is never run
    for s in planned:
        if s.id != left.id:
            assert run_shard(s.id, "cpu")
    assert cancel(job_id) == JobStatus.CANCELLED
    p = json.loads((out / PARTIAL).read_text())
    c = p["counts"]
    short = sum(1 for r in holds[left.id] if r["record_id"] != LONG)
    assert c["records_not_done"] == 1 + short and c["records_done"] == 2 - short
    assert c["records_done"] + c["records_not_done"] == c["records_total"] == 3
    rows = [r for part in p["parts"] if part["kind"] == "results" for r in read_table(f"{out}/{part['key']}").to_pylist()]
    assert LONG not in {r["record_id"] for r in rows} and len(rows) == c["records_succeeded"] == c["records_done"]
    assert left.id in {s["shard"] for s in p["shards_not_done"]}
    st = status(job_id)["counts"]
    assert st["records_succeeded"] == c["records_succeeded"] and st["records_done"] <= 3


def test_pieces_of_one_file_that_each_kill_their_worker_fail_the_file_once(
        tiny_en: str, audio: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that kills the decoder wherever it is read (a hostile file) poisons every piece it is
    staged in: each is quarantined alone, and the file is still one error row, not one a piece."""
    monkeypatch.setenv("BATCHINF_FAILPOINTS", f"execute.piece[{LONG}:0]=crash;execute.piece[{LONG}:2]=crash")
    monkeypatch.setenv("BATCHINF_MAX_ATTEMPTS", "1")
    settings.cache_clear()
    job_id, res, errs, manifest = _run(audio, tmp_path / "out", {"max_records": 8, "max_tokens": 60})
    assert sorted(res) == sorted(SHORT) and list(errs) == [LONG]
    assert errs[LONG]["error"] == "poison" and "killed the worker" in errs[LONG]["message"]
    assert "piece 1 of" in errs[LONG]["message"], errs[LONG]["message"]      # the first one quarantined, numbered from 1
    c = manifest["counts"]
    assert (c["records_total"], c["records_succeeded"], c["records_failed"]) == (3, 2, 1)
    st = status(job_id)
    assert (st["counts"]["records_succeeded"], st["counts"]["records_failed"]) == (2, 1)
    assert st["errors"] == {"records": 1, "by_code": {"poison": 1}}
    assert [(r["record_id"], r["error"]) for r in page_errors(job_id)[0]] == [(LONG, "poison")]
    assert verify_output(str(tmp_path / "out"))["ok"]
