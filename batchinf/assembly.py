"""Records staged in pieces (transcribe's long files: several staged rows each, run on any
shards and workers), assembled at publish. No shard's part holds their rows: each attempt wrote
its pieces' outputs beside its part (parts.pieces_of). Verification reads them with the parts
(verify.py) into `Pieces`; the task assembles each record whose pieces are all committed into its
one result or error row (`Task.assemble`); those rows become parts of their own
(`assembled_parts`), listed in `_MANIFEST.json`, checked and covered like every other part, and
the error rows join the ledger's record errors when the job's final transition commits. A record
with a piece not committed is not published (`_PARTIAL.json`: among the records not done)."""

from __future__ import annotations

import os
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from batchinf.digests import sha256_file
from batchinf.errors import VerificationError
from batchinf.ledger.states import SHARD_DONE
from batchinf.parts import ERROR_SCHEMA, pieces_of
from batchinf.tasks.base import PIECE, Assembled


class Pieces:
    """The piece outputs of a job's committed attempts, read beside their parts as verification
    reads those (`read_part`: verify.read_part, each file checked against what its reader was
    told: the ledger's word for a part, the part's footer for its piece outputs), and the records
    a committed error row already fails (a poison piece: the record's other pieces are not
    assembled; its error row stands)."""

    def __init__(self, task: Any, read_part: Callable[..., Any]) -> None:
        self.task, self.read_part = task, read_part
        self.tables: list[pa.Table] = []
        self.shards: list[str] = []
        self.failed: set[tuple[str, int]] = set()
        self.at: dict[tuple[str, int, int], str] = {}       # (source, ordinal, piece) -> the shard that ran it

    def add_part(self, kind: str, part_uri: str, shard: str, got: Any) -> None:
        """A committed part as read (verify.PartCopy; an errors part's coverage columns read): an
        errors part's records are failed; a results part's footer may name piece outputs."""
        if kind == "errors":
            self.failed.update(zip(got.table.column("source").to_pylist(), got.table.column("ordinal").to_pylist()))
            return
        ref = pieces_of(part_uri, got.path)
        if ref is None:
            return
        with self.read_part(ref["uri"], list(self.task.piece_schema.names)) as piece:
            if (piece.sha256, piece.rows) != (ref["sha256"], ref["rows"]):
                raise VerificationError(f"{ref['uri']} (shard {shard}) has sha256 {piece.sha256[:12]}… and "
                                        f"{piece.rows} rows; its part names {ref['sha256'][:12]}… and {ref['rows']}")
            t = piece.table
        self.tables.append(t)
        self.shards.append(shard)
        self.at.update(dict.fromkeys(zip(t.column("source").to_pylist(), t.column("ordinal").to_pylist(),
                                         t.column(PIECE).to_pylist()), shard))

    def add_empty_parts(self, rows: list[Any]) -> None:
        """The done shards whose part has no rows (it is not published, so not read as a part):
        their footers may name piece outputs all the same (a shard of pieces only)."""
        for r in rows:
            if r.status in SHARD_DONE and r.output_uri and not r.output_rows:
                with self.read_part(r.output_uri) as got:
                    if got.sha256 != r.output_sha256:
                        raise VerificationError(f"{r.output_uri} (shard {r.id}) has sha256 {got.sha256[:12]}…; the "
                                                f"ledger committed {(r.output_sha256 or '')[:12]}…")
                    self.add_part("results", r.output_uri, r.id, got)

    def assemble(self, complete: bool) -> tuple[Assembled | None, dict[str, Any]]:
        """The records assembled from the pieces (`Task.assemble`) and their counts (`pieces` in
        `_MANIFEST.json` counts and in the job's summary, which the status adds). `complete`:
        every shard is done, so a record with a piece missing fails verification."""
        if not self.tables:
            return None, {}
        got = self.task.assemble(pa.concat_tables(self.tables), self.failed)
        if complete and got.incomplete:
            (src, ordinal), what = next(iter(sorted(got.incomplete.items())))
            raise VerificationError(f"record {ordinal} of {src} is staged in pieces and not all of them committed "
                                    f"({what}; {len(got.incomplete)} records so)")
        counts = {"records": got.results.num_rows + len(got.errors), "succeeded": got.results.num_rows,
                  "failed": len(got.errors), "rows": got.rows}
        if got.incomplete:
            counts["not_done"] = len(got.incomplete)
        return got, counts

    def ledger_rows(self, errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The assembled error rows as the ledger records errors (`record_errors`), each charged to
        the shard that ran the piece it names."""
        return [{**{k: e[k] for k in ERROR_SCHEMA.names}, "shard_id": self.at[(e["source"], e["ordinal"], e["piece"])]}
                for e in errors]


def assembled_parts(got: Assembled, parts: list[dict[str, Any]], shards: list[str], tmp: str
                    ) -> list[tuple[dict[str, Any], str, pa.Table]]:
    """The assembled records as parts numbered after the committed ones (`parts`), written to
    `tmp`: (their `_MANIFEST.json` entry, local path, table). Rows in (source, ordinal) order, so
    publishing again writes the same bytes."""
    out = []
    for kind, table in (("results", got.results), ("errors", pa.Table.from_pylist(got.errors, schema=ERROR_SCHEMA))):
        if not table.num_rows:
            continue
        number = sum(1 for p in parts if p["kind"] == kind)
        key = ("" if kind == "results" else "errors/") + f"part-{number:05d}.parquet"
        local = os.path.join(tmp, f"assembled-{kind}.parquet")
        pq.write_table(table, local, compression="zstd")
        out.append(({"key": key, "kind": kind, "sha256": sha256_file(local), "rows": table.num_rows,
                     "assembled_from": sorted(set(shards))}, local, table))
    return out
