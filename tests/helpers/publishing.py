"""Jobs caught in verification: a small embed job, a hook that acts each time the driver has
stepped it while it is verifying (to inject a fault there), and what its output published."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from sqlalchemy import select

from batchinf import failpoints
from batchinf.config import settings
from batchinf.ledger import jobs
from batchinf.ledger.db import tx
from batchinf.ledger.tables import job_events
from batchinf.ledger.states import JobStatus
from batchinf.manifest import parse_manifest
from batchinf.parts import read_table
from batchinf.store import get_store, join
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.verify import MANIFEST
from tests.helpers.corpus import manifest, write_jsonl


def small_job(tmp_path: Path, output_uri: str, records: int = 60) -> tuple[str, set[str]]:
    """A submitted embed job over one local JSONL object, in shards of 20 records: (job id, record ids)."""
    good = write_jsonl(tmp_path / "in" / "a.jsonl", records, bad=False)
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in" / "a.jsonl"), output_uri,
                                               shards={"max_records": 20})), OPERATOR)
    return job_id, set(good)


def while_verifying(job_id: str, act: Callable[[int], None]) -> Callable[[], None]:
    """An `on_tick` for `controller.drive`: after every step that leaves the job verifying, call
    `act(n)`, n counting those steps from 1 (1: the job has just become verifying)."""
    seen = [0]

    def tick() -> None:
        if jobs.get(job_id).status == JobStatus.VERIFYING:
            seen[0] += 1
            act(seen[0])
    return tick


def set_failpoints(spec: str | None) -> None:
    """Faults for this process only (worker processes already started keep their own): `spec` as
    in BATCHINF_FAILPOINTS, or None for none."""
    if spec is None:
        os.environ.pop("BATCHINF_FAILPOINTS", None)
    else:
        os.environ["BATCHINF_FAILPOINTS"] = spec
    settings.cache_clear()
    failpoints.reload()


def published_ids(output_uri: str) -> list[str]:
    """The record ids of every result part `_MANIFEST.json` lists, in order (duplicates kept)."""
    m = json.loads(get_store(output_uri).get_bytes(join(output_uri, MANIFEST)))
    return [rid for p in m["parts"] if p["kind"] == "results"
            for rid in read_table(join(output_uri, p["key"]), columns=["record_id"]).column("record_id").to_pylist()]


def part_keys(output_uri: str) -> list[str]:
    """The keys of every object under the output prefix but its `_work/`, sorted."""
    base = output_uri.rstrip("/") + "/"
    return [p.uri[len(base):] for p in get_store(base).list(base) if not p.uri[len(base):].startswith("_work/")]


def job_moves(job_id: str) -> list[tuple[str, str]]:
    """Every (from, to) of the job's own transitions, in order, from `job_events`."""
    with tx() as conn:
        return [(e.from_status, e.to_status) for e in conn.execute(
            select(job_events).where(job_events.c.job_id == job_id, job_events.c.kind == "job")
            .order_by(job_events.c.id)).all()]
