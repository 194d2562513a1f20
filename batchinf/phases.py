"""Phases: where a job's wall time goes, from the marks its ledger row keeps (`jobs.phases`).

The marks are written where each phase ends, in statements that run anyway: the process that
created the job (`batchinf run` / `submit`) names its own start; every job transition records its
time (`ledger.jobs.transition`); an embedded driver records when it spawned each worker process,
when the worker was ready (imports done) and when it had the bundle loaded (`WorkerPool.reports`);
a committed attempt records the model load its worker paid (`attempts.load_seconds`).

`compute` cuts the wall time into consecutive phases (they never overlap, so they sum to the wall
time, less any that were not measured):

    startup     the creating process's start -> the job's creation (interpreter, imports, submit)
    pin         creation -> inputs pinned (waiting for a driver included)
    plan        pinned -> planned (running)
    pool_start  planned -> the first ready worker had started (what worker start-up planning did not hide)
    model_load  -> that worker had its bundle loaded (what loading ahead did not hide)
    execute     -> every shard done (verifying)
    publish     -> published (`_MANIFEST.json` written), or the job ended

and gives each worker's own account of its time within the job (spawn -> verifying): `start`
(spawn to ready), `model_load`, `busy` (its attempts of this job), `idle` (the rest: up, loaded,
not running a shard of the job). A worker no driver reported (a Celery worker) counts from the
job's execute phase, with no `start`.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

PHASES = ("startup", "pin", "plan", "pool_start", "model_load", "execute", "publish")


@dataclass(frozen=True)
class AttemptSpan:
    """One attempt of the job, as `ledger.attempts.spans` reads it."""
    worker: str
    started_at: float
    finished_at: float | None
    load_seconds: float | None = None


def process_started_at(pid: int | str = "self") -> float | None:
    """When this process (or `pid`) started, in UNIX seconds, to the kernel's clock tick (10 ms):
    its start time since boot (/proc/<pid>/stat) against the boot-time clock. None where there is
    no /proc (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()      # after the command name: fields 3..
        since_boot = float(fields[19]) / os.sysconf("SC_CLK_TCK")   # field 22, starttime, in ticks
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - max(0.0, age)


def _ms(x: float | None) -> float | None:
    """Seconds to the ms; None for a phase not measured, or still going on when no `now` ends it."""
    return None if x is None or math.isinf(x) else round(max(0.0, x), 3)


def _first_ready(workers: dict[str, dict[str, Any]], attempts: list[AttemptSpan] | None) -> tuple[float, float] | None:
    """(ready, loaded) of the worker that was first ready to run a shard: from the driver's reports
    (the earliest loaded), else from the job's first attempt (its start, plus the load it paid)."""
    loaded = [(w["loaded_at"], w.get("ready_at") or w["loaded_at"]) for w in workers.values() if w.get("loaded_at")]
    if loaded:
        at, ready = min(loaded)
        return ready, at
    if attempts:
        first = min(attempts, key=lambda a: a.started_at)
        return first.started_at, first.started_at + (first.load_seconds or 0.0)
    return None


def compute(marks: dict[str, Any], created_at: float, *, now: float | None,
            attempts: list[AttemptSpan] | None = None) -> dict[str, Any]:
    """The phases of a job's wall time (seconds, to the ms) from its marks (`jobs.phases`) and its
    creation. `now` ends the phase in progress (publishing: the time the output document is
    written; a job that ended: its `finished_at`); None (a status read while the job runs) leaves
    it and `wall` None, so that two reads of an unchanged job agree. With `attempts` (all of the
    job's), each worker's `busy` and `idle` too; without them those are None. A phase not reached
    or not measured is None."""
    at: dict[str, float] = marks.get("at") or {}
    workers: dict[str, dict[str, Any]] = marks.get("workers") or {}
    p0 = marks.get("process_started_at")
    origin = min(p0, created_at) if p0 is not None else created_at
    end = max(now, created_at) if now is not None else math.inf

    def clamp(t: float | None, lo: float) -> float | None:
        return None if t is None else min(max(t, lo), end)

    pinned = clamp(at.get("planning"), created_at)
    running = clamp(at.get("running"), pinned) if pinned is not None else None
    verifying = clamp(at.get("verifying"), running) if running is not None else None
    out: dict[str, Any] = {"wall": _ms(end - origin), "startup": _ms(created_at - p0) if p0 is not None else None,
                           "pin": _ms((pinned or end) - created_at),
                           "plan": _ms((running or end) - pinned) if pinned is not None else None,
                           "pool_start": None, "model_load": None, "execute": None, "publish": None}
    if running is not None:
        stop = verifying if verifying is not None else end
        first = _first_ready(workers, attempts)
        ready = loaded = running
        if first is not None:
            ready = min(max(first[0], running), stop)
            loaded = min(max(first[1], ready), stop)
            out["pool_start"], out["model_load"] = _ms(ready - running), _ms(loaded - ready)
        out["execute"] = _ms(stop - loaded)
        if verifying is not None:
            out["publish"] = _ms(end - verifying)
    out["workers"] = _workers(workers, attempts, created_at, running, verifying if verifying is not None else end)
    return out


def _workers(reports: dict[str, dict[str, Any]], attempts: list[AttemptSpan] | None, created_at: float,
             running: float | None, until: float) -> list[dict[str, Any]]:
    mine: dict[str, list[AttemptSpan]] = {}
    for a in attempts or ():
        mine.setdefault(a.worker, []).append(a)
    out = []
    for name in sorted(set(reports) | set(mine)):
        r, spans = reports.get(name, {}), mine.get(name, [])
        since = r.get("spawned_at")
        since = max(since, created_at) if since is not None else running
        start = (r["ready_at"] - r["spawned_at"]) if r.get("ready_at") and r.get("spawned_at") else None
        load = (r["loaded_at"] - r["ready_at"]) if r.get("loaded_at") and r.get("ready_at") else \
            sum(a.load_seconds or 0.0 for a in spans) if spans else None
        busy = sum(min(a.finished_at or until, until) - a.started_at for a in spans) if attempts is not None else None
        up = (until - since) if since is not None else None
        idle = up - (start or 0.0) - (load or 0.0) - busy if up is not None and busy is not None else None
        out.append({"worker": name, "start": _ms(start), "model_load": _ms(load), "busy": _ms(busy),
                    "idle": _ms(idle), "shards": len(spans) if attempts is not None else None})
    return out


def view(stored: str | None, created_at: float, finished_at: float | None) -> dict[str, Any]:
    """A job's phases as its status shows them, from its row's marks (`jobs.phases`, JSON): those
    computed as it ended (the same as its output document's), else those that have ended (no
    worker's `busy` or `idle` yet: they need its attempts, which a status read does not scan)."""
    marks = json.loads(stored) if stored else {}
    return marks.get("final") or compute(marks, created_at, now=finished_at)
