"""The manifest's one description: the checked-in JSON Schema is the one the models generate, the
schema and the parser accept the same values, and content keys do not drift."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from batchinf.errors import ManifestError
from batchinf.manifest import (EmbedOptions, GenerateOptions, InputSpec, JobManifest, ShardSpec, job_schema, parse_manifest,
                               schema_text)

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "python -m batchinf.manifest --schema > manifests/job.schema.json"


def test_checked_in_schema_is_the_generated_one() -> None:
    checked_in = (ROOT / "manifests" / "job.schema.json").read_text()
    assert checked_in == schema_text(), f"manifests/job.schema.json is stale; regenerate it: {REGENERATE}"


def test_schema_is_valid_json_schema_and_cites_nothing_outside() -> None:
    jsonschema.Draft202012Validator.check_schema(job_schema())
    assert "DESIGN.md" not in schema_text()


def test_schema_command_prints_it() -> None:
    out = subprocess.run([sys.executable, "-m", "batchinf.manifest", "--schema"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == job_schema()


def gen(**options: Any) -> dict[str, Any]:
    return {"name": "n", "task": "generate", "bundle": "b", "input": {"uri": "s3://x/"},
            "output": {"uri": "s3://y/"}, "options": options}


VALUES = [None, True, False, 0, 1, -1, 2, 1.5, 0.5, 300, "x", "", "auto", "cpu", [], [0, 3], [1, "2"], ["a"],
          ["ok", ""], {}, {"a": 1}]


@pytest.mark.parametrize("key", sorted(GenerateOptions.model_fields))
def test_schema_and_parser_agree_on_generate_options(key: str) -> None:
    validator = jsonschema.Draft202012Validator(job_schema())
    for value in VALUES:
        doc = gen(**{key: value})
        try:
            parse_manifest(doc)
            parsed = True
        except ManifestError:
            parsed = False
        assert validator.is_valid(doc) == parsed, f"options.{key} = {value!r}: schema and parser disagree"


@pytest.mark.parametrize("section, key", [("input", k) for k in ("format", "id_field", "text_field")] +
                         [("shards", "max_records"), ("options", "max_length"), ("options", "truncate")])
def test_schema_and_parser_agree_on_sections(section: str, key: str) -> None:
    validator = jsonschema.Draft202012Validator(job_schema())
    for value in VALUES:
        doc = {"name": "n", "bundle": "b", "input": {"uri": "s3://x/"}, "output": {"uri": "s3://y/"}}
        doc[section] = {**doc.get(section, {}), key: value}
        try:
            parse_manifest(doc)
            parsed = True
        except ManifestError:
            parsed = False
        assert validator.is_valid(doc) == parsed, f"{section}.{key} = {value!r}: schema and parser disagree"


# content keys are stored idempotency keys: the same manifest must keep hashing the same (computed from
# the fields that differ from their defaults: pinned again when that rule replaced a hand-kept list)
PINNED = [
    ({"name": "n", "bundle": "b@prod", "input": {"uri": "file:///in/"}, "output": {"uri": "file:///out/"}},
     "manifest-sha256:ac3fd233caa5e8e612262bfa3209f3b63318c09a7177ee678ff521a937b19734"),
    ({"name": "g", "task": "generate", "bundle": "smol@prod", "input": {"uri": "s3://x/", "messages_field": "conv"},
      "output": {"uri": "s3://y/"}, "options": {"max_tokens": 32, "temperature": 1, "top_k": 40, "top_p": 0.9,
                                                  "seed": 7, "stop": ["\n\n", "END"], "stop_token_ids": [2, 0],
                                                  "max_slots": 8, "device": "cpu"}},
     "manifest-sha256:a0142c4a96bb9f03965be972e000d290f00643e298387aa569f6b505bd7d8cdd"),
    ({"name": "o", "task": "generate", "bundle": "smol@prod",
      "input": {"manifest": "s3://x/m.jsonl", "format": "openai-batch"}, "output": {"uri": "s3://y/"},
      "options": {"stop": "###"}, "deadline": 90},
     "manifest-sha256:e940d2b4fb4337fee29c4543eb8416074ef1067261251604c3a980e6d454b05e"),
]


@pytest.mark.parametrize("raw, key", PINNED)
def test_content_keys_do_not_drift(raw: dict[str, Any], key: str) -> None:
    assert parse_manifest(raw).content_key() == key


def test_a_later_option_changes_the_key_only_when_set() -> None:
    raw, key = PINNED[0]
    for section, model in (("input", InputSpec), ("shards", ShardSpec), ("options", EmbedOptions)):
        for name, field in model.model_fields.items():
            if field.default_factory is None and (field.alias or name) not in {*raw.get(section, {}), "manifest"}:
                given = {**raw, section: {**raw.get(section, {}), field.alias or name: field.default}}
                assert parse_manifest(given).content_key() == key, f"{section}.{name} at its default changed the key"
    assert parse_manifest({**raw, "options": {"dimensions": None}}).content_key() == key
    assert parse_manifest({**raw, "options": {"dimensions": 128}}).content_key() != key


def test_built_in_python() -> None:
    m = JobManifest(name="n", bundle="b", input=InputSpec(uri="s3://x/"), output_uri="s3://y/", task="generate")
    assert isinstance(m.options, GenerateOptions) and m.output_uri == "s3://y/"
    assert m == parse_manifest(gen()) and hash(m) == hash(parse_manifest(gen()))
    with pytest.raises(ValueError, match="must be a number in"):
        GenerateOptions(temperature=5)
    with pytest.raises(ValueError, match="options of task generate are GenerateOptions"):
        JobManifest(name="n", bundle="b", input=InputSpec(uri="s3://x/"), output_uri="s3://y/", task="generate",
                    options=parse_manifest({**gen(), "task": "embed", "options": {}}).options)


@pytest.mark.parametrize("raw, match", [
    ({**gen(), "output_uri": "s3://z/"}, "unknown key 'output_uri'"),       # Python names are not document keys
    ({**gen(), 1: "x"}, "unknown key 1"),
    ({**gen(), "input": {"uri": "s3://x/", 1: "x"}}, "unknown key input.1"),
    ({**gen(), "options": ["x"]}, "options must be a mapping, got list"),
    ({**gen(), "input": None}, "input must be a mapping, got null"),
])
def test_document_errors_are_ours(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(ManifestError, match=match) as ei:
        parse_manifest(raw)
    assert "pydantic" not in str(ei.value) and "validation error" not in str(ei.value)
