"""Dynamic splitting of a generate shard: asked to split, its continuous batch admits nothing more,
finishes the sequences in flight, and commits those records (not a prefix of the staged order:
admission is longest max_tokens first); the records never admitted become its children, in
staged order. With seeded sampling every record's answer is byte-identical to an unsplit run's,
and the job's coverage stays exactly once."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from batchinf import failpoints
from batchinf.bundles import import_bundle, open_runtime
from batchinf.config import settings
from batchinf.dispatch import Dispatcher
from batchinf.execute import execute_shard
from batchinf.ledger import jobs, shards, splits
from batchinf.ledger.models import Lease
from batchinf.ledger.states import JobStatus, ShardStatus
from batchinf.lifecycle import step
from batchinf.manifest import parse_manifest
from batchinf.parts import read_table
from batchinf.runtime.generation.sampling import SamplingParams
from batchinf.runtime.generation.seq import GenRequest
from batchinf.runtime.generation.sampling import derive_seed
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.verify import verify_output
from tests.helpers.stages import InProcess, lease_one_shard
from tests.helpers.tiny_llama import make_tiny_llama

RECORDS = 12
SLOTS = 3
WORDS = "the people of the world make water and light every day of the year".split()


@pytest.fixture(autouse=True)
def splittable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINF_SPLIT_CHUNK_TOKENS", "150")
    monkeypatch.setenv("BATCHINF_MIN_SHARD_TOKENS", "1")
    settings.cache_clear()


@pytest.fixture
def tiny_llama(bi_home: Path, tmp_path: Path) -> str:
    return import_bundle(make_tiny_llama(tmp_path / "tiny-llama"), "tinyllama", alias="prod").digest


def _lines(path: Path) -> Path:
    """OpenAI batch lines whose longer prompts ask for more tokens: admitted longest max_tokens
    first, the staged order's (by prompt length) tail runs first. Every third line brings its
    own seed."""
    lines = []
    for i in range(RECORDS):
        body: dict[str, Any] = {"prompt": " ".join(WORDS[: 1 + i]), "max_tokens": 4 + i}
        if i % 3 == 0:
            body["seed"] = 100 + i
        lines.append({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": body})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _leased_job(inp: Path, out: Path) -> tuple[str, Lease]:
    raw = {"name": out.name, "task": "generate", "bundle": "tinyllama@prod",
           "input": {"uri": str(inp), "format": "openai-batch"}, "output": {"uri": str(out)},
           "shards": {"max_records": 4096},
           "options": {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 7, "max_slots": SLOTS}}
    job_id, _ = submit(parse_manifest(raw), OPERATOR)
    return job_id, lease_one_shard(job_id)


def _finish(job_id: str, out: Path, failing: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Run what is left in this process, publish; every record exactly once, an error row for
    each of `failing` and a result for each other one; result rows by record id."""
    d, t0 = InProcess(), time.monotonic()
    while jobs.get(job_id).status != JobStatus.SUCCEEDED and time.monotonic() - t0 < 120:
        assert step(job_id, d)
    assert jobs.get(job_id).status == JobStatus.SUCCEEDED, jobs.get(job_id).error
    assert verify_output(str(out))["ok"]                       # coverage exactly once, digests, counts
    rows = pq.read_table(out, ignore_prefixes=["_", "errors", "openai"]).to_pylist()
    assert sorted(r["record_id"] for r in rows) == sorted(f"q{i}" for i in range(RECORDS) if f"q{i}" not in failing)
    errors = pq.read_table(out / "errors").to_pylist() if failing else []
    assert [(e["record_id"], e["error"]) for e in errors] == [(f, "inference_error") for f in failing]
    return {r["record_id"]: r for r in rows}


@pytest.mark.slow
def test_a_split_generate_shard_gives_every_record_the_unsplit_answer(tmp_path: Path, tiny_llama: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    inp = _lines(tmp_path / "in" / "batch.jsonl")
    whole_id, whole_lease = _leased_job(inp, tmp_path / "whole")
    execute_shard(whole_lease)
    assert [s.parent_id for s in shards.of_job(whole_id)] == [None]
    whole = _finish(whole_id, tmp_path / "whole")

    job_id, lease = _leased_job(inp, tmp_path / "split")
    assert splits.request_split(job_id, 2, 1) == [lease.shard_id]
    staged = read_table(shards.get(lease.shard_id).input_uri)
    result = execute_shard(lease)
    parent = shards.get(lease.shard_id)
    children = sorted((s for s in shards.of_job(job_id) if s.parent_id == parent.id), key=lambda s: s.ordinal)
    # the first admission (SLOTS sequences) and the refill of the first slot freed finished, then
    # nothing more was admitted
    n = parent.num_records
    assert parent.status == ShardStatus.COMMITTED and SLOTS < n < RECORDS - 2 and n == result.output_rows
    assert len(children) == 2 and all(c.status == ShardStatus.PENDING for c in children)
    assert parent.num_records + sum(c.num_records for c in children) == RECORDS
    assert parent.num_tokens + sum(c.num_tokens for c in children) == sum(staged.column("n_tokens").to_pylist())
    done = read_table(parent.output_uri).column("record_id").to_pylist()
    order = staged.column("record_id").to_pylist()
    assert done == order[-n:] == [f"q{i}" for i in range(RECORDS - n, RECORDS)]   # not a prefix
    left = [rid for c in children for rid in read_table(c.input_uri).column("record_id").to_pylist()]
    assert left == [rid for rid in order if rid not in done]   # children keep the staged order

    split = _finish(job_id, tmp_path / "split")
    assert split == whole                  # every column of every record, sampled text included
    assert len({r["text"] for r in split.values()}) > RECORDS // 2
    assert {r["seed"] for r in split.values()} == {100 + i if i % 3 == 0 else derive_seed(7, f"q{i}")
                                                   for i in range(RECORDS)}

    # a record of the first admission raises: the batch is isolated in halves, each admitting
    # its first requests before the split stops it; the failure and every answer count once
    job_id, lease = _leased_job(inp, tmp_path / "failing")
    assert splits.request_split(job_id, 2, 1) == [lease.shard_id]
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.record[q10]=raise")
    failpoints.reload()
    try:
        result = execute_shard(lease)
    finally:
        monkeypatch.delenv("BATCHINF_FAILPOINTS")
        failpoints.reload()
    assert result.error_rows == 1 and 0 < shards.get(lease.shard_id).num_records < RECORDS
    assert any(s.parent_id == lease.shard_id for s in shards.of_job(job_id))
    failing = _finish(job_id, tmp_path / "failing", failing=("q10",))
    assert failing == {rid: r for rid, r in whole.items() if rid != "q10"}


class Idle(Dispatcher):
    """Two workers, both idle as far as the lifecycle knows: the test plays the one that runs."""

    def workers(self, route: object = None) -> int | None:
        return 2


def test_the_lifecycle_sizes_a_generate_split_by_its_decode_work(tmp_path: Path, tiny_llama: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A generate shard's num_tokens counts its prompts only; the tokens its records may decode
    are work too, so a shard whose prompts alone are under the split minimum (a sixth of
    BATCHINF_MIN_SHARD_TOKENS, `sizing.min_split_work`) is split."""
    job_id, lease = _leased_job(_lines(tmp_path / "in" / "batch.jsonl"), tmp_path / "out")
    prompts = shards.get(lease.shard_id).num_tokens
    decode = sum(4 + i for i in range(RECORDS))
    assert jobs.get(job_id).plan["work_per_token"] == round((prompts + decode) / prompts, 4)
    monkeypatch.setenv("BATCHINF_MIN_SHARD_TOKENS", str(6 * int((prompts + decode) * 1.05)))
    settings.cache_clear()
    assert step(job_id, Idle()) and splits.wanted(lease) != splits.SPLIT        # too little work left
    least = int((prompts + decode) * 0.95)
    assert least > prompts
    monkeypatch.setenv("BATCHINF_MIN_SHARD_TOKENS", str(6 * least))
    settings.cache_clear()
    assert step(job_id, Idle()) and splits.wanted(lease) == splits.SPLIT            # more than its prompts alone


def test_admission_stops_when_asked_and_the_rest_runs_alike(tmp_path: Path, tiny_llama: str) -> None:
    """The runtime alone: stop_admitting is first asked as a freed slot is refilled; the sequences in
    flight finish; running the requests it never admitted later gives what one uninterrupted call does."""
    rt = open_runtime(tiny_llama)
    reqs = [GenRequest(i, rt.encode_prompt(" ".join(WORDS[: 2 + i])),
                       SamplingParams(max_tokens=3 + 2 * i, temperature=1.0, seed=derive_seed(3, str(i))))
            for i in range(8)]
    whole = {r.key: r for r in rt.generate(reqs, max_slots=SLOTS)}
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return True

    first = {r.key: r for r in rt.generate(reqs, max_slots=SLOTS, stop_admitting=stop)}
    # longest max_tokens admitted first, then the first slot freed refilled before the split
    assert len(asked) == 1 and sorted(first) == [4, 5, 6, 7]
    rest = {r.key: r for r in rt.generate([q for q in reqs if q.key not in first], max_slots=SLOTS)}
    assert {**first, **rest} == whole


def test_abort_stops_at_the_next_decode_step_and_the_rest_runs_alike(tiny_llama: str) -> None:
    """A cancel reaches generation at its next decode step: the sequences that finished before it
    keep their answers, those in flight and never admitted get none, and running those later gives
    what one uninterrupted call does."""
    rt = open_runtime(tiny_llama)
    reqs = [GenRequest(i, rt.encode_prompt(" ".join(WORDS[: 2 + i])),
                       SamplingParams(max_tokens=2 + 3 * i, temperature=1.0, seed=derive_seed(5, str(i))))
            for i in range(8)]
    whole = {r.key: r for r in rt.generate(reqs, max_slots=SLOTS)}
    first: dict[int, Any] = {}
    for r in rt.generate(reqs, max_slots=SLOTS, abort=lambda: bool(first)):    # cancelled once one is done
        first[r.key] = r
    assert 0 < len(first) < SLOTS                                   # the others in flight got nothing
    assert all(whole[k] == r for k, r in first.items())
    rest = {r.key: r for r in rt.generate([q for q in reqs if q.key not in first], max_slots=SLOTS)}
    assert {**first, **rest} == whole
