"""Schedules with an injectable clock: one job per logical date, whatever restarts, concurrent
schedulers and backfills happen."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from datetime import date, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import delete, select

from batchinf import schedules
from batchinf.cron import CronError
from batchinf.errors import LedgerError, ManifestError
from batchinf.ledger.db import tx
from batchinf.ledger.tables import jobs, schedule_runs
from tests.helpers.env import subprocess_env, use_database
from tests.helpers.services import fresh_postgres_db

pytestmark = pytest.mark.integration
BERLIN = ZoneInfo("Europe/Berlin")

TEMPLATE = """\
name: nightly
task: embed
bundle: tiny@prod
input: {uri: %(root)s/in/{ds}/, format: jsonl}   # {ds} unquoted, even inside a flow mapping
output: {uri: "%(root)s/out/{ds}/"}
shards: {max_records: 50}
"""


def night(day: int, hour: int = 3) -> datetime:
    return datetime(2026, 1, day, hour, 0, tzinfo=BERLIN)


def add(tmp_path: Path, name: str = "nightly", **kw: object) -> dict:
    text = TEMPLATE % {"root": tmp_path}
    return schedules.add(name, kw.pop("cron", "0 2 * * *"), text, tz="Europe/Berlin", start="2026-01-01", **kw)


def jobs_by_ds(name: str = "nightly") -> Counter[str]:
    with tx() as conn:
        keys = conn.execute(select(jobs.c.idempotency_key).where(jobs.c.schedule == name)).scalars().all()
    return Counter(k.rsplit(":", 1)[1] for k in keys)


def ds_list(*days: int, month: int = 1, year: int = 2026) -> list[str]:
    return [date(year, month, d).isoformat() for d in days]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env=subprocess_env(), check=False,
                          capture_output=True, text=True, timeout=120)


def test_three_nights_make_three_jobs_and_nothing_makes_more(ledger: str, tiny_bundle: str, tmp_path: Path) -> None:
    add(tmp_path)
    assert schedules.tick(night(1, hour=1)) == []                 # before the first 02:00
    for n in (1, 2, 3):
        made = schedules.tick(night(n))
        assert [(r["ds"], r["created"]) for r in made] == [(ds_list(n)[0], True)]
        assert schedules.tick(night(n)) == []                    # the same night again
        assert jobs_by_ds() == Counter(ds_list(*range(1, n + 1)))
    with tx() as conn:
        uris = conn.execute(select(jobs.c.input_uri, jobs.c.output_uri).where(jobs.c.schedule == "nightly")).all()
    assert sorted(u.input_uri.rsplit("/in/", 1)[1] for u in uris) == [d + "/" for d in ds_list(1, 2, 3)]
    assert all(u.output_uri.endswith("/out/" + u.input_uri.rsplit("/in/", 1)[1]) for u in uris)

    # a restarted scheduler (a new process) at the same time adds nothing
    r = cli("scheduler", "--now", night(3).isoformat(), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
    before = {r["ds"]: r["job_id"] for r in schedules.backfill("nightly", date(2026, 1, 1), date(2026, 1, 3))}
    # backfill over dates already run, twice: the same jobs, nothing new
    for _ in range(2):
        r = cli("schedule", "backfill", "nightly", "--from", "2026-01-01", "--to", "2026-01-03", "--json")
        assert r.returncode == 0, r.stderr
        rows = json.loads(r.stdout)
        assert [(x["ds"], x["created"]) for x in rows] == [(d, False) for d in ds_list(1, 2, 3)]
        assert {x["ds"]: x["job_id"] for x in rows} == before
    assert jobs_by_ds() == Counter(ds_list(1, 2, 3))
    # a backfill reaching earlier dates makes only those
    made = schedules.backfill("nightly", date(2025, 12, 30), date(2026, 1, 2))
    assert [(x["ds"], x["created"]) for x in made] == [
        ("2025-12-30", True), ("2025-12-31", True), (ds_list(1)[0], False), (ds_list(2)[0], False)]
    assert sum(jobs_by_ds().values()) == 5 and set(jobs_by_ds().values()) == {1}
    listed = schedules.get("nightly", now=night(3))
    assert listed["runs"] == 5 and listed["last_ds"] == "2026-01-03"
    assert listed["next_fire"] == "2026-01-04T02:00:00+01:00"


def test_two_schedulers_at_once_make_one_job_per_date(tmp_path: Path, bi_home: Path, tiny_model_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    use_database(monkeypatch, fresh_postgres_db())
    from batchinf.bundles import import_bundle
    import_bundle(tiny_model_dir, "tiny", alias="prod")
    add(tmp_path)
    now = night(6).isoformat()        # five nights due, caught up at once by both
    procs = [subprocess.Popen([sys.executable, "-m", "batchinf.cli", "scheduler", "--now", now, "--json"],
                              env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    rows = [r for out, _ in outs for r in json.loads(out)]
    assert not [r for r in rows if r.get("error")], rows
    created = Counter(r["ds"] for r in rows if r["created"])
    assert created == Counter(ds_list(1, 2, 3, 4, 5, 6))          # each date created by exactly one
    assert jobs_by_ds() == Counter(ds_list(1, 2, 3, 4, 5, 6))
    with tx() as conn:
        runs = dict(conn.execute(select(schedule_runs.c.ds, schedule_runs.c.job_id)).all())
    assert {r["ds"]: r["job_id"] for r in rows} == runs            # both saw the same job per date


def test_catchup_or_only_the_latest(ledger: str, tiny_bundle: str, tmp_path: Path) -> None:
    add(tmp_path / "a", "catchup")
    add(tmp_path / "b", "latest", catchup=False)
    made = schedules.tick(night(4))
    assert sorted((r["schedule"], r["ds"]) for r in made) == sorted(
        [("catchup", d) for d in ds_list(1, 2, 3, 4)] + [("latest", ds_list(4)[0])])
    schedules.set_paused("latest", True)
    assert [r["schedule"] for r in schedules.tick(night(6))] == ["catchup", "catchup"]
    schedules.set_paused("latest", False)
    assert [(r["schedule"], r["ds"]) for r in schedules.tick(night(6))] == [("latest", ds_list(6)[0])]
    assert jobs_by_ds("latest") == Counter(ds_list(4, 6))


def test_a_job_without_its_run_row_is_found_not_duplicated(ledger: str, tiny_bundle: str, tmp_path: Path) -> None:
    add(tmp_path)
    job = schedules.tick(night(1))[0]["job_id"]
    with tx() as conn:      # as if the scheduler died between creating the job and recording the date
        conn.execute(delete(schedule_runs))
    again = schedules.tick(night(1))
    assert [(r["job_id"], r["created"]) for r in again] == [(job, False)]
    assert jobs_by_ds() == Counter(ds_list(1))
    with tx() as conn:
        assert conn.execute(select(schedule_runs.c.job_id)).scalars().all() == [job]


def test_weekday_cron_fires_only_on_its_days(ledger: str, tiny_bundle: str, tmp_path: Path) -> None:
    add(tmp_path, "weekdays", cron="30 1 * * mon-fri")        # 2026-01-03/04 are a weekend
    assert [r["ds"] for r in schedules.tick(night(6))] == ds_list(1, 2, 5, 6)
    assert [r["ds"] for r in schedules.backfill("weekdays", date(2026, 1, 3), date(2026, 1, 5))] == ds_list(5)


@pytest.mark.parametrize("change, error, needle", [
    (("{ds}/\"}\nshards", "x/\"}\nshards"), ManifestError, "output.uri of a schedule's template must contain {ds}"),
    (("shards:", "idempotency_key: fixed\nshards:"), ManifestError, "idempotency_key of a schedule's template"),
    (("shards:", "colour: blue\nshards:"), ManifestError, "unknown key 'colour'"),
])
def test_bad_templates_are_refused_with_the_fix(ledger: str, tiny_bundle: str, tmp_path: Path,
                                                change: tuple[str, str], error: type, needle: str) -> None:
    text = (TEMPLATE % {"root": tmp_path}).replace(*change)
    with pytest.raises(error, match=needle):
        schedules.add("bad", "0 2 * * *", text)


def test_bad_schedule_definitions(ledger: str, tiny_bundle: str, tmp_path: Path) -> None:
    text = TEMPLATE % {"root": tmp_path}
    with pytest.raises(CronError, match="needs 5 fields"):
        schedules.add("x", "0 2 * *", text)
    with pytest.raises(CronError, match="unknown time zone"):
        schedules.add("x", "0 2 * * *", text, tz="Nowhere/Land")
    schedules.add("x", "0 2 * * *", text)
    with pytest.raises(LedgerError, match="schedule 'x' exists"):
        schedules.add("x", "0 2 * * *", text)
    with pytest.raises(LedgerError, match="no schedule 'y'"):
        schedules.set_paused("y", True)
    with pytest.raises(ManifestError, match="before --from"):
        schedules.backfill("x", date(2026, 1, 2), date(2026, 1, 1))
