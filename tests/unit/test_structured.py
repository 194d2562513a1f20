"""Structured output and logprobs in the generate runtime, on the tiny random Llama (its byte-level
tokenizer spells any JSON): answers validate against their schemas, greedy and sampled; a schema
llguidance cannot enforce is named; logprobs line up with the tokens. The end-to-end job version,
with SmolLM2's real tokenizer, is tests/integration/test_structured_output.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from batchinf.checks import canonical_response_format
from batchinf.runtime.generation.runtime import GenerateRuntime
from batchinf.runtime.generation.seq import GenRequest
from batchinf.runtime.generation.sampling import SamplingParams
from batchinf.runtime.generation.structured import grammar_problem
from tests.helpers.tiny_llama import make_tiny_llama

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50},
                                           "w": {"enum": ["the", "of", "and"]},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "w", "ok"], "additionalProperties": False}


def _rf(schema: dict) -> str:
    return canonical_response_format({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> GenerateRuntime:
    d = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", max_position=256)
    rt = GenerateRuntime(d, {"context_length": 256, "special_tokens": {"eos_ids": [2]}})
    rt.load_model()
    return rt


@pytest.mark.slow
def test_greedy_and_sampled_answers_follow_the_schema(runtime: GenerateRuntime) -> None:
    prompt = runtime.encode_chat([{"role": "user", "content": "the of and"}])
    arr = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3}
    reqs = [GenRequest(i, prompt, SamplingParams(max_tokens=60, temperature=0.0 if i < 2 else 1.0, seed=i,
                                                 response_format=_rf(SCHEMA if i % 2 else arr)))
            for i in range(5)]
    plain = runtime.generate([GenRequest(99, prompt, SamplingParams(max_tokens=20))])
    out = {r.key: r for r in runtime.generate(reqs)}
    for i, r in out.items():
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA if i % 2 else arr)
    (free,) = plain
    with pytest.raises(ValueError):
        json.loads(free.text)               # unconstrained, the random model writes no JSON
    again = {r.key: r.text for r in runtime.generate(reqs[2:4])}     # sampled: the same again, in another batch
    assert again == {k: out[k].text for k in (2, 3)}


def test_logprobs_line_up_with_tokens(runtime: GenerateRuntime) -> None:
    prompt = runtime.encode_prompt("the of")
    (r,) = runtime.generate([GenRequest(0, prompt, SamplingParams(max_tokens=6, logprobs=3))])
    assert r.logprobs is not None and len(r.logprobs) == len(r.token_ids)
    raw = b"".join(bytes(e["bytes"]) for e in r.logprobs)      # a token may hold part of a character
    assert raw == runtime._structured_vocab.ll.decode_bytes(r.token_ids)
    assert raw.decode(errors="replace").replace("\ufffd", "") == r.text.replace("\ufffd", "")
    for e in r.logprobs:        # greedy: the picked token is the most likely one
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"]
        assert e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"]) and e["logprob"] <= 0
    (q,) = runtime.generate([GenRequest(0, prompt, SamplingParams(max_tokens=6))])
    assert q.logprobs is None and q.token_ids == r.token_ids


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "colour"}, "Invalid type"),
    ({"type": "string", "format": "postcode"}, "Unknown format"),
    ({"$ref": "#/definitions/missing"}, "does not exist"),
])
def test_schemas_llguidance_cannot_enforce_are_named(schema: dict, fragment: str) -> None:
    problem = grammar_problem(_rf(schema))
    assert problem is not None and fragment in problem
    assert grammar_problem(_rf(SCHEMA)) is None
    assert grammar_problem(canonical_response_format({"type": "json_object"})) is None


def test_a_line_overrides_the_jobs_response_format_and_logprobs() -> None:
    from batchinf.tasks.generate import GenerateOptions, record_params

    job = GenerateOptions(response_format={"type": "json_object"}, logprobs=True, top_logprobs=2)
    p = record_params(job, "r1", None)
    assert (p["response_format"], p["logprobs"]) == ('{"type":"json_object"}', 2)
    p = record_params(job, "r1", {"logprobs": False, "response_format": {"type": "text"}})
    assert (p["response_format"], p["logprobs"]) == (None, None)
    p = record_params(GenerateOptions(), "r1", {"logprobs": True, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "object"}, "name": "x"}}})
    assert p["logprobs"] == 0 and p["response_format"] == _rf({"type": "object"}).replace('"name":"s"', '"name":"x"')


def test_unbounded_numbers_are_held_to_what_json_consumers_read() -> None:
    from batchinf.runtime.generation.structured import SAFE_INTEGER, bounded

    schema = {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": ["number", "null"], "minimum": 0},
        "c": {"type": "array", "items": {"anyOf": [{"type": "integer", "exclusiveMaximum": 7}, {"type": "string"}]}},
        "d": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "number", "maximum": 10 ** 30}}}
    got = bounded(schema)
    assert got["properties"]["a"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert got["properties"]["b"] == {"type": ["number", "null"], "minimum": 0, "maximum": SAFE_INTEGER}
    assert got["properties"]["c"]["items"]["anyOf"] == [
        {"type": "integer", "exclusiveMaximum": 7, "minimum": -SAFE_INTEGER}, {"type": "string"}]
    assert got["$defs"]["n"] == {"type": "number", "maximum": 10 ** 30, "minimum": -SAFE_INTEGER}   # its own bound stays
    assert schema["properties"]["a"] == {"type": "integer"}                                         # not changed in place
    assert list(json.loads(_rf(schema))["json_schema"]["schema"]["properties"]) == ["a", "b", "c", "d"]


def test_the_fraction_cap_follows_json_outside_strings() -> None:
    from batchinf.runtime.generation.structured import Fraction

    f = Fraction()
    seen = []
    for chunk in (b'{"x', b'.5":', b'3.', b'14', b'15', b',"s":"a.1', b'2\\"', b'.9"', b',"y":[0.', b'1]'):
        f.follow(chunk)
        seen.append(f.digits)
    assert seen == [None, None, 0, 2, 4, None, None, None, 0, None]


@pytest.mark.slow
def test_a_runaway_number_ends_and_keys_keep_the_schema_order(runtime: GenerateRuntime) -> None:
    """The tiny random model left free writes digits forever; bounded, every number ends well
    inside max_tokens, with at most 17 fraction digits, and the keys come in the schema's order."""
    schema = {"type": "object", "properties": {"z": {"type": "number"}, "a": {"type": "integer"},
                                               "m": {"type": "boolean"}},
              "required": ["z", "a", "m"], "additionalProperties": False}
    prompt = runtime.encode_chat([{"role": "user", "content": "1 2 3 4 5 6 7 8 9"}])
    reqs = [GenRequest(i, prompt, SamplingParams(max_tokens=100, temperature=1.0, seed=i, response_format=_rf(schema)))
            for i in range(6)]
    for r in runtime.generate(reqs):
        assert r.finish_reason == "stop", r.text
        answer = json.loads(r.text)
        jsonschema.validate(answer, schema)
        assert list(answer) == ["z", "a", "m"] and abs(answer["a"]) <= 2 ** 53 and abs(answer["z"]) <= 2 ** 53
        fraction = r.text.split('"z":', 1)[1].split(",", 1)[0].partition(".")[2]
        assert len(fraction) <= 17, r.text
