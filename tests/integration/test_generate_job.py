"""Generate jobs end to end (embedded mode, real worker processes) on a tiny generated Llama bundle:
JSONL prompts on file://, chat messages on S3, the OpenAI batch format (generate and embeddings),
and a retried shard that reproduces byte-identical outputs with sampling on."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sqlalchemy import select, update

from batchinf import failpoints
from batchinf.bundles import import_bundle, open_runtime
from batchinf.controller import cancel, drive
from batchinf.errors import VerificationError
from batchinf.execute import execute_shard
from batchinf.ledger.jobs import get as job_row
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.ledger import leases as lease_repo
from batchinf.ledger import shards as shard_repo
from batchinf.ledger.db import tx
from batchinf.ledger.tables import attempts, shards
from batchinf.manifest import parse_manifest
from batchinf.parts import read_table
from tests.helpers.stages import plan_job
from batchinf.runtime.generation.sampling import SamplingParams
from batchinf.runtime.generation.seq import GenRequest
from batchinf.runtime.generation.sampling import derive_seed
from batchinf.store import get_store, join
from tests.helpers.stages import publish_job
from batchinf.verify import MANIFEST, PARTIAL, SUCCESS, verify_output
from batchinf.retry_policy import RetryPolicy
from tests.helpers.corpus import texts as corpus_texts

pytestmark = pytest.mark.integration


@pytest.fixture
def tiny_llama(bi_home: Path, tmp_path: Path) -> str:
    """A tiny random Llama (context 256) imported as `tinyllama@prod`; returns its digest."""
    from tests.helpers.tiny_llama import make_tiny_llama

    return import_bundle(make_tiny_llama(tmp_path / "tiny-llama"), "tinyllama", alias="prod").digest


def texts(n: int, seed: int, median_words: int = 8) -> list[str]:
    """Heavy-tailed texts, at most 30 words (the tiny model's context is 256 tokens)."""
    return [" ".join(t.split()[:30]) for t in corpus_texts(n, seed=seed, median_words=median_words)]


def job(input_uri: str, output_uri: str, *, fmt: str = "jsonl", task: str = "generate",
        bundle: str = "tinyllama@prod", **extra: Any) -> dict[str, Any]:
    return {"name": "test-generate", "task": task, "bundle": bundle,
            "input": {"uri": input_uri, "format": fmt, **extra.pop("input", {})},
            "output": {"uri": output_uri}, "shards": {"max_records": 8}, **extra}


def run(manifest: dict[str, Any]) -> tuple[str, dict[str, Any], list[dict], list[dict]]:
    """Submit and drive to the end in worker processes; (job id, _MANIFEST.json, results, errors)."""
    job_id, _ = submit(parse_manifest(manifest), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == "succeeded", job_row(job_id).error
    return (job_id, *read_output(manifest["output"]["uri"]))


def read_output(out: str) -> tuple[dict[str, Any], list[dict], list[dict]]:
    store = get_store(out)
    assert store.exists(join(out, SUCCESS))
    assert verify_output(out)["ok"]           # digests, coverage, counts, openai/ re-rendered
    m = json.loads(store.get_bytes(join(out, MANIFEST)))
    rows = {"results": [], "errors": []}
    for p in m["parts"]:
        if p["kind"] in rows:
            rows[p["kind"]] += read_table(join(out, p["key"])).to_pylist()
    return m, rows["results"], rows["errors"]


def covered_once(results: list[dict], errors: list[dict], n_lines: int) -> None:
    keys = sorted(r["ordinal"] for r in results + errors)
    assert keys == list(range(n_lines)), "every input line exactly once across results and errors"


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    return path


def greedy_reference(digest: str, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, Any]:
    """Our runtime called directly, one sequence at a time."""
    runtime = open_runtime(digest)
    out = {}
    for rid, ids in prompts.items():
        (res,) = runtime.generate([GenRequest(0, ids, SamplingParams(max_tokens=max_tokens))])
        out[rid] = res
    return out


@pytest.mark.slow
def test_prompts_on_file(tmp_path: Path, tiny_llama: str) -> None:
    prompts = {f"p{i}": t for i, t in enumerate(texts(30, seed=3, median_words=6))}
    lines: list[Any] = [{"id": rid, "q": t} for rid, t in prompts.items()]
    lines += [{"id": "no-prompt"}, {"id": "long", "q": "model batch " * 200}, {"id": "p0", "q": "duplicate"},
              b"{not json"]
    write_lines(tmp_path / "in" / "prompts.jsonl", lines)
    out = tmp_path / "out"
    _, m, results, errors = run(job(str(tmp_path / "in") + "/", str(out), input={"prompt_field": "q"},
                                    options={"max_tokens": 12, "max_slots": 4}))
    covered_once(results, errors, len(lines))
    assert {e["record_id"]: e["error"] for e in errors} == {
        "no-prompt": "missing_prompt", "long": "prompt_too_long", "p0": "duplicate_id", None: "malformed_json"}
    too_long = next(e["message"] for e in errors if e["error"] == "prompt_too_long")
    assert "+ max_tokens 12" in too_long and "context length 256" in too_long and "shorten the prompt" in too_long
    assert not (out / "openai").exists()

    runtime = open_runtime(tiny_llama, with_model=False)
    want = greedy_reference(tiny_llama, {rid: runtime.encode_prompt(prompts[rid]) for rid in prompts}, 12)
    got = {r["record_id"]: r for r in results}
    assert sorted(got) == sorted(prompts)
    for rid, r in got.items():
        assert (r["output_ids"], r["text"], r["finish_reason"]) == (want[rid].token_ids, want[rid].text,
                                                                     want[rid].finish_reason), rid
        assert r["kind"] == "completion" and r["input_tokens"] == len(runtime.encode_prompt(prompts[rid]))
        assert r["seed"] == derive_seed(0, rid)
    reasons = [r["finish_reason"] for r in results]
    assert m["counts"]["finish_reasons"] == {k: reasons.count(k) for k in sorted(set(reasons))}
    assert m["tokens"]["input"] == sum(r["input_tokens"] for r in results)
    assert m["tokens"]["output"] == sum(r["output_tokens"] for r in results) > 0
    assert 0 < m["tokens"]["real"] <= m["tokens"]["padded"]


@pytest.mark.slow
def test_chat_messages_on_s3_and_a_record_that_raises(s3_bucket: str, tiny_llama: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    convs = {f"m{i}": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": t}]
             for i, t in enumerate(texts(20, seed=5))}
    lines = [{"id": rid, "chat": msgs} for rid, msgs in convs.items()]
    lines.append({"id": "bad-role", "chat": [{"role": "robot", "content": "beep"}]})
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    get_store(s3_bucket).put_bytes(f"{s3_bucket}/in/chat.jsonl", data)
    # read by the worker processes at their start: generating m3 raises there
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.record[m3]=raise")
    out = f"{s3_bucket}/out/"
    _, m, results, errors = run(job(f"{s3_bucket}/in/", out, input={"messages_field": "chat"},
                                    options={"max_tokens": 10, "seed": 42}))
    covered_once(results, errors, len(lines))
    assert {e["record_id"]: e["error"] for e in errors} == {"bad-role": "invalid_messages", "m3": "inference_error"}
    assert "failpoint execute.record[m3] raised" in next(e["message"] for e in errors if e["record_id"] == "m3")
    assert "role 'robot'" in next(e["message"] for e in errors if e["record_id"] == "bad-role")

    runtime = open_runtime(tiny_llama, with_model=False)
    ids = {rid: runtime.encode_chat(convs[rid]) for rid in convs if rid != "m3"}
    want = greedy_reference(tiny_llama, ids, 10)
    assert sorted(r["record_id"] for r in results) == sorted(ids)
    for r in results:
        assert r["kind"] == "chat" and r["seed"] == derive_seed(42, r["record_id"])
        assert r["output_ids"] == want[r["record_id"]].token_ids and r["text"] == want[r["record_id"]].text
    assert m["counts"]["records_succeeded"] == len(ids) and m["counts"]["records_failed"] == 2


def openai_lines(n_chat: int, n_completion: int) -> list[Any]:
    qs = texts(n_chat + n_completion, seed=11, median_words=5)
    lines: list[Any] = []
    for i, q in enumerate(qs):
        if i < n_chat:
            body: dict[str, Any] = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": q}],
                                    "max_completion_tokens": 6 + i % 9}
        else:
            body = {"prompt": q, "max_tokens": 4 + i % 7, "temperature": 1.2, "seed": 1000 + i}
        url = "/v1/chat/completions" if i < n_chat else "/v1/completions"
        lines.append({"custom_id": f"q{i}", "method": "POST", "url": url, "body": body})
    lines += [
        b'{"custom_id": "broken", "method": "POST"',                      # malformed JSON
        {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "many", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "n": 2}},
        {"custom_id": "q0", "method": "POST", "url": "/v1/completions", "body": {"prompt": "dup"}},
        {"custom_id": "listy", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}},
    ]
    return lines


def parse_openai(out: Path, m: dict[str, Any]) -> list[dict[str, Any]]:
    files = [p["key"] for p in m["parts"] if p["kind"] == "openai"]
    assert sorted(str(p.relative_to(out)) for p in (out / "openai").iterdir()) == sorted(files)
    return [json.loads(x) for f in files for x in (out / f).read_bytes().splitlines()]


@pytest.mark.slow
def test_openai_batch_generate_round_trip(tmp_path: Path, tiny_llama: str) -> None:
    lines = openai_lines(10, 8)
    # fits the context (256) but not the KV budget of 200 tokens
    lines.append({"custom_id": "greedy-budget", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": "the model", "max_tokens": 199}})
    # the same prompt without and with stop strings: the second answer is the first cut at a stop
    stops = ["e", "a", "o", "t", "n"]
    lines += [{"custom_id": cid, "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "the batch model", "max_tokens": 16, **extra}}
              for cid, extra in (("nostop", {}), ("stopped", {"stop": stops}))]
    write_lines(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out"
    job_id, m, results, errors = run(job(str(tmp_path / "batch.jsonl"), str(out), fmt="openai-batch",
                                         options={"temperature": 0.0, "max_tokens": 16, "max_batch_tokens": 200}))
    covered_once(results, errors, len(lines))
    got = parse_openai(out, m)
    assert len(got) == len(lines)
    ids = [g["custom_id"] for g in got if g["custom_id"] is not None]
    # one line per input line: the duplicated q0 twice (once answered, once a duplicate_id error)
    extra = ["nostop", "stopped"]
    assert sorted(ids) == sorted([f"q{i}" for i in range(18)] + ["emb", "many", "q0", "listy", "greedy-budget"]
                                 + extra)
    by_code = {g["error"]["code"]: g for g in got if g["error"]}
    assert set(by_code) == {"malformed_json", "endpoint_mismatch", "unsupported_n", "duplicate_id",
                            "unsupported_prompt", "prompt_too_long"}
    assert "exceeds options.max_batch_tokens (the KV-cache budget) 200; raise options.max_batch_tokens" in \
        by_code["prompt_too_long"]["error"]["message"]
    assert all(g["response"]["status_code"] == 400 for g in by_code.values())
    assert by_code["malformed_json"]["custom_id"] is None and "line 19" in by_code["malformed_json"]["error"]["message"]
    assert "job with task: embed" in by_code["endpoint_mismatch"]["response"]["body"]["error"]["message"]
    ok = {g["custom_id"]: g for g in got if g["error"] is None}
    rows = {r["record_id"]: r for r in results}
    assert sorted(ok) == sorted(rows) == sorted([f"q{i}" for i in range(18)] + extra)
    full, cut = rows["nostop"], rows["stopped"]
    del ok["nostop"], ok["stopped"]
    hits = [full["text"].find(x) for x in stops if x in full["text"]]
    if hits:
        assert (cut["text"], cut["finish_reason"]) == (full["text"][:min(hits)], "stop")
    else:
        assert cut["text"] == full["text"]
    created = int(job_row(job_id).created_at)
    for cid, g in ok.items():
        body, row = g["response"]["body"], rows[cid]
        assert g["response"]["status_code"] == 200 and body["created"] == created
        assert body["model"] == "tinyllama@prod"
        choice = body["choices"][0]
        text = choice["message"]["content"] if body["object"] == "chat.completion" else choice["text"]
        assert text == row["text"] and choice["finish_reason"] == row["finish_reason"]
        assert body["object"] == ("chat.completion" if int(cid[1:]) < 10 else "text_completion")
        assert body["usage"] == {"prompt_tokens": row["input_tokens"], "completion_tokens": row["output_tokens"],
                                 "total_tokens": row["input_tokens"] + row["output_tokens"]}
        i = int(cid[1:])
        # the line's own max tokens and seed were honoured
        assert row["output_tokens"] <= (6 + i % 9 if i < 10 else 4 + i % 7)
        assert row["seed"] == (derive_seed(0, cid) if i < 10 else 1000 + i)
    assert len({g["id"] for g in got}) == len(got)

    # `batchinf verify` re-renders the openai/ files: an edited answer is caught
    f = out / next(p["key"] for p in m["parts"] if p["kind"] == "openai" and not p["from"].startswith("errors/"))
    edited = f.read_bytes().replace(b'"finish_reason":"', b'"finish_reason": "', 1)
    assert edited != f.read_bytes()
    f.write_bytes(edited)
    with pytest.raises(VerificationError, match="sha256 differs"):
        verify_output(str(out))


@pytest.mark.slow
def test_a_cancelled_openai_batch_keeps_the_done_records_openai_lines(tmp_path: Path, tiny_llama: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Like a cancelled OpenAI batch: the records done before the cancel have their output lines,
    listed in _PARTIAL.json; the others have none."""
    write_lines(tmp_path / "batch.jsonl", openai_lines(20, 20)[:40])
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.after_write=sleep(0.5)")
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(job(str(tmp_path / "batch.jsonl"), str(out), fmt="openai-batch")), OPERATOR)

    def cancel_after_first_commit() -> None:
        with tx() as conn:
            done = conn.execute(select(shards.c.id).where(shards.c.job_id == job_id,
                                                          shards.c.status == "committed")).first()
        if done and job_row(job_id).status == "running":
            cancel(job_id)

    assert drive(job_id, workers=1, threads=1, on_tick=cancel_after_first_commit) == "cancelled"
    p = json.loads((out / PARTIAL).read_text())
    assert p["shards_done"] and p["shards_not_done"] and p["openai"]["job_id"] == job_id
    lines = parse_openai(out, p)
    got = [g for g in lines if g["response"] is not None]
    done = [r["record_id"] for part in p["parts"] if part["kind"] in ("results", "errors")
            for r in read_table(join(str(out), part["key"]), columns=["record_id"]).to_pylist()]
    assert len(got) == len(done) == p["counts"]["records_done"] < 40
    assert sorted(g["custom_id"] for g in got) == sorted(done)
    assert all(g["response"]["status_code"] == 200 for g in got)
    # the requests that never ran get a batch_cancelled line each, as OpenAI writes them
    not_run = [g for g in lines if g["response"] is None]
    assert {g["error"]["code"] for g in not_run} == {"batch_cancelled"}
    assert len(not_run) == p["counts"]["records_not_done"] and len(lines) == 40
    assert len({g["custom_id"] for g in lines}) == 40


@pytest.mark.slow
def test_openai_batch_embeddings_round_trip(tmp_path: Path, tiny_bundle: str) -> None:
    qs = texts(12, seed=2)
    lines: list[Any] = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": {"input": q, "model": "text-embedding-3-small"}} for i, q in enumerate(qs)]
    lines += [{"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": "hi"}]}},
              {"custom_id": "two", "method": "POST", "url": "/v1/embeddings",
               "body": {"input": [qs[1], qs[0]], "encoding_format": "base64"}},
              {"custom_id": "ids", "method": "POST", "url": "/v1/embeddings", "body": {"input": [[2, 5], [10 ** 6]]}},
              {"custom_id": "dims", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x", "dimensions": 8}},
              {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings", "body": {"input": "dup"}},
              b"\xff\xfe not utf-8"]
    write_lines(tmp_path / "emb.jsonl", lines)
    out = tmp_path / "out"
    _, m, results, errors = run(job(str(tmp_path / "emb.jsonl"), str(out), fmt="openai-batch", task="embed",
                                    bundle="tiny@prod"))
    covered_once(results, errors, len(lines))
    got = parse_openai(out, m)
    assert len(got) == len(lines)
    assert sorted(g["custom_id"] or "" for g in got) == sorted([f"e{i}" for i in range(12)] +
                                                               ["chat", "two", "ids", "dims", "e1", ""])
    assert {g["error"]["code"] for g in got if g["error"]} == {"endpoint_mismatch", "invalid_input",
                                                               "unsupported_dimensions", "duplicate_id", "invalid_utf8"}
    rows = {r["record_id"]: r for r in results}
    runtime = open_runtime(tiny_bundle)
    want, _ = runtime.embed([e.ids for e in runtime.tokenizer.encode_batch(qs)])
    (two,) = [g for g in got if g["custom_id"] == "two"]     # a list input: one line, its inputs' order
    vecs = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in two["response"]["body"]["data"]]
    assert [d["index"] for d in two["response"]["body"]["data"]] == [0, 1]
    assert np.allclose(vecs, [want[1], want[0]], atol=1e-5)
    assert rows["two"]["embedding"] is None and two["response"]["body"]["usage"]["prompt_tokens"] == (
        rows["e0"]["input_tokens"] + rows["e1"]["input_tokens"])
    for g in got:
        if g["error"] is None and g["custom_id"] != "two":
            (d,) = g["response"]["body"]["data"]
            vec = np.asarray(d["embedding"], dtype=np.float32)
            assert np.array_equal(vec, np.asarray(rows[g["custom_id"]]["embedding"], dtype=np.float32))
            ref = want[int(g["custom_id"][1:])]
            assert float(vec @ ref / np.linalg.norm(vec) / np.linalg.norm(ref)) > 0.9999
            assert g["response"]["body"]["usage"]["prompt_tokens"] == rows[g["custom_id"]]["input_tokens"]


def _normalised(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Response lines without what derives from the job's identity (ids, creation time)."""
    out = []
    for g in lines:
        g = json.loads(json.dumps(g))
        del g["id"], g["response"]["request_id"]
        g["response"]["body"].pop("id", None)
        g["response"]["body"].pop("created", None)
        out.append(g)
    return out


@pytest.mark.slow
def test_retried_shards_reproduce_identical_bytes_with_sampling(tmp_path: Path, tiny_llama: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling on (temperature, top-k, top-p; job seed and per-line seeds). A clean job runs in a
    worker process. The same input again: (1) with the first worker process killed right after
    writing its first shard's files (execute.after_write=crash; its replacement starts without
    the failpoint), (2) in this process, where every shard's first attempt writes its files and
    then raises, and the second commits. The retries write the same bytes as the failed attempts
    and as the clean job."""
    lines = openai_lines(12, 12)
    write_lines(tmp_path / "batch.jsonl", lines)
    opts = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 7, "max_tokens": 16}
    clean_out, retried_out = tmp_path / "clean", tmp_path / "retried"
    _, m_clean, _, _ = run(job(str(tmp_path / "batch.jsonl"), str(clean_out), fmt="openai-batch", options=opts))

    def results(m: dict[str, Any]) -> list[tuple[str, str, int]]:
        return [(p["key"], p["sha256"], p["rows"]) for p in m["parts"] if p["kind"] == "results"]

    # (1) a worker killed after writing: only the first worker process gets the failpoint
    killed_out = tmp_path / "killed"
    killed_id, _ = submit(parse_manifest(job(str(tmp_path / "batch.jsonl"), str(killed_out), fmt="openai-batch",
                                             options=opts)), OPERATOR)
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.after_write=crash")
    assert drive(killed_id, workers=1, threads=1,
                 on_tick=lambda: os.environ.pop("BATCHINF_FAILPOINTS", None)) == "succeeded"
    with tx() as conn:
        lost = conn.execute(select(attempts.c.number).join(shards, shards.c.id == attempts.c.shard_id).where(
            shards.c.job_id == killed_id, attempts.c.status == "lost")).scalars().all()
    assert lost == [1], "the first attempt of one shard died with its worker and was retried"
    m_killed, _, _ = read_output(str(killed_out))
    assert results(m_killed) == results(m_clean)

    # (2) every shard's first attempt fails after writing, in this process

    job_id, _ = submit(parse_manifest(job(str(tmp_path / "batch.jsonl"), str(retried_out), fmt="openai-batch",
                                          options=opts)), OPERATOR)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # as in the clean job's worker (drive threads=1)
    try:
        plan_job(job_id, processes=1)
        shard_repo.dispatch_ready(job_id)
        monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.after_write=raise")
        failpoints.reload()
        failed = []
        while (lease := lease_repo.claim_next([job_id], "test:1", 60)) is not None:
            with pytest.raises(failpoints.FailpointError):
                execute_shard(lease)
            lease_repo.fail_attempt(lease, "injected after write", RetryPolicy.from_settings(max_attempts=3))
            failed.append(lease.shard_id)
        monkeypatch.delenv("BATCHINF_FAILPOINTS")
        failpoints.reload()
        with tx() as conn:              # skip the retry backoff
            conn.execute(update(shards).where(shards.c.job_id == job_id).values(not_before=0))
        shard_repo.dispatch_ready(job_id)
        while (lease := lease_repo.claim_next([job_id], "test:1", 60)) is not None:
            assert lease.attempt == 2
            execute_shard(lease)
    finally:
        torch.set_num_threads(threads)
    work = job_row(job_id).work_uri
    with tx() as conn:
        rows = conn.execute(select(shards).where(shards.c.job_id == job_id)).all()
    assert sorted(failed) == sorted(r.id for r in rows) and all(r.status == "committed" for r in rows)
    for r in rows:                      # the retry rewrote the failed attempt's result bytes exactly
        if r.output_rows:
            first = get_store(work).get_bytes(join(work, "attempts", r.id, "a1", "part.parquet"))
            assert first == get_store(work).get_bytes(r.output_uri)
    assert shard_repo.verify_when_done(job_id)
    publish_job(job_id)
    m_retried, _, _ = read_output(str(retried_out))
    assert results(m_retried) == results(m_clean) and len(results(m_clean)) >= 3
    a, b = parse_openai(clean_out, m_clean), parse_openai(retried_out, m_retried)
    assert _normalised(a) == _normalised(b)
    sampled = [g["response"]["body"]["choices"][0] for g in a if g["error"] is None]
    assert len({c.get("text") or c["message"]["content"] for c in sampled}) > len(sampled) // 2


@pytest.mark.slow
def test_smollm2_answers_the_example_chat_requests(tmp_path: Path, bi_home: Path, smollm2_gguf: Path) -> None:
    """The issue's "done when": `batchinf bundle import-gguf` SmolLM2, then `batchinf run` the
    shipped openai-batch example (a few of its requests, greedy, 32 tokens) to _SUCCESS with
    answers that make sense."""
    import yaml
    from click.testing import CliRunner

    from batchinf.cli import main

    root = Path(__file__).resolve().parents[2] / "manifests" / "examples"
    requests = [json.loads(x) for x in (root / "chat-requests.jsonl").read_text().splitlines()][:4]
    for r in requests:
        r["body"]["max_tokens"] = 32
    write_lines(tmp_path / "requests.jsonl", requests)
    manifest = yaml.safe_load((root / "generate-openai.yaml").read_text())
    manifest["input"]["uri"] = str(tmp_path / "requests.jsonl")
    manifest["output"]["uri"] = str(tmp_path / "out")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))

    cli = CliRunner()
    r = cli.invoke(main, ["bundle", "import-gguf", str(smollm2_gguf), "--name", "smollm2", "--alias", "prod"])
    assert r.exit_code == 0, r.output
    r = cli.invoke(main, ["run", str(tmp_path / "job.yaml"), "--json"])
    assert r.exit_code == 0, r.output
    status = json.loads(r.stdout)
    assert status["status"] == "succeeded" and status["counts"]["records_succeeded"] == 4

    m, results, errors = read_output(str(tmp_path / "out"))
    assert not errors
    covered_once(results, errors, 4)
    answers = {g["custom_id"]: g for g in parse_openai(tmp_path / "out", m)}
    assert sorted(answers) == sorted(r["custom_id"] for r in requests)
    for g in answers.values():
        assert g["response"]["status_code"] == 200 and g["error"] is None
        content = g["response"]["body"]["choices"][0]["message"]["content"]
        assert len(content.split()) >= 3 and g["response"]["body"]["usage"]["completion_tokens"] <= 32
    assert "Paris" in answers["capital-france"]["response"]["body"]["choices"][0]["message"]["content"]
    colors = answers["primary-colors"]["response"]["body"]["choices"][0]["message"]["content"].lower()
    assert sum(c in colors for c in ("red", "blue", "yellow")) >= 2
