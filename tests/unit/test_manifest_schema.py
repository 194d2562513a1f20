"""The JSON Schema in manifests/ and the parser agree on the shipped examples."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from batchinf.manifest import load_manifest

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "manifests" / "job.schema.json").read_text())


@pytest.mark.parametrize("path", sorted((ROOT / "manifests" / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_match_schema_and_parser(path: Path) -> None:
    jsonschema.validate(yaml.safe_load(path.read_text()), SCHEMA)
    load_manifest(path)


def test_schema_rejects_unknown_keys() -> None:
    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "embed-local.yaml").read_text())
    doc["input"]["txt_field"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA)


def test_schema_checks_options_by_task() -> None:
    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "embed-local.yaml").read_text())
    doc["options"] = {"max_tokens": 32}          # a generate option in an embed job
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA)
    doc["task"] = "generate"
    jsonschema.validate(doc, SCHEMA)
    doc["options"] = {"max_length": 32}          # an embed option in a generate job
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA)
    doc["options"] = {"temperature": 0.7, "stop": ["\n"], "top_p": 0.9, "seed": 3}
    jsonschema.validate(doc, SCHEMA)
    doc["options"]["top_p"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA)
