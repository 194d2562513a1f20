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
