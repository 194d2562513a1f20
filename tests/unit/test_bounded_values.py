"""Every value a tenant hands the controller is bounded: numbers in a document of any YAML or JSON
spelling are refused before they are built, every integer and number of the manifest has a ceiling
(by construction: the schema walk below fails for a new field without one), job names are
printable and short, and an S3 Inventory file decodes within the bounded reader's limits."""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf.documents import MAX_NUMBER_CHARS, DocumentError, parse_document
from batchinf.errors import ManifestError
from batchinf.formats import compression, inventory
from batchinf.manifest import OPTIONS, job_schema, parse_manifest

# (spelling, a long scalar of it): each resolves (YAML 1.1, or 1.2 for 0o) to an int or a float
LONG = 2 * MAX_NUMBER_CHARS + 37
SPELLINGS = {
    "decimal": "7" * LONG,
    "negative": "-" + "8" * LONG,
    "plus sign": "+" + "3" * LONG,
    "hex": "0x" + "aB" * (LONG // 2),
    "signed hex": "-0x" + "c" * LONG,
    "octal 0o": "0o" + "6" * LONG,
    "octal 0": "0" + "5" * LONG,
    "binary": "0b" + "10" * LONG,
    "underscores": "1" + "_000" * (LONG // 4),
    "base 60 int": "2" + ":48" * (LONG // 3),
    "base 60 float": "3" + ":07" * (LONG // 3) + ".25",
    "float": "0." + "4" * LONG,
    "exponent": "1.5e+" + "9" * LONG,
    "explicit int tag": "!!int 0x" + "e" * LONG,
    "explicit float tag": "!!float " + "2" * LONG,
    "non-specific tag": "! 0x" + "d" * LONG,
}


@pytest.mark.parametrize("spelling", SPELLINGS, ids=list(SPELLINGS))
@pytest.mark.parametrize("where", ["value", "key", "list item"])
def test_long_yaml_numbers_are_refused_before_they_are_built(spelling: str, where: str) -> None:
    scalar = SPELLINGS[spelling]
    doc = {"value": f"priority: {scalar}\n", "key": f"{scalar}: 1\n", "list item": f"stop: [a, {scalar}]\n"}[where]
    with pytest.raises(DocumentError, match=f"characters long, over the limit of {MAX_NUMBER_CHARS}"):
        parse_document(doc, "yaml")


@pytest.mark.parametrize("text", ["'0x" + "f" * 500 + "'", '"1' + ":30" * 300 + '"', "|\n  " + "9" * 600])
def test_quoted_and_block_scalars_stay_text(text: str) -> None:
    assert isinstance(parse_document(f"name: {text}\n", "yaml")["name"], str)


def test_base_60_is_linear_not_quadratic() -> None:
    """300 KB of base 60 once took 17 s to build; the scan refuses a whole document of it at once."""
    body = "priority: 1" + ":59" * ((1 << 20) // 3 - 10)
    t0 = time.perf_counter()
    with pytest.raises(DocumentError, match="characters long"):
        parse_document(body, "yaml")
    print(f"\n1 MiB base-60 scalar refused in {time.perf_counter() - t0:.3f}s")


@pytest.mark.parametrize("text", ["9" * 333, "-" + "1" * 444, "1." + "2" * 222, "3e" + "0" * 150, "0." + "0" * 500 + "1"])
def test_long_json_numbers_are_refused_before_they_are_built(text: str) -> None:
    with pytest.raises(DocumentError, match="characters long"):
        parse_document('{"priority": ' + text + "}", "json")


@pytest.mark.parametrize("doc, kind", [("priority: 0x1" + "0" * 17, "yaml"), ("priority: 0b1" + "0" * 70, "yaml"),
                                       ('{"priority": -9223372036854775809}', "json")])
def test_short_numbers_past_64_bits_are_refused(doc: str, kind: str) -> None:
    with pytest.raises(DocumentError, match="integers must fit in 64 bits"):
        parse_document(doc, kind)


def test_numbers_within_the_limits_parse() -> None:
    assert parse_document("a: 0x7fffffffffffffff\nb: 1:30\nc: 1_000\nd: -0b101\n", "yaml") == \
        {"a": (1 << 63) - 1, "b": 90, "c": 1000, "d": -5}


# --- the manifest's numbers -------------------------------------------------------------------


def _numeric_fields(node: Any, path: str = "") -> list[tuple[str, dict]]:
    found = []
    if isinstance(node, dict):
        types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        if "integer" in types or "number" in types:
            found.append((path, node))
        for k, v in node.items():
            found += _numeric_fields(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _numeric_fields(v, f"{path}[{i}]")
    return found


def test_every_integer_and_number_of_the_manifest_has_bounds() -> None:
    """By construction: a new field without a ceiling fails here (integer() always gives one)."""
    fields = _numeric_fields(job_schema())
    assert len(fields) >= 20 and any("target_workers" in p for p, _ in fields)
    for path, node in fields:
        assert "maximum" in node and ("minimum" in node or "exclusiveMinimum" in node), (path, node)
        assert node["maximum"] < 1 << 63, (path, node)


def _base(**extra: Any) -> dict[str, Any]:
    return {"name": "n", "bundle": "b@prod", "input": {"uri": "file:///in/"}, "output": {"uri": "file:///out/"},
            **extra}


@pytest.mark.parametrize("section, key", [("shards", "target_workers"), ("options", "dimensions"),
                                          ("options", "max_length")])
def test_huge_numbers_are_refused_naming_the_field(section: str, key: str) -> None:
    value = (1 << 62) + 12345
    with pytest.raises(ManifestError, match=rf"{section}\.{key} {value} is over the limit of \d+; use at most"):
        parse_manifest(_base(**{section: {key: value}}))


def test_a_field_left_at_64_bits_is_one_the_operator_bounds() -> None:
    """A field whose only ceiling is 64 bits must have an operator limit (config.LIMITS, checked at
    submit) or mean any 64-bit value (seed); a new one needs a ceiling of its own."""
    from batchinf.config import LIMITS
    from batchinf.manifest_rules import INT64_MAX

    described = " ".join(text for _, _, text in LIMITS.values())
    wide = {path.rsplit("/", 1)[-1] for path, node in _numeric_fields(job_schema()) if node["maximum"] == INT64_MAX}
    assert "max_batch_tokens" in wide and "target_workers" not in wide and "dimensions" not in wide
    assert {k for k in wide if k not in described} == {"seed"}, wide


def test_every_task_option_refuses_a_number_past_its_maximum() -> None:
    """Each task's numeric options, one past the schema's maximum: refused with the field named."""
    schema = job_schema()["$defs"]
    checked = 0
    for task, model in OPTIONS.items():
        for key, prop in schema[model.__name__]["properties"].items():
            node = next((n for _, n in _numeric_fields(prop)), None)
            if node is None or node is not prop and "items" not in prop:
                continue
            over = node["maximum"] + (1 if node.get("type") == "integer" or "integer" in node.get("type", []) else 0.5)
            value = [over] if "items" in prop else over
            with pytest.raises(ManifestError, match=rf"options\.{key}"):
                parse_manifest(_base(task=task, options={key: value}))
            checked += 1
    assert checked >= 15


@pytest.mark.parametrize("priority, says", [(1 << 63, "priority 9223372036854775808 is over the limit of"),
                                            (-(1 << 63) - 7, "priority must be an integer >= -9223372036854775808")])
def test_priority_fits_64_bits_built_in_python(priority: int, says: str) -> None:
    """(A document's integers past 64 bits are refused before; the operator's range is checked at submit.)"""
    with pytest.raises(ManifestError, match=says):
        parse_manifest(_base(priority=priority))


@pytest.mark.parametrize("deadline", ["400d", 10**12, "9" * 60 + "h"])
def test_deadline_is_bounded(deadline: Any) -> None:
    with pytest.raises(ManifestError, match="over the limit of 366 days"):
        parse_manifest(_base(deadline=deadline))


@pytest.mark.parametrize("name, says", [("\x00" * 777, "control character '\\\\x00'"), ("ok\nname", "control character"),
                                        ("tab\there", "control character"), ("del\x7f", "control character"),
                                        ("x" * 201, "201 characters long, over the limit of 200"), ("", "is empty")])
def test_job_names_are_printable_and_short(name: str, says: str) -> None:
    with pytest.raises(ManifestError, match=f"^name {says}" if says == "is empty" else f"name .*{says}"):
        parse_manifest(_base(name=name))


def test_a_printable_name_of_200_characters_is_fine() -> None:
    assert parse_manifest(_base(name="é" * 200)).name == "é" * 200       # the ledger's name columns hold 200


# --- S3 Inventory files -------------------------------------------------------------------------

SCHEMA = {"fileSchema": "Bucket, Key, VersionId, IsLatest, IsDeleteMarker"}


def _csv(rows: int) -> bytes:
    out = io.StringIO()
    w = csv.writer(out)
    for i in range(rows):
        w.writerow(["b", f"k%2F{i}", "", "true", "false"])
    return out.getvalue().encode()


def test_a_csv_inventory_streams_its_rows() -> None:
    rows = list(inventory._csv_rows(SCHEMA, gzip.compress(_csv(3)), "s3://inv/a.csv.gz"))
    assert [r["key"] for r in rows] == ["k/0", "k/1", "k/2"]
    assert [r["key"] for r in inventory._csv_rows(SCHEMA, bz2.compress(_csv(2)), "s3://inv/b.csv.bz2")] == ["k/0", "k/1"]


@pytest.mark.parametrize("payload, says", [
    (b"\x00" * (3 << 20), "longer than 65536 bytes"),                   # a bomb with no line ends
    (b"b,k,,true,false\n" * (9 << 16), "decompresses past"),          # 9 MiB of rows, past the reader's bound
])
def test_a_gzip_bomb_inventory_is_refused_naming_the_file(payload: bytes, says: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inventory, "MAX_INVENTORY_ROWS", 1 << 30)      # the bytes bound, not the rows
    monkeypatch.setattr(compression, "MIN_EXPANSION_BYTES", 4 << 20)    # (256 MiB in production)
    blob = gzip.compress(payload, compresslevel=9)
    with pytest.raises(ManifestError, match=f"S3 Inventory file s3://inv/bomb.csv.gz: .*{says}"):
        for _ in inventory._csv_rows(SCHEMA, blob, "s3://inv/bomb.csv.gz"):
            pass


def test_an_inventory_past_its_bytes_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inventory, "MAX_INVENTORY_BYTES", 1000)
    with pytest.raises(ManifestError, match="decompresses past 1000 bytes, the most one inventory file may hold"):
        list(inventory._csv_rows(SCHEMA, gzip.compress(_csv(100)), "s3://inv/big.csv.gz"))


def test_an_inventory_past_its_rows_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inventory, "MAX_INVENTORY_ROWS", 40)
    with pytest.raises(ManifestError, match="lists more than 40 objects"):
        list(inventory._csv_rows(SCHEMA, _csv(41), "s3://inv/many.csv"))
    assert len(list(inventory._csv_rows(SCHEMA, _csv(40), "s3://inv/many.csv"))) == 40


@pytest.mark.parametrize("blob, says", [
    (b"b,\"k\n" * 1000 + b"\xff\xfe", "not UTF-8"),
    (b"b,k0\nonly-a-bucket\n", "line 2 has 1 columns, fewer than its fileSchema"),
    (b'b,"' + (b"k" * 60_000 + b"\n") * 3 + b'"\n', "not valid CSV"),    # a quoted field past csv's field limit
    (gzip.compress(_csv(50))[:-30], "cannot be decompressed"),
])
def test_an_unreadable_csv_inventory_is_a_permanent_error(blob: bytes, says: str) -> None:
    from batchinf.retry_policy import Outcome, classify

    with pytest.raises(ManifestError, match=f"s3://inv/x.csv: .*{says}") as e:
        list(inventory._csv_rows(SCHEMA, blob, "s3://inv/x.csv"))
    assert classify(e.value) is Outcome.FAIL_JOB


def _parquet(table: pa.Table, **kw: Any) -> bytes:
    out = io.BytesIO()
    pq.write_table(table, out, **kw)
    return out.getvalue()


def test_a_parquet_inventory_streams_its_rows_and_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    table = pa.table({"bucket": ["b"] * 5, "key": [f"k{i}" for i in range(5)], "is_latest": [True] * 5,
                      "size": [1] * 5})
    rows = list(inventory._parquet_rows(_parquet(table), "s3://inv/a.parquet"))
    assert [r["key"] for r in rows] == [f"k{i}" for i in range(5)] and "size" not in rows[0]
    monkeypatch.setattr(inventory, "MAX_INVENTORY_ROWS", 4)
    with pytest.raises(ManifestError, match="lists 5 objects, more than 4"):
        list(inventory._parquet_rows(_parquet(table), "s3://inv/a.parquet"))


def test_a_parquet_bomb_inventory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small zstd file that declares (and decodes to) far more than the reader's bound."""
    monkeypatch.setattr(compression, "MIN_EXPANSION_BYTES", 4 << 20)    # (256 MiB in production)
    n = 150_000
    table = pa.table({"bucket": pa.array(["b"] * n), "key": pa.array(["k" * 60] * n)})
    blob = _parquet(table, compression="zstd", use_dictionary=False, row_group_size=n)
    assert len(blob) * 200 < 4 << 20
    with pytest.raises(ManifestError, match="s3://inv/bomb.parquet: decompresses past .*BATCHINF_MAX_EXPANSION"):
        list(inventory._parquet_rows(blob, "s3://inv/bomb.parquet"))


@pytest.mark.parametrize("blob", [b"PAR1 not really", _parquet(pa.table({"other": [1, 2]}))])
def test_an_unreadable_parquet_inventory_is_a_permanent_error(blob: bytes) -> None:
    with pytest.raises(ManifestError, match="S3 Inventory file s3://inv/x.parquet"):
        list(inventory._parquet_rows(blob, "s3://inv/x.parquet"))


def test_json_documents_stay_json() -> None:
    assert parse_document(json.dumps({"a": [1, 2.5, -3]}), "json") == {"a": [1, 2.5, -3]}
