"""Options a transcribe record sets for itself (tasks/transcribe_options.record_options): as fields or in
an `options` object, `prompt` standing for initial_prompt, each checked by the job's rule and
against the bundle, a wrong one named with its fix; rows that set the same options share one."""

from __future__ import annotations

import json

import pytest

from batchinf.tasks.transcribe_options import MAX_RECORD_PROMPT_CHARS, TranscribeOptions, options_of, record_options

ENGLISH = {"multilingual": False, "languages": ["en"]}
MULTI = {"multilingual": True, "languages": ["en", "de", "fr"]}
JOB = TranscribeOptions(beam_size=3)


def test_a_record_without_options_takes_the_jobs() -> None:
    assert record_options({"id": "a", "audio": "s3://b/a.wav", "lang": "xx"}, JOB, ENGLISH) == (None, None)
    assert record_options({"language": None, "options": {"temperature": None}}, JOB, ENGLISH) == (None, None)


def test_fields_and_an_options_object_prompt_standing_for_initial_prompt() -> None:
    own, problem = record_options({"language": "de", "prompt": "Kfz", "options": {"timestamps": "word"},
                                   "temperature": 0}, JOB, MULTI)
    assert problem is None
    assert own == {"language": "de", "initial_prompt": "Kfz", "timestamps": "word", "temperature": 0.0}
    assert isinstance(own["temperature"], float)
    own, _ = record_options({"prompt": "a", "options": {"initial_prompt": "b", "beam_size": 1}}, JOB, ENGLISH)
    assert own == {"initial_prompt": "b", "beam_size": 1}      # the options object wins over a field


@pytest.mark.parametrize(("fields", "words"), [
    ({"language": "German"}, ["cannot have: language 'German' is not a language code", "leave language out"]),
    ({"temperature": 1.5}, ["cannot have: temperature", "leave temperature out"]),
    ({"beam_size": 0}, ["cannot have: beam_size"]),
    ({"timestamps": "char"}, ["cannot have: timestamps 'char'", "segment, word, none"]),
    ({"options": {"pack": False}}, ["options.pack", "a record may set", "language, task"]),
    ({"options": "word"}, ["must be an object"]),
    ({"language": "de"}, ["cannot have: language 'de'", "English-only"]),
    ({"task": "translate"}, ["cannot have: task translate", "multilingual"]),
    ({"prompt": "x" * (MAX_RECORD_PROMPT_CHARS + 1)}, ["initial_prompt of 4097 characters is over", "shorten"]),
])
def test_wrong_options_name_the_field_and_the_fix(fields: dict, words: list[str]) -> None:
    own, problem = record_options(fields, JOB, ENGLISH)
    assert own is None and problem is not None
    for w in words:
        assert w in problem, problem


def test_a_language_the_multilingual_bundle_does_not_know() -> None:
    _, problem = record_options({"language": "xh"}, JOB, MULTI)
    assert problem is not None and "language 'xh' is not one of the bundle's languages" in problem


def test_rows_that_set_the_same_options_share_one_object() -> None:
    de = json.dumps({"language": "de"}, sort_keys=True)
    got = options_of(JOB, [None, de, None, de, json.dumps({"beam_size": 1})])
    assert got[0] is JOB and got[2] is JOB and got[1] is got[3] and got[1] is not JOB
    assert (got[1].language, got[1].beam_size) == ("de", 3) and got[4].beam_size == 1
