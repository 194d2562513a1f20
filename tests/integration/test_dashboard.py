"""The web dashboard at /ui/ in a real headless Chromium against a real `batchinf serve`: sign-in,
the jobs list, a job page whose numbers match the API (counts, tokens, the shard timeline's
attempts and outcomes, throughput, error rows and their filter), cancel from the page, bundles
with aliases, and the attempts/throughput/retry endpoints it reads. Screenshots are saved under
the directory the test prints."""

from __future__ import annotations

import os
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchinf.controller import drive
from tests.helpers.api_service import Service, start_service
from tests.helpers.browser import Browser
from tests.helpers.corpus import manifest, write_jsonl

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from start_service(tmp_path_factory.mktemp("ui"))


def _submit(svc: Service, name: str, n: int, max_records: int) -> str:
    src = svc.root / "in" / f"{name}.jsonl"
    write_jsonl(src, n, seed=zlib.crc32(name.encode()) % 1000)
    m = manifest(str(src), str(svc.root / "out" / name), name=name, shards={"max_records": max_records})
    with svc.client("acme") as c:
        r = c.post("/v1/jobs", json=m)
    assert r.status_code == 201, r.text
    return r.json()["job_id"]


def _drive(job_id: str, failpoints: str, workers: int) -> threading.Thread:
    os.environ["BATCHINF_FAILPOINTS"] = failpoints        # read by the worker processes it starts
    os.environ["BATCHINF_FAILPOINTS_SEED"] = "7"
    os.environ["BATCHINF_MAX_ATTEMPTS"] = "10"     # injected commit faults retry; they never fail the job
    t = threading.Thread(target=drive, args=(job_id,), kwargs={"workers": workers, "device": "cpu", "threads": 1},
                         daemon=True)
    t.start()
    return t


def _no_failpoints() -> None:
    os.environ.pop("BATCHINF_FAILPOINTS", None)
    os.environ.pop("BATCHINF_FAILPOINTS_SEED", None)
    os.environ.pop("BATCHINF_MAX_ATTEMPTS", None)


def _get(svc: Service, path: str) -> Any:
    with svc.client("acme") as c:
        r = c.get(path)
    assert r.status_code == 200, r.text
    return r.json()


def _all(svc: Service, path: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    while path:
        page = _get(svc, path)
        items += page["items"]
        path = page["next"]
    return items


def _num(v: int | None) -> str:
    return "–" if v is None else f"{v:,}"


@pytest.fixture(scope="module")
def shots() -> Path:
    # a stable place (pytest's own temp dirs are pruned): BATCHINF_TEST_ARTIFACTS, or the temp dir
    base = os.environ.get("BATCHINF_TEST_ARTIFACTS") or os.path.join(tempfile.gettempdir(), "batchinf-test-artifacts")
    d = Path(base) / "dashboard"
    d.mkdir(parents=True, exist_ok=True)
    print(f"\ndashboard screenshots: {d}")
    return d


def test_dashboard_in_a_real_browser(svc: Service, shots: Path) -> None:
    done = _submit(svc, "docs-embed", 600, 40)
    _drive(done, "execute.before_commit=0.1*raise;execute.after_write=sleep(0.05)", workers=2).join(240)
    _no_failpoints()
    st = _get(svc, f"/v1/jobs/{done}")
    assert st["status"] == "succeeded", st["error"]
    slow = _submit(svc, "backfill", 800, 20)
    slow_driver = _drive(slow, "execute.after_write=sleep(1)", workers=1)
    deadline = time.monotonic() + 60
    while not _get(svc, f"/v1/jobs/{slow}/attempts")["items"]:     # its worker has read the failpoint
        assert time.monotonic() < deadline
        time.sleep(0.2)
    _no_failpoints()

    # the endpoints the page reads
    attempts = _all(svc, f"/v1/jobs/{done}/attempts?limit=7")
    assert len({(a["shard_id"], a["number"]) for a in attempts}) == len(attempts)
    assert [a["started_at"] for a in attempts] == sorted(a["started_at"] for a in attempts)
    assert sum(a["outcome"] == "committed" for a in attempts) == st["shards"]["committed"]
    assert {a["outcome"] for a in attempts} <= {"committed", "retried"}
    assert len(attempts) == st["shards"]["committed"] + sum(a["outcome"] == "retried" for a in attempts)
    assert len({a["worker"] for a in attempts}) == 2
    series = _get(svc, f"/v1/jobs/{done}/throughput?points=30")
    assert len(series["points"]) == 30 and sum(p["records"] for p in series["points"]) == st["counts"]["records_done"]
    with svc.client("globex") as c:                       # another tenant's job: not found
        assert c.get(f"/v1/jobs/{done}/attempts").status_code == 404
        assert c.get(f"/v1/jobs/{done}/throughput").status_code == 404

    b = Browser(width=1280, height=900)
    try:
        b.goto(svc.url + "/ui/")
        b.wait("document.getElementById('signin')")
        b.js("document.getElementById('token').value = 'bi_not-a-token';"
             "document.getElementById('signin').requestSubmit()")
        assert "invalid or revoked token" in b.wait("document.getElementById('signin-error')?.textContent")
        b.js(f"document.getElementById('token').value = {svc.tokens['acme']!r};"
             "document.getElementById('signin').requestSubmit()")
        b.wait(f"document.querySelector('tr[data-job=\"{slow}\"]')")
        assert b.js("sessionStorage.getItem('batchinf.token')") == svc.tokens["acme"]
        listed = b.js("[...document.querySelectorAll('#jobs tr[data-job]')].map(r => [r.dataset.job, "
                      "r.querySelector('[data-field=status]').textContent])")
        assert dict(listed)[done] == "succeeded" and {done, slow} <= set(dict(listed))
        b.screenshot(shots / "jobs.png")

        # the finished job's page: numbers as the API has them
        b.goto(f"{svc.url}/ui/#/jobs/{done}")
        b.wait(f"document.body.dataset.loaded === '#/jobs/{done}' && document.getElementById('timeline')")
        field = "document.querySelector('[data-field={}]').textContent"
        c, t = st["counts"], st["tokens"]
        for name, want in (("records_total", _num(c["records_total"])), ("records_done", _num(c["records_done"])),
                           ("records_succeeded", _num(c["records_succeeded"])),
                           ("records_failed", _num(c["records_failed"])), ("tokens_input", _num(t["input"])),
                           ("tokens_padded", _num(t["padded"])),
                           ("padding_efficiency", f"{t['padding_efficiency'] * 100:.1f}%"),
                           ("shards", f"{st['shards']['done']} / {st['shards']['total']} done"),
                           ("status", "succeeded")):
            assert b.js(field.format(name)) == want, name
        assert b.js(field.format("cost")) == f"{st['cost']['total']:,.4f}"
        bars = b.js("[...document.querySelectorAll('#timeline rect.attempt')].map(r => r.dataset.outcome)")
        assert sorted(bars) == sorted(a["outcome"] for a in attempts)
        assert b.js("[...document.querySelectorAll('#throughput rect')].reduce((s, r) => s + "
                    "Number(r.dataset.records), 0)") == c["records_done"]
        rows = b.js("[...document.querySelectorAll('#errors tbody tr[data-code]')].map(r => r.dataset.code)")
        assert len(rows) == st["errors"]["records"] == 6
        b.screenshot(shots / "job.png")
        b.js("{ const sel = document.getElementById('error-filter'); sel.value = 'malformed_json';"
             " sel.dispatchEvent(new Event('change')); }")
        b.wait("(() => { const r = [...document.querySelectorAll('#errors tbody tr[data-code]')];"
               " return r.length === 1 && r[0].dataset.code === 'malformed_json'; })()")

        # cancel from the page of the running job
        b.goto(f"{svc.url}/ui/#/jobs/{slow}")
        b.wait(f"document.body.dataset.loaded === '#/jobs/{slow}' && document.getElementById('cancel')")
        b.wait("document.querySelector('#timeline rect.attempt')", timeout=60)
        b.screenshot(shots / "running.png")
        b.js("document.getElementById('cancel').click()")
        assert _get(svc, f"/v1/jobs/{slow}")["status"] == "running", "one click only arms the button"
        b.js("document.getElementById('cancel').click()")
        b.wait("document.getElementById('job-status').textContent === 'cancelled'", timeout=90)
        slow_driver.join(60)
        assert _get(svc, f"/v1/jobs/{slow}")["status"] == "cancelled"
        assert not b.js("document.getElementById('cancel')")

        # retry what did not finish, from the page; the new job links back
        b.js("document.getElementById('retry').click()")
        retry_id = b.wait("location.hash.startsWith('#/jobs/') && !location.hash.endsWith("
                          f"'{slow}') && location.hash.slice(7)")
        b.wait(f"document.getElementById('retry-of')?.textContent === '{slow}'")
        assert _get(svc, f"/v1/jobs/{retry_id}")["retry_of"] == slow
        assert _get(svc, f"/v1/jobs/{slow}")["retries"] == [retry_id]
        with svc.client("acme") as cl:
            assert cl.post(f"/v1/jobs/{retry_id}/retry", json={"not_done": True}).status_code == 409  # active
        with svc.client("acme") as cl:
            cl.post(f"/v1/jobs/{retry_id}/cancel")

        b.goto(f"{svc.url}/ui/#/bundles")
        b.wait("document.body.dataset.loaded === '#/bundles'")
        assert b.js("document.querySelector('#bundles [data-field=aliases]').textContent") == "tiny@prod"
        b.screenshot(shots / "bundles.png")
    finally:
        b.close()
