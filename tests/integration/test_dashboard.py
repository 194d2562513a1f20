"""The web dashboard at /ui/ in a real headless Chromium against a real `batchinf serve`: sign-in,
the jobs list (filters, paging), a job page whose numbers match the API (counts, tokens, the shard
timeline's attempts and outcomes, throughput on the same time axis, error codes with counts, error
rows and their filter), a running job's page updating in place and its polling stopping, cancel
and retry from the page, bundles with aliases, and the attempts/throughput/retry endpoints it
reads. Every view is checked for horizontal overflow at 1280x800 and 390x844 with a job whose
name and output URI are very long. Screenshots are saved under the directory the test prints."""

from __future__ import annotations

import json
import os
import re
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


# a name and an output URI with no break opportunities, longer than any window is wide
LONG_DIRS = ("o" * 90, "u" * 90, "t" * 90)
W, LEFT, RIGHT = 1100, 170, 16     # the charts' user units (app.js)
TICK = r"^(\d+h( \d+m)?|\d+m( \d+s)?|\d+s)$"


def _long_name(key: str) -> str:
    return f"{key}-" + "x" * 180     # names are stored in 200 characters


def _submit(svc: Service, key: str, n: int, max_records: int, name: str | None = None, long_uri: bool = False) -> str:
    src = svc.root / "in" / f"{key}.jsonl"
    write_jsonl(src, n, seed=zlib.crc32(key.encode()) % 1000)
    out = svc.root.joinpath("out", *LONG_DIRS, key) if long_uri else svc.root / "out" / key
    m = manifest(str(src), str(out), name=name or key, shards={"max_records": max_records})
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


def _sign_in(b: Browser, svc: Service) -> None:
    b.goto(svc.url + "/ui/")
    b.wait("document.getElementById('signin')")
    b.js(f"document.getElementById('token').value = {svc.tokens['acme']!r};"
         "document.getElementById('signin').requestSubmit()")
    b.wait("document.body.dataset.loaded")


def _open(b: Browser, svc: Service, hash_: str, ready: str = "true") -> None:
    b.goto(f"{svc.url}/ui/{hash_}")
    b.wait(f"document.body.dataset.loaded === {hash_!r} && ({ready})")


def _fits(b: Browser, view: str, shots: Path, shot: str) -> None:
    """No horizontal scrolling: every long value wraps, is cut with its whole text in the title,
    or scrolls inside its own box."""
    b.screenshot(shots / shot)
    assert b.overflow() == 0, f"{view} at {b.width}px is {b.overflow()} px too wide ({shot})"


def _axis(b: Browser) -> dict[str, Any]:
    return b.js("""(() => {
      const one = (id) => { const svg = document.getElementById(id);
        return { t0: svg.dataset.t0, t1: svg.dataset.t1, ticks: [...svg.querySelectorAll('text.tick')].map(
          t => { const r = t.getBBox(); return [t.textContent, t.dataset.x, r.x, r.x + r.width]; }),
          rects: [...svg.querySelectorAll('rect')].map(r => [r.x.baseVal.value, r.x.baseVal.value + r.width.baseVal.value]) }; };
      return { timeline: one('timeline'), throughput: one('throughput') }; })()""")


def _check_axis(b: Browser) -> None:
    ax = _axis(b)
    tl, tp = ax["timeline"], ax["throughput"]
    assert (tl["t0"], tl["t1"]) == (tp["t0"], tp["t1"]), "one time span for both charts"
    assert [t[:2] for t in tl["ticks"]] == [t[:2] for t in tp["ticks"]], "the same ticks at the same x"
    labels = [t[0] for t in tl["ticks"]]
    assert len(labels) >= 3 and labels[0] == "0s" and len(set(labels)) == len(labels), labels
    assert all(re.match(TICK, label) for label in labels), labels
    xs = [float(t[1]) for t in tl["ticks"]]
    assert xs == sorted(xs) and xs[0] == LEFT and xs[-1] <= W - RIGHT
    for chart in (tl, tp):
        assert all(0 <= t[2] and t[3] <= W for t in chart["ticks"]), f"a tick label is cut: {chart['ticks']}"
    assert all(LEFT <= r[0] and r[1] <= W - RIGHT + 0.01 for r in tp["rects"])
    assert all(LEFT - 0.01 <= r[0] and r[1] <= W - RIGHT + 2.01 for r in tl["rects"])


def _attempts_title(b: Browser) -> str:
    return b.js("document.getElementById('attempt-count').textContent")


def _plural_ok(b: Browser) -> None:
    n = b.js("document.querySelectorAll('#timeline rect.attempt').length")
    assert _attempts_title(b) == f"({n:,} attempt{'' if n == 1 else 's'}, one lane per worker)"


def _mobile_pass(svc: Service, shots: Path, running: str, done: str) -> None:
    """The same views at 390x844."""
    m = Browser(width=390, height=844)
    try:
        _sign_in(m, svc)
        _open(m, svc, f"#/jobs/{running}", "document.getElementById('timeline')")
        _fits(m, "running job page", shots, "running-mobile.png")
        _open(m, svc, "#/", f"document.querySelector('tr[data-job=\"{done}\"]')")
        _fits(m, "jobs list", shots, "jobs-mobile.png")
        _open(m, svc, f"#/jobs/{done}", "document.getElementById('timeline')")
        _fits(m, "finished job page", shots, "job-mobile.png")
        _open(m, svc, "#/bundles")
        _fits(m, "bundles", shots, "bundles-mobile.png")
    finally:
        m.close()


def _quiet(b: Browser, seconds: float = 4.5) -> None:
    """No poll renders for `seconds` (two poll intervals and then some)."""
    before = b.js("document.body.dataset.polls")
    time.sleep(seconds)
    assert b.js("document.body.dataset.polls") == before, "still polling"


def test_dashboard_in_a_real_browser(svc: Service, shots: Path) -> None:
    done = _submit(svc, "docs-embed", 600, 40, name=_long_name("docs-embed"), long_uri=True)
    _drive(done, "execute.before_commit=0.1*raise;execute.after_write=sleep(0.05)", workers=2).join(240)
    _no_failpoints()
    st = _get(svc, f"/v1/jobs/{done}")
    assert st["status"] == "succeeded", st["error"]
    assert len(st["output_uri"]) >= 280 and len(st["name"]) > 180
    slow = _submit(svc, "backfill", 800, 20, name=_long_name("backfill"), long_uri=True)
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

    b = Browser(width=1280, height=800)
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
        assert b.js(f"document.querySelector('tr[data-job=\"{done}\"] td.name .clip').title") == st["name"]
        _fits(b, "jobs list", shots, "jobs.png")

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
        assert b.js("document.querySelector('[data-field=output_uri] .clip').title") == st["output_uri"]
        assert b.js("document.querySelector('#job-head .clip').title") == st["name"]
        inside = ("(() => { const bar = document.querySelector('.card [data-field=progress]').getBoundingClientRect();"
                  " const card = document.querySelector('.card [data-field=progress]').closest('.card')"
                  ".getBoundingClientRect(); return bar.left >= card.left && bar.right <= card.right; })()")
        assert b.js(inside), "the progress bar stays inside its card"
        _plural_ok(b)
        _check_axis(b)
        by_code = b.js("Object.fromEntries([...document.querySelectorAll('#error-codes tbody tr')].map(r => "
                       "[r.dataset.code, Number(r.querySelector('[data-count]').dataset.count)]))")
        assert by_code == st["errors"]["by_code"] and sum(by_code.values()) == 6
        _fits(b, "finished job page", shots, "job.png")
        b.js("document.querySelector('#error-codes tr[data-code=malformed_json] button').click()")
        b.wait("(() => { const r = [...document.querySelectorAll('#errors tbody tr[data-code]')];"
               " return r.length === 1 && r[0].dataset.code === 'malformed_json'"
               " && document.getElementById('error-filter').value === 'malformed_json'; })()")
        b.js("{ const sel = document.getElementById('error-filter'); sel.value = '';"
             " sel.dispatchEvent(new Event('change')); }")
        b.wait("document.querySelectorAll('#errors tbody tr[data-code]').length === 6")
        _quiet(b)       # a finished job's page does not poll
        b.js("{ const sel = document.getElementById('error-filter'); sel.value = 'malformed_json';"
             " sel.dispatchEvent(new Event('change')); }")
        b.wait("(() => { const r = [...document.querySelectorAll('#errors tbody tr[data-code]')];"
               " return r.length === 1 && r[0].dataset.code === 'malformed_json'; })()")

        # cancel from the page of the running job
        b.goto(f"{svc.url}/ui/#/jobs/{slow}")
        b.wait(f"document.body.dataset.loaded === '#/jobs/{slow}' && document.getElementById('cancel')")
        b.wait("document.querySelector('#timeline rect.attempt')", timeout=60)
        _fits(b, "running job page", shots, "running.png")
        _plural_ok(b)

        # it updates in place: the same document, new numbers, bars and ticks
        b.js("window.sameDocument = 'yes'")
        seen = b.js("[document.querySelector('[data-field=records_done]').textContent, document.body.dataset.polls,"
                    " document.querySelectorAll('#timeline rect.attempt').length]")
        b.wait(f"document.querySelector('[data-field=records_done]').textContent !== {seen[0]!r}"
               f" && document.querySelectorAll('#timeline rect.attempt').length > {seen[2]}", timeout=30)
        assert b.js("window.sameDocument") == "yes" and int(b.js("document.body.dataset.polls")) > int(seen[1])
        assert b.js("document.body.dataset.live") == "1"
        _plural_ok(b)
        _check_axis(b)
        b.js("document.getElementById('cancel').click()")
        b.wait("document.getElementById('cancel').textContent.startsWith('Click again')")
        prev = b.js("document.body.dataset.polls")       # the armed button survives the next poll
        b.wait(f"document.body.dataset.polls !== {prev!r}")
        assert b.js("document.getElementById('cancel').textContent").startswith("Click again")
        _mobile_pass(svc, shots, slow, done)
        assert _get(svc, f"/v1/jobs/{slow}")["status"] == "running", "one click only arms the button"
        b.js("document.getElementById('cancel').click()")
        b.wait("document.getElementById('job-status').textContent === 'cancelled'", timeout=90)
        slow_driver.join(60)
        assert _get(svc, f"/v1/jobs/{slow}")["status"] == "cancelled"
        assert not b.js("document.getElementById('cancel')")
        assert b.wait("document.body.dataset.live === '0' && window.sameDocument") == "yes"
        _quiet(b)       # terminal: polling stopped
        colour = "getComputedStyle(document.querySelector('{}')).backgroundColor"
        assert b.js(colour.format("#job-status")) == "rgb(213, 239, 239)"      # cancelled's own colour
        assert b.js(colour.format("[data-field=progress]")) != b.js(
            "getComputedStyle(document.body).backgroundColor")
        assert b.js("document.querySelector('[data-field=progress]').classList.contains('cancelled')")
        assert b.js("document.querySelectorAll('#timeline line.cancelled').length") == 1
        _check_axis(b)
        _fits(b, "cancelled job page", shots, "cancelled.png")

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

        b.js("location.hash = '#/bundles'")          # from an active job's page: its polling stops
        b.wait("document.body.dataset.loaded === '#/bundles'")
        assert b.js("document.querySelector('#bundles [data-field=aliases]').textContent") == "tiny@prod"
        _quiet(b)
        assert b.js("document.body.dataset.loaded") == "#/bundles" and b.js("window.sameDocument") == "yes"
        _fits(b, "bundles", shots, "bundles.png")
    finally:
        b.close()


def test_job_list_filters_and_paging(svc: Service, shots: Path) -> None:
    made = [_submit(svc, f"filtered-{i}", 3, 10, name=f"Filtered-{i}-{'odd' if i % 2 else 'even'}")
            for i in range(5)]
    b = Browser(width=1280, height=800)
    rows = "[...document.querySelectorAll('#jobs tr[data-job]')].map(r => r.dataset.job)"
    try:
        _sign_in(b, svc)
        _open(b, svc, "#/", "document.getElementById('filters')")
        b.js("document.getElementById('filter-name').value = 'ODD';"
             "document.getElementById('filters').requestSubmit()")
        b.wait("document.body.dataset.loaded === '#/?name=ODD'")
        assert b.js(rows) == [made[3], made[1]]             # a substring, any case, newest first
        assert b.js("document.getElementById('filter-name').value") == "ODD"

        _open(b, svc, "#/?name=filtered-&limit=2")
        pages = [b.js(rows)]
        assert b.js("document.getElementById('prev').disabled")
        while not b.js("document.getElementById('next').disabled"):
            before = b.js("document.body.dataset.loaded")
            b.js("document.getElementById('next').click()")
            b.wait(f"document.body.dataset.loaded !== {before!r}")
            pages.append(b.js(rows))
        assert pages == [made[4:2:-1], made[2:0:-1], made[:1]]
        assert b.js("document.getElementById('page-info').textContent") == "page 3 · 1 job"
        b.js("document.getElementById('prev').click()")
        want = json.dumps(made[2:0:-1], separators=(",", ":"))      # as JSON.stringify writes it
        b.wait(f"JSON.stringify({rows}) === {want!r}")
        assert b.js("document.getElementById('page-info').textContent") == "page 2 · 2 jobs"
        _fits(b, "jobs list, filtered and paged", shots, "jobs-paged.png")

        b.js("{ const s = document.getElementById('filter-status'); s.value = 'succeeded';"
             " document.getElementById('filter-name').value = ''; document.getElementById('filters').requestSubmit(); }")
        b.wait("document.body.dataset.loaded === '#/?status=succeeded&limit=2'")
        shown = b.js("[...document.querySelectorAll('#jobs tr[data-job] [data-field=status]')].map(e => e.textContent)")
        api_ids = [j["job_id"] for j in _get(svc, "/v1/jobs?status=succeeded&limit=2")["items"]]
        assert b.js(rows) == api_ids and set(shown) <= {"succeeded"}
        assert not set(made) & set(b.js(rows))
    finally:
        b.close()


def test_an_image_job_page_shows_its_denoising_steps(svc: Service, shots: Path,
                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    """A generate_image job's page shows steps done of planned (denoising steps x images), the
    numbers of GET /v1/jobs/{id}; an embed job's page has no such line."""
    from batchinf.bundles import import_bundle
    from tests.helpers.tiny_diffusion import cached_pipeline

    import_bundle(cached_pipeline(tmp_path_factory.mktemp("tiny-diffusion"), "pndm"), "sd", alias="prod")
    src = svc.root / "in" / "prompts.jsonl"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "a cat", "width": 32, "height": 32, "seed": i,
                                       "num_images": 1 + i % 2}) + "\n" for i in range(3)))
    m = {"name": "images", "task": "generate_image", "bundle": "sd@prod", "input": {"uri": str(src), "format": "jsonl"},
         "output": {"uri": str(svc.root / "out" / "images")}, "options": {"steps": 2}}
    with svc.client("acme") as c:
        r = c.post("/v1/jobs", json=m)
    assert r.status_code == 201, r.text
    job_id = r.json()["job_id"]
    _drive(job_id, "", 1).join(300)
    _no_failpoints()
    progress = _get(svc, f"/v1/jobs/{job_id}")["progress"]
    planned = 2 * (1 + 2 + 1)
    assert (progress["steps_done"], progress["steps_planned"]) == (planned, planned)
    embed = _submit(svc, "no-steps", 3, 10)
    b = Browser(width=1280, height=800)
    try:
        _sign_in(b, svc)
        _open(b, svc, f"#/jobs/{job_id}", "document.querySelector('[data-field=steps]')")
        assert b.js("document.querySelector('[data-field=steps]').textContent") == f"{planned} / {planned}"
        _fits(b, "image job page", shots, "image-job.png")
        _open(b, svc, f"#/jobs/{embed}", "document.querySelector('[data-field=records_done]')")
        assert b.js("document.querySelector('[data-field=steps]')") is None
    finally:
        b.close()
