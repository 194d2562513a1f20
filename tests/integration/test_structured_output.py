"""Structured output (response_format) and logprobs, end to end: a tiny random Llama with SmolLM2's real
tokenizer (so JSON's tokens exist), an OpenAI batch file of varied schemas, greedy and sampled, run
through worker processes; every answer must parse and validate against its own schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from batchinf.bundles import import_bundle, open_runtime
from batchinf.controller import drive
from batchinf.ledger.jobs import get as job_row
from batchinf.manifest import parse_manifest
from batchinf.parts import read_table
from batchinf.runtime.generation.sampling import SamplingParams
from batchinf.runtime.generation.seq import GenRequest
from batchinf.checks import canonical_response_format
from batchinf.store import get_store, join
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.verify import MANIFEST, verify_output

pytestmark = pytest.mark.integration

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}, "label": {"type": ["string", "null"], "maxLength": 8}},
     "required": ["point", "label"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"const": "fixed"}, "n": {"type": "integer", "minimum": 1, "maximum": 3}},
     "required": ["kind", "n"], "additionalProperties": False},
]
QUESTIONS = ["Describe a person.", "Pick a color.", "Tag this text.", "Where is the point?", "List numbers.", "Count."]


@pytest.fixture
def smol_tiny(bi_home: Path, tmp_path: Path, smollm2_gguf: Path) -> str:
    """A tiny random Llama whose tokenizer is SmolLM2-135M's (49,152 tokens), imported as smoltiny@prod."""
    from batchinf.runtime.gguf import GGUFFile
    from batchinf.runtime.gguf_vocab import build_tokenizer
    from tests.helpers.tiny_llama import make_tiny_llama

    with GGUFFile(smollm2_gguf) as g:
        tok = build_tokenizer(g.metadata)
    return import_bundle(make_tiny_llama(tmp_path / "smol-tiny", tokenizer=tok, max_position=512),
                         "smoltiny", alias="prod").digest


def _line(i: int, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                "max_tokens": 160, **body}})


def _lines() -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Each schema greedy and sampled (two seeds), JSON mode, logprobs, and one schema that cannot be enforced."""
    lines, schemas = [], {}
    for i, schema in enumerate(SCHEMAS * 3):
        sampled = {} if i < len(SCHEMAS) else {"temperature": 1.0, "seed": i}
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i % len(SCHEMAS)}", "schema": schema, "strict": True}}
        lines.append(_line(i, {"response_format": rf, **sampled}))
        schemas[f"req-{i}"] = schema
    n = len(lines)
    lines.append(_line(n, {"response_format": {"type": "json_object"}}))
    schemas[f"req-{n}"] = {}        # JSON mode: any object (a random model's keys may never end: see below)
    lines.append(_line(n + 1, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "colour"}}}}}}))
    lines.append(_line(n + 2, {"logprobs": True, "top_logprobs": 2, "max_tokens": 12}))
    return lines, schemas


def _run(inp: str, out: str) -> tuple[list[dict], list[dict], list[dict]]:
    manifest = {"name": "structured", "task": "generate", "bundle": "smoltiny@prod",
                "input": {"uri": inp, "format": "openai-batch"}, "output": {"uri": out},
                "shards": {"max_records": 8}}
    job_id, _ = submit(parse_manifest(manifest), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == "succeeded", job_row(job_id).error
    store = get_store(out)
    assert verify_output(out)["ok"]
    m = json.loads(store.get_bytes(join(out, MANIFEST)))
    rows: dict[str, list[dict]] = {"results": [], "errors": []}
    for p in m["parts"]:
        if p["kind"] in rows:
            rows[p["kind"]] += read_table(join(out, p["key"])).to_pylist()
    lines = [json.loads(x) for p in m["parts"] if p["key"].startswith("openai/")
             for x in store.get_bytes(join(out, p["key"])).splitlines()]
    return rows["results"], rows["errors"], lines


@pytest.mark.slow
def test_every_answer_validates_against_its_schema(smol_tiny: str, tmp_path: Path) -> None:
    lines, schemas = _lines()
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    results, errors, out_lines = _run(inp.as_uri(), (tmp_path / "out").as_uri())
    assert [e["record_id"] for e in errors] == [f"req-{len(lines) - 2}"]
    assert errors[0]["error"] == "invalid_response_format"
    assert f"req-{len(lines) - 2}" in errors[0]["message"] and "colour" in errors[0]["message"]
    by_id = {r["record_id"]: r for r in results}
    assert len(by_id) == len(lines) - 1
    for rid, schema in schemas.items():
        r = by_id[rid]
        if not schema:      # JSON mode: an object, unless max_tokens cut a key the random model never closed
            assert r["text"].startswith("{") and (r["finish_reason"] == "length"
                                                 or isinstance(json.loads(r["text"]), dict)), r["text"]
            continue
        assert r["finish_reason"] == "stop", (rid, r["text"])
        jsonschema.validate(json.loads(r["text"]), schema)
    assert len({by_id[f"req-{i}"]["text"] for i in range(len(SCHEMAS), 3 * len(SCHEMAS))}) > len(SCHEMAS)  # sampled
    # logprobs in OpenAI's shape: one entry per output token, whose bytes make up the text
    lp_line = next(x for x in out_lines if x["custom_id"] == f"req-{len(lines) - 1}")
    choice = lp_line["response"]["body"]["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(by_id[f"req-{len(lines) - 1}"]["output_ids"])
    assert bytes(b for e in content for b in e["bytes"]).decode() == choice["message"]["content"]
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2
               and e["top_logprobs"][0]["logprob"] >= e["logprob"] for e in content)
    plain = next(x for x in out_lines if x["custom_id"] == "req-0")
    assert plain["response"]["body"]["choices"][0]["logprobs"] is None
    # the same file again: every answer, sampled ones included, is the same
    again, _, _ = _run(inp.as_uri(), (tmp_path / "out2").as_uri())
    assert {r["record_id"]: r["text"] for r in again} == {rid: r["text"] for rid, r in by_id.items()}


def test_sampled_structured_answer_is_reproducible_in_any_batch(smol_tiny: str) -> None:
    """A record's seed alone decides its answer: alone, or decoded beside other records, it is the same."""
    rt = open_runtime(smol_tiny)
    rf = canonical_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}})
    prompt = rt.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=1234, response_format=rf)
    alone = next(iter(rt.generate([GenRequest(0, prompt, params)])))
    others = [GenRequest(k, rt.encode_chat([{"role": "user", "content": q}]),
                         SamplingParams(max_tokens=60 + k, temperature=0.7, seed=k)) for k, q in enumerate(QUESTIONS, 1)]
    mixed = {r.key: r for r in rt.generate([*others, GenRequest(0, prompt, params)])}
    assert mixed[0].text == alone.text and mixed[0].token_ids == alone.token_ids
    jsonschema.validate(json.loads(alone.text), SCHEMAS[0])
