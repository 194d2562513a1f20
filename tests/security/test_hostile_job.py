"""Attack replays as whole jobs: hostile records, objects of the wrong format and a chat template
that hangs on one record each become error rows naming them, and the job still succeeds with
every other record exactly once (coverage verified)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf.controller import drive
from batchinf.manifest import parse_manifest
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.verify import verify_output
from tests.helpers.corpus import manifest

pytestmark = pytest.mark.integration


def _lines(prefix: str, n: int) -> bytes:
    return "".join(json.dumps({"id": f"{prefix}{i}", "text": f"{prefix} record {i}"}) + "\n"
                   for i in range(n)).encode()


def _parquet(prefix: str, n: int) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": [f"{prefix}{i}" for i in range(n)], "text": [f"row {i}" for i in range(n)]}), buf)
    return buf.getvalue()


def _outcome(out: Path) -> tuple[list[str], set[tuple[str, str]]]:
    assert verify_output(str(out))["ok"]
    ids = sorted(pq.read_table(out, ignore_prefixes=["_", "errors", "."]).column("record_id").to_pylist())
    errors = {(e["source"].rsplit("/", 1)[-1], e["error"]) for e in pq.read_table(out / "errors").to_pylist()}
    return ids, errors


def test_hostile_jsonl_records_and_objects(tmp_path: Path, tiny_bundle: str) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "a.jsonl").write_bytes(_lines("a", 10) + b'{"id": "big", "text": "x", "n": ' + b"9" * 5000 + b"}\n"
                                  + b'{"id": "deep", "text": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
                                  + _lines("a2-", 10))
    (inp / "b.jsonl").write_bytes(_parquet("p", 5))                  # Parquet under a JSONL job
    (inp / "c.jsonl").write_bytes(b"\x00\x01\x02binary" * 100)       # a binary file
    (inp / "d.jsonl").write_bytes(_lines("d", 10))
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(manifest(str(inp) + "/", str(out), shards={"max_records": 8})), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == "succeeded"
    ids, errors = _outcome(out)
    assert ids == sorted([f"a{i}" for i in range(10)] + [f"a2-{i}" for i in range(10)] + [f"d{i}" for i in range(10)])
    assert errors == {("a.jsonl", "malformed_json"), ("b.jsonl", "wrong_format"), ("c.jsonl", "wrong_format")}
    rows = pq.read_table(out / "errors").to_pylist()
    assert sum(e["source"].endswith("a.jsonl") for e in rows) == 2
    assert any("set input.format: parquet" in e["message"] for e in rows)


def test_broken_parquet_objects(tmp_path: Path, tiny_bundle: str) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "a.parquet").write_bytes(_parquet("a", 12))
    (inp / "empty.parquet").write_bytes(b"")
    (inp / "cut.parquet").write_bytes(_parquet("x", 50)[:-30])
    (inp / "lines.parquet").write_bytes(_lines("l", 3))
    out = tmp_path / "out"
    m = manifest(str(inp) + "/", str(out))
    m["input"]["format"] = "parquet"
    job_id, _ = submit(parse_manifest(m), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == "succeeded"
    ids, errors = _outcome(out)
    assert ids == sorted(f"a{i}" for i in range(12))
    assert errors == {("empty.parquet", "corrupt_object"), ("cut.parquet", "corrupt_object"),
                      ("lines.parquet", "wrong_format")}


def test_a_chat_template_that_hangs_on_one_record(tmp_path: Path, bi_home: Path) -> None:
    from batchinf.bundles import import_bundle
    from tests.helpers.tiny_llama import make_tiny_llama

    d = make_tiny_llama(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{% if m.content == 'boom' %}{% for i in range(100000) %}"
                            "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
                            "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    import_bundle(d, "tinyllama", alias="prod")     # the fixtures render: the bundle is accepted
    inp = tmp_path / "in"
    inp.mkdir()
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(5)]
    rows.insert(2, {"id": "boom", "messages": [{"role": "user", "content": "boom"}]})
    (inp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    m = {"name": "hostile-template", "task": "generate", "bundle": "tinyllama@prod",
         "input": {"uri": str(inp) + "/", "messages_field": "messages"}, "output": {"uri": str(out)},
         "options": {"max_tokens": 4}}
    job_id, _ = submit(parse_manifest(m), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == "succeeded"
    ids, errors = _outcome(out)
    assert ids == [f"c{i}" for i in range(5)] and errors == {("chat.jsonl", "invalid_messages")}
    (row,) = pq.read_table(out / "errors").to_pylist()
    assert row["record_id"] == "boom" and "loop iterations" in row["message"]
