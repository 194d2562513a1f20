"""Job manifest parsing: the documented example, rejections by name, round trips."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchinf.errors import ManifestError
from batchinf.manifest import (
    EmbedOptions,
    GenerateOptions,
    InputSpec,
    JobManifest,
    ShardSpec,
    load_manifest,
    manifest_from_dict,
    parse_duration,
    parse_manifest,
)

DESIGN_YAML = """\
name: docs-embed
task: embed                 # embed | generate (more may come)
bundle: minilm@prod         # alias, name@version, or sha256:<digest>
input:
  uri: s3://corpus/2026-11-28/   # prefix or one object; file:// for local
  # manifest: s3://corpus/inputs.jsonl   # instead of uri: a list of objects (key, version_id)
  format: jsonl             # jsonl | parquet | openai-batch
  id_field: id              # default "id"; records without an id get a clear error
  text_field: text          # or messages_field / prompt_field for generate
output:
  uri: s3://embeddings/2026-11-28/
shards: {max_records: 4096, max_tokens: 1000000}
options: {max_length: 256}  # task options (generate: max_tokens, temperature, top_p, seed, stop)
deadline: 6h                # optional
priority: 5                 # optional, higher first
idempotency_key: nightly-2026-11-28   # optional; same key -> same job, never a second one
"""


def design() -> dict[str, Any]:
    return yaml.safe_load(DESIGN_YAML)


def minimal(**extra: Any) -> dict[str, Any]:
    return {"name": "n", "bundle": "b@prod", "input": {"uri": "file:///in/"},
            "output": {"uri": "file:///out/"}, **extra}


def test_design_example_parses() -> None:
    m = parse_manifest(design())
    assert m == JobManifest(
        name="docs-embed", task="embed", bundle="minilm@prod",
        input=InputSpec(uri="s3://corpus/2026-11-28/", format="jsonl", id_field="id", text_field="text"),
        output_uri="s3://embeddings/2026-11-28/",
        shards=ShardSpec(max_records=4096, max_tokens=1_000_000),
        options=EmbedOptions(max_length=256),
        deadline_seconds=21600.0, priority=5, idempotency_key="nightly-2026-11-28")
    assert m.input.manifest is None
    assert m.deadline_seconds == 21600


def test_minimal_manifest_gets_defaults() -> None:
    m = parse_manifest(minimal())
    assert m.task == "embed"
    assert m.input == InputSpec(uri="file:///in/")
    assert (m.input.format, m.input.id_field, m.input.text_field) == ("jsonl", "id", "text")
    assert m.shards == ShardSpec() and m.options == EmbedOptions()
    assert m.deadline_seconds is None and m.priority == 0 and m.idempotency_key is None
    m2 = parse_manifest(minimal(input={"manifest": "s3://b/list.jsonl", "format": "parquet"}))
    assert m2.input.uri is None and m2.input.manifest == "s3://b/list.jsonl"


@pytest.mark.parametrize("value, seconds", [
    ("6h", 21600), ("90s", 90), ("30m", 1800), ("1d", 86400), ("1.5h", 5400), ("45", 45),
    (120, 120), (2.5, 2.5), (" 10 m ", 600),
])
def test_durations(value: Any, seconds: float) -> None:
    assert parse_duration(value, "deadline") == seconds
    assert parse_manifest(minimal(deadline=value)).deadline_seconds == seconds


def test_unknown_top_level_key_is_named() -> None:
    with pytest.raises(ManifestError) as ei:
        parse_manifest(minimal(deadlnie="6h"))
    assert "'deadlnie'" in str(ei.value)
    assert "deadline" in str(ei.value)    # the allowed keys are listed


@pytest.mark.parametrize("section, key", [
    ("input", "txt_field"), ("shards", "max_recs"), ("options", "maxlength"),
])
def test_unknown_nested_key_is_named_with_its_path(section: str, key: str) -> None:
    raw = design()
    raw[section][key] = "x"
    with pytest.raises(ManifestError) as ei:
        parse_manifest(raw)
    assert f"{section}.{key}" in str(ei.value)


def test_output_with_extra_key_rejected() -> None:
    with pytest.raises(ManifestError, match="output must be a mapping with exactly one key, uri"):
        parse_manifest(minimal(output={"uri": "file:///o/", "format": "parquet"}))
    with pytest.raises(ManifestError, match="output"):
        parse_manifest(minimal(output="file:///o/"))


def test_input_needs_exactly_one_of_uri_and_manifest() -> None:
    with pytest.raises(ManifestError, match="exactly one of uri"):
        parse_manifest(minimal(input={"uri": "s3://b/p/", "manifest": "s3://b/m.jsonl"}))
    with pytest.raises(ManifestError, match="exactly one of uri"):
        parse_manifest(minimal(input={"format": "jsonl"}))
    with pytest.raises(ManifestError, match="exactly one of uri"):
        parse_manifest(minimal(input={"uri": ""}))


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["input"].update(format="csv"), "input.format 'csv' is not supported"),
    (lambda d: d.update(task="translate"), "task 'translate' is not supported"),
    (lambda d: d.update(priority="high"), "priority must be an integer"),
    (lambda d: d.update(priority=1.5), "priority must be an integer"),
    (lambda d: d.update(priority=True), "priority must be an integer"),
    (lambda d: d.update(deadline="soon"), "deadline: 'soon' is not a positive duration"),
    (lambda d: d.update(deadline="6 hours"), "is not a positive duration"),
    (lambda d: d.update(deadline="-1h"), "is not a positive duration"),
    (lambda d: d.update(deadline=True), "is not a positive duration"),
    (lambda d: d.update(deadline=-5), "is not a positive duration"),
    (lambda d: d.update(deadline=0), "is not a positive duration"),
    (lambda d: d.setdefault("options", {}).update(device="tpu"), "options.device"),
    (lambda d: d["shards"].update(max_records=0), "shards.max_records must be a positive integer"),
    (lambda d: d["shards"].update(max_tokens="1M"), "shards.max_tokens must be a positive integer"),
    (lambda d: d["input"].update(id_field=3), "input.id_field must be a string"),
    (lambda d: d.update(idempotency_key=""), "idempotency_key must be a non-empty string"),
    (lambda d: d.update(input=["s3://b/"]), "input must be a mapping"),
    (lambda d: d.pop("bundle"), "missing required key 'bundle'"),
])
def test_rejections(mutate: Any, match: str) -> None:
    raw = design()
    mutate(raw)
    with pytest.raises(ManifestError, match=match):
        parse_manifest(raw)


def test_not_a_mapping() -> None:
    with pytest.raises(ManifestError, match="must be a mapping"):
        parse_manifest(["name", "bundle"])


@pytest.mark.parametrize("raw", [design(), minimal(), minimal(input={"manifest": "file:///m.jsonl"}),
                                 minimal(deadline="90s", options={"truncate": False, "device": "cpu"})])
def test_to_dict_round_trip(raw: dict[str, Any]) -> None:
    m = parse_manifest(raw)
    d = m.to_dict()
    assert d["output"] == {"uri": m.output_uri} and "output_uri" not in d
    assert manifest_from_dict(d) == m
    # as stored in the ledger: through JSON text
    assert manifest_from_dict(json.loads(json.dumps(d))) == m
    assert manifest_from_dict(d).content_key() == m.content_key()


def test_content_key_stable_across_key_order_and_sensitive_to_content() -> None:
    raw = design()
    reordered = {k: (dict(reversed(list(v.items()))) if isinstance(v, dict) else v)
                 for k, v in reversed(list(raw.items()))}
    assert list(reordered) != list(raw)
    a, b = parse_manifest(raw), parse_manifest(reordered)
    assert a.content_key() == b.content_key()
    assert a.content_key().startswith("manifest-sha256:")
    changed = copy.deepcopy(raw)
    changed["options"]["max_length"] = 128
    assert parse_manifest(changed).content_key() != a.content_key()
    # "6h" and 21600 mean the same deadline
    assert parse_manifest({**raw, "deadline": 21600}).content_key() == a.content_key()


def test_load_manifest_yaml_and_json(tmp_path: Path) -> None:
    y = tmp_path / "job.yaml"
    y.write_text(DESIGN_YAML)
    j = tmp_path / "job.json"
    j.write_text(json.dumps(design()))
    assert load_manifest(y) == load_manifest(j) == parse_manifest(design())
    assert load_manifest(str(y)).deadline_seconds == 21600


def test_load_manifest_errors(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot read manifest"):
        load_manifest(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{name: x")
    with pytest.raises(ManifestError, match="not valid YAML/JSON"):
        load_manifest(bad)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: [unclosed\n")
    with pytest.raises(ManifestError, match="not valid YAML/JSON"):
        load_manifest(bad_yaml)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(DESIGN_YAML.replace("  text_field: text", "  txt_field: text"))
    with pytest.raises(ManifestError, match=r"input\.txt_field"):
        load_manifest(unknown)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["options"].update(max_length="256"), "options.max_length must be a positive integer"),
    (lambda d: d["options"].update(max_length=0), "options.max_length must be a positive integer"),
    (lambda d: d["options"].update(max_length=True), "options.max_length must be a positive integer"),
    (lambda d: d["input"].update(uri=123), "input.uri must be a string"),
    (lambda d: d["input"].update(uri=None, manifest=["s3://b/k"]), "input.manifest must be a string"),
])
def test_optional_fields_are_type_checked(mutate: Any, match: str) -> None:
    """Fields defaulting to None are still typed: a wrong type fails here, not later in planning."""
    raw = design()
    mutate(raw)
    with pytest.raises(ManifestError, match=match):
        parse_manifest(raw)
    ok = design()
    ok["options"]["max_length"] = None            # explicit null means "the bundle's max length"
    assert parse_manifest(ok).options.max_length is None


def gen(**options: Any) -> dict[str, Any]:
    return {"name": "n", "task": "generate", "bundle": "smol@prod", "input": {"uri": "s3://x/"},
            "output": {"uri": "s3://y/"}, **({"options": options} if options else {})}


def test_generate_defaults_and_fields() -> None:
    m = parse_manifest(gen())
    assert m.task == "generate" and m.options == GenerateOptions()
    assert m.input.value_field("generate") == ("prompt", "prompt")
    m = parse_manifest({**gen(), "input": {"uri": "s3://x/", "messages_field": "conv"}})
    assert m.input.value_field("generate") == ("conv", "messages")
    m = parse_manifest({**gen(), "input": {"uri": "s3://x/", "prompt_field": "q"}})
    assert m.input.value_field("generate") == ("q", "prompt")
    assert parse_manifest(design()).input.value_field("embed") == ("text", "text")


def test_generate_options_parse_and_round_trip() -> None:
    raw = gen(max_tokens=32, temperature=0.7, top_k=40, top_p=0.9, seed=0, stop=["\n\n", "END"],
              stop_token_ids=[2, 0], max_batch_tokens=4096, max_slots=8, device="cpu")
    m = parse_manifest(raw)
    assert m.options == GenerateOptions(max_tokens=32, temperature=0.7, top_k=40, top_p=0.9, seed=0,
                                        stop=("\n\n", "END"), stop_token_ids=(2, 0), max_batch_tokens=4096,
                                        max_slots=8, device="cpu")
    assert manifest_from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert parse_manifest(gen(stop="###")).options.stop == ("###",)
    assert parse_manifest(gen(temperature=1)).options.temperature == 1.0
    assert parse_manifest(gen(seed=7)).content_key() != parse_manifest(gen(seed=8)).content_key()
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True}}
    m = parse_manifest(gen(response_format=rf, logprobs=True, top_logprobs=5))
    assert (m.options.response_format, m.options.logprobs, m.options.top_logprobs) == (rf, True, 5)
    assert manifest_from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert m.content_key() != parse_manifest(gen(response_format={"type": "json_object"})).content_key()


@pytest.mark.parametrize("options, match", [
    ({"max_tokens": 0}, "options.max_tokens must be a positive integer"),
    ({"max_tokens": "32"}, "options.max_tokens must be a positive integer"),
    ({"temperature": -0.1}, r"options.temperature must be a number in \[0, 2\]"),
    ({"temperature": "hot"}, "options.temperature must be a number"),
    ({"temperature": True}, "options.temperature must be a number"),
    ({"top_p": 0}, r"options.top_p must be a number in \(0, 1\]"),
    ({"top_p": 1.5}, "options.top_p must be a number"),
    ({"top_k": -1}, "options.top_k must be a non-negative integer"),
    ({"seed": 1.5}, "options.seed must be a non-negative integer"),
    ({"stop": ["ok", ""]}, "options.stop must be a non-empty string or a list of them"),
    ({"stop": 5}, "options.stop must be"),
    ({"stop_token_ids": [1, "2"]}, "options.stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": 3}, "options.stop_token_ids must be a list"),
    ({"max_slots": 0}, "options.max_slots must be a positive integer"),
    ({"max_length": 64}, "unknown key options.max_length"),       # an embed option
    ({"truncate": False}, "unknown key options.truncate"),
    ({"device": "tpu"}, "options.device"),
    ({"response_format": {"type": "xml"}}, "options.response_format must be an object with type one of"),
    ({"response_format": {"type": "json_schema"}}, "options.response_format.json_schema must be an object"),
    ({"response_format": {"type": "json_object", "x": 1}}, "options.response_format has unexpected keys"),
    ({"top_logprobs": 21}, r"options.top_logprobs must be an integer in \[0, 20\]"),
    ({"logprobs": "yes"}, "options.logprobs must be true or false"),
])
def test_generate_option_rejections(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        parse_manifest(gen(**options))


@pytest.mark.parametrize("task, inp, match", [
    ("embed", {"prompt_field": "p"}, "prompt_field and input.messages_field are for task: generate"),
    ("embed", {"messages_field": "m"}, "are for task: generate"),
    ("generate", {"prompt_field": "p", "messages_field": "m"}, "not both"),
    ("generate", {"text_field": "body"}, "input.text_field is for task: embed"),
    ("generate", {"format": "openai-batch", "id_field": "key"}, "openai-batch reads custom_id"),
    ("embed", {"format": "openai-batch", "text_field": "t"}, "remove input.id_field"),
])
def test_input_fields_must_suit_task_and_format(task: str, inp: dict[str, Any], match: str) -> None:
    raw = {**gen(), "task": task, "input": {"uri": "s3://x/", **inp}}
    with pytest.raises(ManifestError, match=match):
        parse_manifest(raw)


def test_openai_batch_format_for_both_tasks() -> None:
    for task in ("generate", "embed"):
        m = parse_manifest({**gen(), "task": task, "input": {"uri": "s3://x/b.jsonl", "format": "openai-batch"}})
        assert m.input.format == "openai-batch" and m.task == task
