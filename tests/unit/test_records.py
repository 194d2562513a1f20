"""Reading input records: bad records become error records with line/row numbers, never exceptions."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf.formats import InputRecord, read_records
from batchinf.formats.jsonl import read_jsonl
from batchinf.formats.parquet import read_parquet

URI = "file:///data/in.jsonl"


def jsonl(*lines: bytes | str) -> io.BytesIO:
    return io.BytesIO(b"".join((ln.encode() if isinstance(ln, str) else ln) + b"\n" for ln in lines))


def read(*lines: bytes | str, id_field: str = "id", text_field: str = "text") -> list[InputRecord]:
    return list(read_jsonl(jsonl(*lines), URI, id_field, text_field))


def one(line: bytes | str) -> InputRecord:
    (rec,) = read(line)
    return rec


def test_good_records_int_and_str_ids_become_str() -> None:
    recs = read('{"id": 1, "text": "hello"}', '{"id": "a-2", "text": "world", "extra": [1]}',
                '{"id": 0, "text": "zero id is an id"}', '{"id": -7, "text": "negative"}',
                json.dumps({"id": "ü", "text": "Ünïcödé 🚀 中文"}, ensure_ascii=False))
    assert [(r.ordinal, r.record_id, r.text, r.error) for r in recs] == [
        (0, "1", "hello", None), (1, "a-2", "world", None), (2, "0", "zero id is an id", None),
        (3, "-7", "negative", None), (4, "ü", "Ünïcödé 🚀 中文", None)]
    assert all(r.message is None for r in recs)


def test_custom_field_names() -> None:
    (rec,) = read('{"doc": 5, "body": "hi", "id": 1, "text": "other"}', id_field="doc", text_field="body")
    assert (rec.record_id, rec.text, rec.error) == ("5", "hi", None)
    (rec,) = read('{"id": 5, "text": "hi"}', id_field="doc", text_field="body")
    assert rec.error == "missing_id" and "'doc'" in rec.message and "input.id_field" in rec.message


def test_malformed_json_names_line_number() -> None:
    recs = read('{"id": 1, "text": "ok"}', '{"id": 2, "text": "unterminated', '{"id": 3, "text": "ok"}')
    assert [r.error for r in recs] == [None, "malformed_json", None]
    bad = recs[1]
    assert bad.ordinal == 1 and bad.record_id is None and bad.text is None
    assert bad.message.startswith(f"{URI} line 2: malformed JSON")
    assert recs[2].ordinal == 2 and recs[2].record_id == "3"
    last = list(read_jsonl(io.BytesIO(b'{"id": 1, "text": "x'), URI, "id", "text"))   # no newline at the end
    assert last[0].message.endswith("(Unterminated string starting at column 19)")
    assert one('{"id": 1,, "text": "x"}').message == (f"{URI} line 1: malformed JSON (Expecting property "
                                                       "name enclosed in double quotes at column 10)")


@pytest.mark.parametrize("line, kind", [('[1, "text"]', "list"), ('"just a string"', "str"),
                                        ("42", "int"), ("null", "NoneType")])
def test_non_object_lines(line: str, kind: str) -> None:
    rec = one(line)
    assert rec.error == "malformed_json"
    assert rec.message == f"{URI} line 1: expected a JSON object, got {kind}"


@pytest.mark.parametrize("line, shown", [
    ('{"text": "no id"}', "missing"),
    ('{"id": null, "text": "null id"}', "missing"),
    ('{"id": 1.5, "text": "float id"}', "1.5"),
    ('{"id": 2.0, "text": "float id"}', "2.0"),
    ('{"id": true, "text": "bool id"}', "True"),
    ('{"id": false, "text": "bool id"}', "False"),
    ('{"id": {"a": 1}, "text": "object id"}', "{'a': 1}"),
    ('{"id": [1], "text": "list id"}', "[1]"),
    ('{"id": "", "text": "empty id"}', "''"),
])
def test_bad_ids(line: str, shown: str) -> None:
    rec = one(line)
    assert rec.error == "missing_id"
    assert rec.record_id is None and rec.text is None and rec.ordinal == 0
    assert rec.message.startswith(f"{URI} line 1: id field 'id' is ")
    assert shown in rec.message


def test_missing_text() -> None:
    for line in ('{"id": 7}', '{"id": 7, "text": null}'):
        rec = one(line)
        assert (rec.error, rec.record_id, rec.text) == ("missing_text", "7", None)
        assert rec.message.startswith(f"{URI} line 1: record '7' has no text field 'text'")


@pytest.mark.parametrize("value, type_name", [(3, "int"), (["a"], "list"), ({"t": "x"}, "dict"),
                                              (True, "bool"), (1.0, "float")])
def test_non_string_text(value: object, type_name: str) -> None:
    rec = one(json.dumps({"id": "r", "text": value}))
    assert (rec.error, rec.record_id, rec.text) == ("invalid_text", "r", None)
    assert rec.message.endswith(f"must be a string, got {type_name}")


@pytest.mark.parametrize("text", ["", " ", "\t\n  ", "\u3000"])
def test_empty_or_whitespace_text(text: str) -> None:
    rec = one(json.dumps({"id": 9, "text": text}))
    assert (rec.error, rec.record_id) == ("empty_text", "9")
    assert "line 1" in rec.message and "empty text" in rec.message


def test_invalid_utf8_bytes_name_the_line() -> None:
    recs = read('{"id": 1, "text": "ok"}', b'{"id": 2, "text": "bad \xff\xfe bytes"}', '{"id": 3, "text": "ok"}')
    assert [r.error for r in recs] == [None, "invalid_utf8", None]
    bad = recs[1]
    assert bad.ordinal == 1 and bad.record_id is None
    assert bad.message.startswith(f"{URI} line 2: invalid UTF-8 at byte 23")
    assert [r.ordinal for r in recs] == [0, 1, 2]


def test_lone_surrogate_escape_is_invalid_utf8() -> None:
    recs = read('{"id": 1, "text": "ok"}', r'{"id": "s", "text": "before \ud800 after"}')
    bad = recs[1]
    assert (bad.error, bad.record_id, bad.text, bad.ordinal) == ("invalid_utf8", "s", None, 1)
    assert bad.message.startswith(f"{URI} line 2: record 's' text is not valid Unicode")
    assert "character 7" in bad.message
    # a valid surrogate pair is fine
    ok = one(r'{"id": "p", "text": "rocket \ud83d\ude80"}')
    assert ok.error is None and ok.text == "rocket 🚀"


def test_blank_lines_are_skipped_without_consuming_ordinals() -> None:
    data = io.BytesIO(b'\n{"id": 1, "text": "a"}\n   \n\r\n{"id": 2, "text": "b"}\n\n'
                      b'not json\n\t\n{"id": 4, "text": "d"}')   # last line has no newline
    recs = list(read_jsonl(data, URI, "id", "text"))
    assert [r.ordinal for r in recs] == [0, 1, 2, 3]
    assert [r.record_id for r in recs] == ["1", "2", None, "4"]
    assert recs[2].error == "malformed_json" and recs[2].message.startswith(f"{URI} line 7:")


def test_ordinals_cover_every_non_blank_line() -> None:
    lines = ['{"id": 1, "text": "a"}', "{", "[]", '{"id": 1.5, "text": "x"}', '{"id": 5}',
             '{"id": 6, "text": 6}', '{"id": 7, "text": " "}', b'\xc3\x28', r'{"id": 9, "text": "\udfff"}',
             '{"id": 10, "text": "ok"}']
    recs = read(*lines)
    assert [r.ordinal for r in recs] == list(range(len(lines)))
    assert [r.error for r in recs] == [None, "malformed_json", "malformed_json", "missing_id", "missing_text",
                                       "invalid_text", "empty_text", "invalid_utf8", "invalid_utf8", None]
    for i, r in enumerate(recs):
        if r.error:
            assert f"line {i + 1}:" in r.message


def test_read_records_dispatch() -> None:
    recs = list(read_records(jsonl('{"id": 1, "text": "a"}'), "jsonl", URI, "id", "text"))
    assert recs == [InputRecord(0, "1", "a")]
    line = '{"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}'
    (rec,) = read_records(jsonl(line), "openai-batch", URI, "id", "text", task="generate")
    assert (rec.record_id, rec.text, rec.endpoint, rec.error) == ("c1", "hi", "/v1/completions", None)
    with pytest.raises(NotImplementedError, match="csv"):
        read_records(io.BytesIO(b""), "csv", URI, "id", "text")


# --- generate: prompts and chat messages ----------------------------------------------------------


def test_prompt_records_use_their_own_codes_and_hint() -> None:
    recs = list(read_jsonl(jsonl('{"id": 1, "q": "Why?"}', '{"id": 2}', '{"id": 3, "q": 4}', '{"id": 4, "q": " "}'),
                           URI, "id", "q", kind="prompt"))
    assert [(r.record_id, r.text, r.error) for r in recs] == [
        ("1", "Why?", None), ("2", None, "missing_prompt"), ("3", None, "invalid_prompt"), ("4", None, "empty_prompt")]
    assert "input.prompt_field" in recs[1].message and "line 2" in recs[1].message
    assert "nothing to generate from" in recs[3].message


def test_chat_messages_are_read_and_normalised() -> None:
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there"}],
             "name": "ann"}]
    (rec,) = read_jsonl(jsonl(json.dumps({"id": "c", "messages": msgs})), URI, "id", "messages", kind="messages")
    assert rec.error is None and rec.text is None
    assert rec.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, there"}]


@pytest.mark.parametrize("messages, fragment", [
    ([], "non-empty list"),
    ("hi", "non-empty list of {role, content} objects, got str"),
    (["hi"], "message 0 must be an object"),
    ([{"role": "robot", "content": "x"}], "message 0 has role 'robot'"),
    ([{"role": "user"}], "message 0 content must be a string, got null"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "end with a user message"),
    ([{"role": "user", "content": "bad \ud800"}], "not valid Unicode"),
])
def test_bad_chat_messages_are_error_rows_naming_the_problem(messages: object, fragment: str) -> None:
    (rec,) = read_jsonl(jsonl(json.dumps({"id": "m1", "msgs": messages})), URI, "id", "msgs", kind="messages")
    assert (rec.record_id, rec.error, rec.messages) == ("m1", "invalid_messages", None)
    assert rec.message.startswith(f"{URI} line 1: record 'm1' field 'msgs' ") and fragment in rec.message
    (rec,) = read_jsonl(jsonl('{"id": "m2"}'), URI, "id", "msgs", kind="messages")
    assert rec.error == "missing_messages" and "input.messages_field" in rec.message


def test_parquet_chat_messages_column() -> None:
    msgs = pa.array([[{"role": "user", "content": "hi"}], None],
                    pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
    recs = list(read_parquet(parquet(pa.table({"id": ["a", "b"], "chat": msgs})), PQ, "id", "chat", kind="messages"))
    assert recs[0].messages == [{"role": "user", "content": "hi"}] and recs[0].error is None
    assert recs[1].error == "missing_messages"
    recs = list(read_parquet(parquet(pa.table({"id": ["a"]})), PQ, "id", "chat", kind="messages"))
    assert recs[0].error == "missing_column" and "input.messages_field" in recs[0].message


# --- Parquet ---------------------------------------------------------------------------------------


def parquet(table: pa.Table, **kw: object) -> io.BytesIO:
    buf = io.BytesIO()
    pq.write_table(table, buf, **kw)
    buf.seek(0)
    return buf


PQ = "s3://bucket/in.parquet"


def test_read_parquet_rows() -> None:
    table = pa.table({"id": pa.array(["a", None, "c", "d", "e"], pa.string()),
                      "text": pa.array(["hello", "no id", None, "", "  world  "], pa.string()),
                      "other": [1, 2, 3, 4, 5]})
    recs = list(read_parquet(parquet(table), PQ, "id", "text"))
    assert [(r.ordinal, r.record_id, r.text, r.error) for r in recs] == [
        (0, "a", "hello", None), (1, None, None, "missing_id"), (2, "c", None, "missing_text"),
        (3, "d", None, "empty_text"), (4, "e", "  world  ", None)]
    assert recs[1].message.startswith(f"{PQ} row 1: id field 'id' is missing")
    assert recs[2].message.startswith(f"{PQ} row 2: record 'c' has no text field 'text'")
    assert recs[3].message.startswith(f"{PQ} row 3:")


def test_read_parquet_int_ids_and_many_row_groups() -> None:
    n = 10_000
    table = pa.table({"text": [f"t{i}" for i in range(n)], "id": pa.array(range(n), pa.int64())})
    recs = list(read_parquet(parquet(table, row_group_size=3000), PQ, "id", "text"))
    assert len(recs) == n
    assert [r.ordinal for r in recs] == list(range(n))
    assert all(r.record_id == str(i) and r.text == f"t{i}" and r.error is None for i, r in enumerate(recs))


def test_read_parquet_non_string_text_column() -> None:
    table = pa.table({"id": ["a", "b"], "text": [1, 2]})
    recs = list(read_parquet(parquet(table), PQ, "id", "text"))
    assert [r.error for r in recs] == ["invalid_text", "invalid_text"]


def test_read_parquet_missing_column_errors_every_row() -> None:
    table = pa.table({"id": ["a", "b", "c"], "body": ["x", "y", "z"], "lang": ["en", "de", "fr"]})
    recs = list(read_parquet(parquet(table), PQ, "id", "text"))
    assert [r.ordinal for r in recs] == [0, 1, 2]
    assert all(r.error == "missing_column" and r.record_id is None and r.text is None for r in recs)
    msg = recs[0].message
    assert msg.startswith(f"{PQ}: has no column 'text'")
    assert "columns: id, body, lang" in msg
    assert "input.text_field" in msg
    # the same file read with the right field name is fine
    recs = list(read_parquet(parquet(table), PQ, "id", "body"))
    assert [(r.record_id, r.text, r.error) for r in recs] == [("a", "x", None), ("b", "y", None), ("c", "z", None)]


def test_read_parquet_missing_id_column() -> None:
    table = pa.table({"text": ["x", "y"]})
    recs = list(read_records(parquet(table), "parquet", PQ, "doc_id", "text"))
    assert len(recs) == 2 and all(r.error == "missing_column" for r in recs)
    assert "no column 'doc_id'" in recs[0].message and "columns: text" in recs[0].message


def test_overlong_jsonl_line_is_an_error_row_and_reading_goes_on() -> None:
    import io

    from batchinf.formats.jsonl import read_jsonl

    data = (b'{"id": "a", "text": "short"}\n' + b'{"id": "b", "text": "' + b"x" * 500 + b'"}\n'
            + b'{"id": "c", "text": "after"}\n' + b'{"id": "d", "text": "' + b"y" * 300)
    recs = list(read_jsonl(io.BytesIO(data), "mem://f", "id", "text", max_line_bytes=100))
    assert [(r.ordinal, r.record_id, r.error) for r in recs] == [
        (0, "a", None), (1, None, "line_too_long"), (2, "c", None), (3, None, "line_too_long")]
    assert "line 2" in recs[1].message and "100 bytes" in recs[1].message
