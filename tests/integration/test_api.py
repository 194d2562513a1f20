"""The REST API against a real `batchinf serve` process and PostgreSQL: every endpoint, pagination,
the status fields, cancel, tenant isolation, tokens, metrics, and a schema-driven fuzz."""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from batchinf.ledger.db import tx
from batchinf.ledger.tables import attempts, shards
from tests.helpers.api_service import PRICE_PER_WORKER_HOUR, Service, cli, start_service
from tests.helpers.corpus import BAD_LINES, manifest, write_jsonl

pytestmark = pytest.mark.integration
MISSING = "job-0123456789abcdef"


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from start_service(tmp_path_factory.mktemp("api"))


def _manifest(svc: Service, name: str, n: int = 200, max_records: int = 50, **extra: Any) -> dict[str, Any]:
    src = svc.root / "in" / f"{name}.jsonl"
    write_jsonl(src, n, seed=zlib.crc32(name.encode()) % 1000)
    return manifest(str(src), str(svc.root / "out" / name), name=name, shards={"max_records": max_records},
                    **extra)


def _submit(svc: Service, tenant: str, m: dict[str, Any], expect: int = 201) -> dict[str, Any]:
    with svc.client(tenant) as c:
        r = c.post("/v1/jobs", json=m)
    assert r.status_code == expect, r.text
    return r.json()


def _wait(svc: Service, tenant: str, job_id: str, until: Any, timeout: float = 150) -> list[dict[str, Any]]:
    """Poll GET /v1/jobs/{id} until `until(status)`; returns every snapshot seen."""
    seen = []
    deadline = time.monotonic() + timeout
    with svc.client(tenant) as c:
        while time.monotonic() < deadline:
            r = c.get(f"/v1/jobs/{job_id}")
            assert r.status_code == 200, r.text
            seen.append(r.json())
            if until(seen[-1]):
                return seen
            time.sleep(0.1)
    raise AssertionError(f"job {job_id} stuck at {seen[-1]}\n{svc.log.read_text()[-2000:]}")


def _pages(c: httpx.Client, path: str) -> list[dict[str, Any]]:
    """Follow `next` links to the end; returns every page."""
    pages = []
    while path:
        r = c.get(path)
        assert r.status_code == 200, r.text
        pages.append(r.json())
        path = pages[-1]["next"]
        assert (path is None) == (pages[-1]["next_cursor"] is None)
    return pages


def _metrics(svc: Service) -> dict[tuple[str, frozenset], float]:
    r = httpx.get(svc.url + "/metrics", headers={"Authorization": f"Bearer {svc.metrics_token}"})
    assert r.status_code == 200, r.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def _sample(samples: dict, name: str, **labels: str) -> float:
    hits = [v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= lab]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


PROTECTED = [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", f"/v1/jobs/{MISSING}"),
             ("GET", f"/v1/jobs/{MISSING}/shards"), ("GET", f"/v1/jobs/{MISSING}/errors"),
             ("POST", f"/v1/jobs/{MISSING}/cancel"), ("GET", "/v1/bundles")]


@pytest.mark.slow
def test_no_or_bad_token_is_401_everywhere(svc: Service) -> None:
    from batchinf.tenants import create_token, revoke_token

    revoked = create_token("acme")
    revoke_token(revoked["id"])
    for token in (None, "bi_not-a-real-token", revoked["token"]):
        with svc.client(token=token) as c:
            for method, path in PROTECTED:
                r = c.request(method, path, json={} if method == "POST" else None)
                assert r.status_code == 401, (method, path, r.text)
                assert r.json()["error"] == "unauthorized" and "batchinf token create" in r.json()["message"]
                assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(svc.url + "/healthz").json() == {"status": "ok", "ledger": "ok"}
    assert httpx.get(svc.url + "/metrics").status_code == 401           # BATCHINF_METRICS_TOKEN is set
    assert httpx.get(svc.url + "/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_submit_is_idempotent_and_bad_manifests_name_the_fix(svc: Service) -> None:
    m = _manifest(svc, "idem", n=20, idempotency_key="nightly-2026-11-28")
    first = _submit(svc, "acme", m, 201)
    again = _submit(svc, "acme", m, 200)
    assert again["job_id"] == first["job_id"] and first["status"] == "submitted"
    with svc.client("acme") as c:            # the same manifest as YAML text
        r = c.post("/v1/jobs", content=yaml.safe_dump(m), headers={"Content-Type": "application/yaml"})
    assert r.status_code == 200 and r.json()["job_id"] == first["job_id"]
    with svc.client("globex") as c:          # keys are per tenant, outputs are not shared
        r = c.post("/v1/jobs", json=m)
    assert r.status_code == 422 and "overlaps a prefix that another job reads or writes" in r.json()["message"]
    assert first["job_id"] not in r.text
    other = _submit(svc, "globex", m | {"output": {"uri": str(svc.root / "out" / "idem-globex")}}, 201)
    assert other["job_id"] != first["job_id"] and other["tenant"] == "globex"

    m = {k: v for k, v in m.items() if k != "idempotency_key"}   # a known key returns its job first
    bad = [({k: v for k, v in m.items() if k != "bundle"}, 422, "missing required key 'bundle'"),
           ({**m, "colour": "blue"}, 422, "unknown key 'colour'"),
           ({**m, "bundle": "nope@prod"}, 422, "bundle 'nope@prod' not found; import it"),
           ({**m, "shards": {"max_records": -1}}, 422, "shards.max_records must be a positive integer"),
           ({**m, "deadline": "soon"}, 422, "deadline: 'soon' is not a positive duration"),
           ([1, 2], 422, "must be a mapping")]
    with svc.client("acme") as c:
        for body, code, needle in bad:
            r = c.post("/v1/jobs", json=body)
            assert r.status_code == code and needle in r.json()["message"], r.text
            assert r.json()["error"] == "invalid_manifest"
        r = c.post("/v1/jobs", content=b"name: [unclosed", headers={"Content-Type": "application/yaml"})
        assert r.status_code == 400 and "not valid YAML" in r.json()["message"]
        r = c.post("/v1/jobs", content=b"{nope", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["message"]
        r = c.get("/v1/jobs", params={"limit": 0})
        assert r.status_code == 422 and r.json()["message"].startswith("query.limit")
        r = c.get("/v1/jobs", params={"cursor": "bm9wZQ"})
        assert r.status_code == 400 and "cursor 'bm9wZQ' is not valid" in r.json()["message"]
        from batchinf.ledger.status import encode_cursor
        for crafted in (encode_cursor([1], [2]), encode_cursor("a", "b"), encode_cursor(1.0, "x", 3)):
            assert c.get("/v1/jobs", params={"cursor": crafted}).status_code == 400
            assert c.get(f"/v1/jobs/{first['job_id']}/errors", params={"cursor": crafted}).status_code == 400
        assert "Traceback" not in r.text


def test_list_pagination_and_filters(svc: Service, tmp_path: Path) -> None:
    made = [_submit(svc, "pager", _manifest(svc, f"page-{i}", n=5) | {"name": f"p{i % 2}"})["job_id"]
            for i in range(5)]
    with svc.client("pager") as c:
        pages = _pages(c, "/v1/jobs?limit=2")
        assert [len(p["items"]) for p in pages] == [2, 2, 1]
        ids = [j["job_id"] for p in pages for j in p["items"]]
        assert ids == made[::-1]                                   # newest first, no repeats
        assert all(j["tenant"] == "pager" for p in pages for j in p["items"])
        odd = _pages(c, "/v1/jobs?limit=1&name=p1")
        assert [j["job_id"] for p in odd for j in p["items"]] == [made[3], made[1]]
        assert all("name=p1" in p["next"] for p in odd[:-1])       # filters survive in next links
        part = _pages(c, "/v1/jobs?limit=1&name_contains=P1")         # a substring, any case
        assert [j["job_id"] for p in part for j in p["items"]] == [made[3], made[1]]
        assert all("name_contains=P1" in p["next"] for p in part[:-1])
        assert len(c.get("/v1/jobs", params={"name_contains": "p"}).json()["items"]) == 5
        assert c.get("/v1/jobs", params={"name_contains": "%"}).json()["items"] == []   # no LIKE wildcards
        assert len(c.get("/v1/jobs", params={"status": "submitted"}).json()["items"]) == 5
        assert c.get("/v1/jobs", params={"status": "succeeded"}).json()["items"] == []
        assert c.get("/v1/jobs", params={"status": "bogus"}).status_code == 422

    template = tmp_path / "t.yaml"
    template.write_text(yaml.safe_dump(_manifest(svc, "sched", n=5)
                                       | {"output": {"uri": str(svc.root / "out" / "sched-{ds}")}}))
    cli("schedule", "add", "pager-nightly", str(template), "--cron", "0 2 * * *", "--tenant", "pager")
    cli("schedule", "backfill", "pager-nightly", "--from", "2026-01-01", "--to", "2026-01-02")
    with svc.client("pager") as c:
        by_schedule = c.get("/v1/jobs", params={"schedule": "pager-nightly"}).json()["items"]
    assert sorted(j["idempotency_key"] for j in by_schedule) == [
        "schedule:pager-nightly:2026-01-01", "schedule:pager-nightly:2026-01-02"]


def test_tenant_isolation_on_every_endpoint_with_an_id(svc: Service) -> None:
    job = _submit(svc, "acme", _manifest(svc, "isolated", n=5))["job_id"]
    with svc.client("globex") as c:
        for suffix, method in (("", "GET"), ("/shards", "GET"), ("/errors", "GET"), ("/cancel", "POST"),
                               ("/attempts", "GET"), ("/throughput", "GET")):
            theirs = c.request(method, f"/v1/jobs/{job}{suffix}")
            missing = c.request(method, f"/v1/jobs/{MISSING}{suffix}")
            assert theirs.status_code == missing.status_code == 404
            # indistinguishable: the same body apart from the id the caller sent
            assert theirs.json() == {"error": "not_found", "message": f"no job {job!r}"}
            assert missing.json() == {"error": "not_found", "message": f"no job {MISSING!r}"}
        assert job not in {j["job_id"] for p in _pages(c, "/v1/jobs?limit=100") for j in p["items"]}
    with svc.client("acme") as c:
        r = c.get(f"/v1/jobs/{job}")
        assert r.status_code == 200 and r.json()["status"] == "submitted"   # globex's cancel did nothing

    # jobs submitted from the CLI belong to a tenant too
    path = svc.root / "cli-job.json"
    path.write_text(json.dumps(_manifest(svc, "from-cli", n=5)))
    made = json.loads(cli("submit", str(path), "--tenant", "globex", "--json").stdout)
    assert made["tenant"] == "globex"
    with svc.client("globex") as c:
        assert c.get(f"/v1/jobs/{made['job_id']}").json() == made
    with svc.client("acme") as c:
        assert c.get(f"/v1/jobs/{made['job_id']}").status_code == 404
    r = cli("status", made["job_id"], "--tenant", "acme", check=False)
    assert r.returncode == 2 and f"no job {made['job_id']!r}" in r.stderr


@pytest.mark.slow
def test_job_lifecycle_through_the_api(svc: Service, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The issue's "done when": with tokens for two tenants (made by `batchinf token create`),
    submit as one, watch progress to succeeded, be refused as the other, scrape /metrics, and
    backfill a nightly schedule over three dates: three jobs, twice in a row. Also reads shards
    and errors, and compares the status with the CLI's."""
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.after_write=sleep(0.3)")   # progress is visible
    m = _manifest(svc, "life", n=300, max_records=50)
    job = _submit(svc, "acme", m)
    assert job["bundle_digest"] == svc.bundle_digest and job["input_uri"].endswith("life.jsonl")
    svc.drive(job["job_id"])
    seen = _wait(svc, "acme", job["job_id"], lambda s: s["status"] in ("succeeded", "failed"))
    final = seen[-1]
    assert final["status"] == "succeeded", final
    midway = [s for s in seen if s["status"] == "running" and 0 < s["counts"]["records_done"] < 306]
    assert midway, "progress should be visible while the job runs"
    assert any(s["progress"]["eta_seconds"] is not None for s in midway)
    assert any(s["progress"]["records_per_second"] for s in midway)

    sh, c, tok = final["shards"], final["counts"], final["tokens"]
    assert sh["done"] == sh["committed"] == sh["total"] >= 7 and sh["pending"] == sh["running"] == 0
    assert c == {"records_total": 306, "records_done": 306, "records_succeeded": 300, "records_failed": 6}
    assert final["errors"] == {"records": 6, "by_code": {code: 1 for _, code in BAD_LINES}}
    assert 0 < tok["real"] <= tok["padded"] and tok["padding_efficiency"] == pytest.approx(tok["real"] / tok["padded"])
    assert final["progress"]["eta_seconds"] is None and final["progress"]["records_per_second"] > 0
    assert final["progress"]["tokens_per_second"] > 0
    assert final["created_at"] <= final["started_at"] <= final["finished_at"]
    with tx() as conn:   # worker-seconds: the sum of every attempt's duration, from the ledger
        spent = conn.execute(select(func.sum(attempts.c.finished_at - attempts.c.started_at))
                             .join(shards, shards.c.id == attempts.c.shard_id)
                             .where(shards.c.job_id == job["job_id"])).scalar()
    assert final["worker_seconds"] == pytest.approx(spent) and spent > 7 * 0.3
    price = float(PRICE_PER_WORKER_HOUR)
    assert final["cost"] == pytest.approx({"price_per_worker_hour": price, "total": spent / 3600 * price,
                                           "per_1000_records": spent / 3600 * price / 306 * 1000})

    # the CLI prints the very same status model
    assert json.loads(cli("status", job["job_id"], "--json").stdout) == final
    listed = json.loads(cli("jobs", "--tenant", "acme", "--name", "life", "--json").stdout)
    assert listed == [final]

    with svc.client("acme") as cl:
        shard_pages = _pages(cl, f"/v1/jobs/{job['job_id']}/shards?limit=3")
        rows = [s for p in shard_pages for s in p["items"]]
        assert len(rows) == sh["total"] and len({s["id"] for s in rows}) == len(rows)
        assert {s["status"] for s in rows} == {"committed"} and sum(s["num_records"] for s in rows) == 306
        assert [(s["bucket"], s["ordinal"]) for s in rows] == sorted((s["bucket"], s["ordinal"]) for s in rows)
        error_pages = _pages(cl, f"/v1/jobs/{job['job_id']}/errors?limit=4")
        assert [len(p["items"]) for p in error_pages] == [4, 2]
        errs = [e for p in error_pages for e in p["items"]]
        assert sorted(e["error"] for e in errs) == sorted(code for _, code in BAD_LINES)
        assert all(e["source"].endswith("life.jsonl") and e["message"] for e in errs)
        only = cl.get(f"/v1/jobs/{job['job_id']}/errors", params={"code": "missing_id"}).json()["items"]
        assert len(only) == 1 and only[0]["record_id"] is None
        r = cl.post(f"/v1/jobs/{job['job_id']}/cancel")
        assert r.status_code == 409 and r.json()["error"] == "conflict" and "already succeeded" in r.json()["message"]

    with svc.client("globex") as other:
        r = other.get(f"/v1/jobs/{job['job_id']}")
        assert r.status_code == 404 and r.json()["error"] == "not_found"
        assert job["job_id"] not in {j["job_id"] for j in other.get("/v1/jobs").json()["items"]}

    samples = _metrics(svc)
    lab = {"job_id": job["job_id"]}
    bundle = {"bundle_id": svc.bundle_digest.removeprefix("sha256:")[:12]}
    assert _sample(samples, "batchinf_job_info", tenant="acme", bundle_digest=svc.bundle_digest, **lab) == 1
    assert _sample(samples, "batchinf_job_records", outcome="succeeded", **lab) == 300
    assert _sample(samples, "batchinf_job_records", outcome="failed", **lab) == 6
    assert _sample(samples, "batchinf_job_records_planned", **lab) == 306
    assert _sample(samples, "batchinf_job_shards", status="committed", **lab) == sh["total"]
    assert _sample(samples, "batchinf_job_shards", status="failed", **lab) == 0      # zeros are present
    assert _sample(samples, "batchinf_job_queue_depth", **lab) == 0
    assert _sample(samples, "batchinf_job_padding_efficiency_ratio", **lab) == pytest.approx(tok["padding_efficiency"])
    assert _sample(samples, "batchinf_job_padded_tokens", **lab) == tok["padded"]
    assert _sample(samples, "batchinf_bundle_records_total", outcome="succeeded", **bundle) >= 300
    assert _sample(samples, "batchinf_bundle_shard_seconds_count", **bundle) >= sh["total"]
    assert _sample(samples, "batchinf_jobs", tenant="acme", status="succeeded") >= 1
    assert _sample(samples, "batchinf_attempts_total", outcome="committed") >= sh["total"]
    for name in ("batchinf_leases_expired_total", "batchinf_retries_total", "batchinf_quarantined_shards_total",
                 "batchinf_queue_depth", "batchinf_attempts_running"):
        assert _sample(samples, name) >= 0
    assert _sample(samples, "batchinf_api_requests_total", method="GET", route="/v1/jobs/{job_id}", status="200") >= len(seen)

    template = tmp_path / "nightly.yaml"
    template.write_text(yaml.safe_dump(m | {"output": {"uri": str(svc.root / "out" / "nightly-{ds}")}}))
    cli("schedule", "add", "acme-nightly", str(template), "--cron", "0 2 * * *", "--tenant", "acme")
    for first_time in (True, False):
        r = cli("schedule", "backfill", "acme-nightly", "--from", "2026-11-26", "--to", "2026-11-28", "--json")
        assert [(x["ds"], x["created"]) for x in json.loads(r.stdout)] == [
            ("2026-11-26", first_time), ("2026-11-27", first_time), ("2026-11-28", first_time)]
        with svc.client("acme") as cl:
            nightly = cl.get("/v1/jobs", params={"schedule": "acme-nightly"}).json()["items"]
        assert sorted(j["idempotency_key"] for j in nightly) == [
            f"schedule:acme-nightly:2026-11-{d}" for d in (26, 27, 28)]
        assert all(j["output_uri"].endswith(f"nightly-{j['idempotency_key'][-10:]}/") for j in nightly)


@pytest.mark.slow
def test_cancel_through_the_api(svc: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.after_write=sleep(0.5)")
    job = _submit(svc, "acme", _manifest(svc, "stopme", n=400, max_records=20))["job_id"]
    driver = svc.drive(job)
    _wait(svc, "acme", job, lambda s: s["shards"]["committed"] >= 1)
    with svc.client("acme") as c:
        r = c.post(f"/v1/jobs/{job}/cancel")
        assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled"), r.text
        driver.join(timeout=60)
        final = c.get(f"/v1/jobs/{job}").json()
    assert final["status"] == "cancelled" and final["error"] == "cancelled by request"
    assert 0 < final["shards"]["committed"] < final["shards"]["total"]
    assert (svc.root / "out" / "stopme" / "_PARTIAL.json").exists()
    assert not (svc.root / "out" / "stopme" / "_SUCCESS").exists()


def test_bundles_and_openapi_document(svc: Service) -> None:
    with svc.client("globex") as c:
        bundles = c.get("/v1/bundles").json()
    assert [(b["digest"], b["aliases"]) for b in bundles] == [(svc.bundle_digest, ["tiny@prod"])]
    doc = httpx.get(svc.url + "/openapi.json").json()
    assert set(doc["paths"]) == {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/shards",
                                 "/v1/jobs/{job_id}/errors", "/v1/jobs/{job_id}/cancel", "/v1/bundles",
                                 "/v1/jobs/{job_id}/attempts", "/v1/jobs/{job_id}/throughput",
                                 "/v1/jobs/{job_id}/retry",
                                 "/healthz", "/metrics", "/v1/files", "/v1/files/{file_id}",
                                 "/v1/files/{file_id}/content", "/v1/batches", "/v1/batches/{batch_id}",
                                 "/v1/batches/{batch_id}/cancel"}
    from batchinf.api.schemas import JobView
    from batchinf.ledger.status import status

    job = _submit(svc, "globex", _manifest(svc, "model", n=5))["job_id"]
    assert set(JobView.model_fields) == set(status(job))    # one status model, not a fork


@pytest.mark.slow
def test_schema_driven_fuzz_finds_no_server_errors(svc: Service) -> None:
    """schemathesis generates valid and invalid requests from the OpenAPI document for every
    operation; none may get a 5xx, and every response must match the document (status code,
    content type, schema). BATCHINF_FUZZ_EXAMPLES sets examples per operation and mode (CI: 15)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    examples = int(os.environ.get("BATCHINF_FUZZ_EXAMPLES", "15"))
    schema = schemathesis.openapi.from_url(svc.url + "/openapi.json")
    headers = {"Authorization": f"Bearer {svc.tokens['acme']}"}
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) == 21       # 11 paths, /v1/jobs with GET and POST; 9 OpenAI files/batches operations
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    no_inputs = {"/healthz", "/metrics", "/v1/bundles"}        # nothing to make invalid there
    for op, mode in ((op, m) for op in operations for m in modes if op.path not in no_inputs or m is modes[0]):
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case: Any) -> None:
            case.call_and_validate(headers=headers, checks=checks)

        run()
