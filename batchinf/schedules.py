"""Schedules: a manifest template submitted once per logical date by a ledger-driven tick.

The logical date `ds` (YYYY-MM-DD) of a fire time is its calendar date in the schedule's time
zone; a schedule makes at most one job per date. Exactly once per date holds across restarts,
concurrent schedulers and backfills because two unique constraints guard it: the job's
(tenant, idempotency_key) with a key that contains the date (default `schedule:NAME:{ds}`), and
`schedule_runs` (schedule, ds). A crash between the two leaves a job without its run row; the
next tick finds the job by its key and records the row.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any

import yaml
from batchinf import metrics
from batchinf.cron import parse_cron, zone
from batchinf.errors import BatchinfError, LedgerError, ManifestError
from batchinf.ledger.jobs import find_by_key
from batchinf.scopes import Caller
from batchinf.submit import submit
from batchinf.ledger import schedules as repo
from batchinf.ledger.events import now as clock
from batchinf.manifest import JobManifest, parse_manifest
from batchinf.tenants import DEFAULT_TENANT, check_tenant

log = logging.getLogger("batchinf.scheduler")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")
PLACEHOLDER = "{ds}"


def _substitute(value: Any, ds: str, placeholder: str = PLACEHOLDER) -> Any:
    """Replace the placeholder in every string of the parsed template (not in its text, so YAML
    typing never turns a date into something else)."""
    if isinstance(value, str):
        return value.replace(placeholder, ds)
    if isinstance(value, dict):
        return {k: _substitute(v, ds, placeholder) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, ds, placeholder) for v in value]
    return value


def render(name: str, template: dict[str, Any], ds: str) -> JobManifest:
    raw = _substitute(template, ds)
    raw.setdefault("idempotency_key", f"schedule:{name}:{ds}")
    return parse_manifest(raw)


_MARK = "__batchinf_ds__"


def load_template(text: str) -> dict[str, Any]:
    """Parse a template's YAML/JSON text; {ds} may stand anywhere a string may (even unquoted)."""
    try:
        raw = _substitute(yaml.safe_load(text.replace(PLACEHOLDER, _MARK)), PLACEHOLDER, _MARK)
    except yaml.YAMLError as exc:
        raise ManifestError(f"the manifest template is not valid YAML/JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ManifestError("a manifest template must be a mapping with name, task, bundle, input and output")
    return raw


def _check_template(name: str, template: dict[str, Any]) -> None:
    a, b = render(name, template, "2000-01-01"), render(name, template, "2000-01-02")
    if a.output_uri == b.output_uri:
        raise ManifestError("output.uri of a schedule's template must contain {ds}, so that each "
                            "logical date writes its own output, e.g. s3://embeddings/{ds}/")
    if a.idempotency_key == b.idempotency_key:
        raise ManifestError("idempotency_key of a schedule's template must contain {ds} (or leave it "
                            "out: the default is schedule:NAME:{ds})")


def parse_start(text: str | None, tz_name: str) -> float:
    """DATE or ISO 8601 time (local to the schedule's zone when it has no offset) -> UNIX seconds."""
    if text is None:
        return clock()
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise ManifestError(f"start {text!r} is not a date or ISO 8601 time, e.g. 2026-12-01") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=zone(tz_name))
    return t.timestamp()


def add(name: str, cron: str, template_text: str, *, tz: str = "UTC", catchup: bool = True,
        tenant: str = DEFAULT_TENANT, start: str | None = None) -> dict[str, Any]:
    if not _NAME.match(name):
        raise ManifestError(f"schedule name {name!r} must be 1-200 letters, digits, '.', '_' or '-'")
    check_tenant(tenant)
    parse_cron(cron)
    zone(tz)
    template = load_template(template_text)
    _check_template(name, template)
    repo.add({"name": name, "tenant": tenant, "cron": cron, "timezone": tz, "template": json.dumps(template),
              "catchup": catchup, "paused": False, "created_at": clock(), "start_at": parse_start(start, tz)})
    return get(name)


def _describe(row: Any, runs: int, last_ds: str | None, now: datetime) -> dict[str, Any]:
    nxt = next_fire(row, now)
    return {"name": row.name, "tenant": row.tenant, "cron": row.cron, "timezone": row.timezone,
            "catchup": bool(row.catchup), "paused": bool(row.paused), "created_at": row.created_at,
            "start_at": row.start_at, "template": json.loads(row.template), "runs": runs,
            "last_ds": last_ds, "next_fire": nxt.isoformat() if nxt else None}


def get(name: str, now: datetime | None = None) -> dict[str, Any]:
    found = list_schedules(name=name, now=now)
    if not found:
        raise LedgerError(f"no schedule {name!r}; see `batchinf schedule list`")
    return found[0]


def list_schedules(tenant: str | None = None, *, name: str | None = None,
                   now: datetime | None = None) -> list[dict[str, Any]]:
    now = now or datetime.now(UTC)
    return [_describe(r, n, last, now) for r, n, last in repo.listing(tenant, name)]


def set_paused(name: str, paused: bool) -> dict[str, Any]:
    get(name)
    repo.set_paused(name, paused)
    return get(name)


def _days(first: date, last: date) -> Iterator[date]:
    d = first
    while d <= last:
        yield d
        d += timedelta(days=1)


def due_dates(row: Any, now: datetime, done: set[str]) -> list[str]:
    """Logical dates whose fire time is in [start, now] and that have no job yet: all of them
    (catchup) or only the latest (no catchup)."""
    cron, tz = parse_cron(row.cron), zone(row.timezone)
    start = datetime.fromtimestamp(row.start_at if row.start_at is not None else row.created_at, tz)
    due = []
    for d in _days(start.date(), now.astimezone(tz).date()):
        fire = cron.first_fire(d, tz)
        if fire is not None and start <= fire <= now:
            due.append(d.isoformat())
    if not row.catchup:
        due = due[-1:]
    return [ds for ds in due if ds not in done]


def next_fire(row: Any, now: datetime) -> datetime | None:
    cron, tz = parse_cron(row.cron), zone(row.timezone)
    local = now.astimezone(tz).date()
    for d in _days(local, local + timedelta(days=366 * 5)):
        fire = cron.first_fire(d, tz)
        if fire is not None and fire > now:
            return fire
    return None


def submit_for(row: Any, ds: str) -> tuple[str, bool]:
    """The job of schedule `row` for logical date `ds`: created now, or the one that exists."""
    existing = repo.runs(row.name).get(ds)
    if existing:
        return existing, False
    m = render(row.name, json.loads(row.template), ds)
    try:
        job_id, created = submit(m, Caller(row.tenant, operator=True), schedule=row.name)   # the operator's
    except ManifestError:
        # a concurrent scheduler's job for this date can make the output look "in use"
        job_id, created = find_by_key(row.tenant, m.idempotency_key or ""), False
        if job_id is None:
            raise
    repo.record_run(row.name, ds, job_id)
    if created:
        metrics.job_scheduled(row.name)
    return job_id, created


def tick(now: datetime | None = None) -> list[dict[str, Any]]:
    """Submit every unpaused schedule's due dates as of `now` (default: the current time).
    Returns one entry per date considered: schedule, ds, job_id, created (or error)."""
    now = now or datetime.now(UTC)
    if now.tzinfo is None:
        raise ValueError("tick(now) needs an aware datetime")
    out = []
    for row, _, _ in repo.listing(unpaused=True):
        for ds in due_dates(row, now, set(repo.runs(row.name))):
            out.append(_submit_logged(row, ds))
    return out


def _submit_logged(row: Any, ds: str) -> dict[str, Any]:
    try:
        job_id, created = submit_for(row, ds)
    except BatchinfError as exc:
        log.warning("schedule %s, %s: %s", row.name, ds, exc)
        return {"schedule": row.name, "ds": ds, "job_id": None, "created": False, "error": str(exc)}
    if created:
        log.info("schedule %s, %s: submitted %s", row.name, ds, job_id)
    return {"schedule": row.name, "ds": ds, "job_id": job_id, "created": created}


def backfill(name: str, first: date, last: date) -> list[dict[str, Any]]:
    """Submit the schedule for every date in [first, last] on which its cron fires, paused or not;
    dates that already have a job keep it (created: false)."""
    if last < first:
        raise ManifestError(f"--to {last} is before --from {first}")
    row = repo.get(name)
    cron = parse_cron(row.cron)
    return [_submit_logged(row, d.isoformat()) for d in _days(first, last) if cron.matches_day(d)]
