"""Cross-tenant and host reads and writes, replayed as an attacker holding one tenant's token
against a real `batchinf serve` on PostgreSQL (jobs run by the real driver), with the victim's
published output checksummed before and after."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.api_service import Service, checksums, start_service
from tests.helpers.corpus import manifest, write_jsonl

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from start_service(tmp_path_factory.mktemp("confine"))


def _post(svc: Service, tenant: str, m: dict[str, Any]) -> Any:
    with svc.client(tenant) as c:
        return c.post("/v1/jobs", json=m)


@pytest.fixture(scope="module")
def victim(svc: Service) -> dict[str, Any]:
    """acme's published job, with a secret text field the attacker would like to read."""
    src = svc.root / "in" / "acme-private" / "data.jsonl"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text("".join(json.dumps({"id": f"a{i}", "text": f"acme secret {i}", "secret": f"s3cr3t-{i}"}) + "\n"
                           for i in range(30)))
    m = manifest(str(src.parent) + "/", str(svc.root / "out" / "acme-private"), name="acme-private")
    r = _post(svc, "acme", m)
    assert r.status_code == 201, r.text
    job = r.json()
    svc.drive(job["job_id"]).join(timeout=120)
    assert svc.wait("acme", job["job_id"])["status"] == "succeeded"
    return {"job": job, "out": svc.root / "out" / "acme-private", "src": src}


def test_another_tenants_prefixes_are_out_of_reach(svc: Service, victim: dict[str, Any]) -> None:
    """globex holds the same grants as acme here (read in/, write out/), so only output ownership
    stands between them: every spelling of acme's published output is refused, nothing of acme's
    is named, and acme's bytes do not change."""
    before = checksums(victim["out"])
    write_jsonl(svc.root / "in" / "globex" / "a.jsonl", 5, bad=False)
    out = victim["out"]
    for spelling in (str(out), str(out) + "/./", str(out) + "//", str(out / "errors"), str(out.parent / "x" / ".." /
                     out.name), "FILE://" + str(out), str(out / "part-00000.parquet")):
        m = manifest(str(svc.root / "in" / "globex") + "/", spelling, name="squat")
        r = _post(svc, "globex", m)
        assert r.status_code == 422, (spelling, r.text)
        assert victim["job"]["job_id"] not in r.text and "another job" in r.text
    assert checksums(victim["out"]) == before


def test_reads_outside_the_grants_are_refused_before_anything_is_read(svc: Service, victim: dict[str, Any]) -> None:
    attacks = {
        "host file": manifest("/etc/passwd", str(svc.root / "out" / "g1"), input={"uri": "/etc/passwd",
                                                                                "id_field": "root"}),
        "home": manifest(str(svc.root / "home") + "/", str(svc.root / "out" / "g2")),
        "s3 bucket not granted": manifest("s3://acme-private-bucket/", str(svc.root / "out" / "g4")),
        "climb out": manifest(str(svc.root / "in" / ".." / "home") + "/", str(svc.root / "out" / "g5")),
    }
    for what, m in attacks.items():
        m["input"] = {**m["input"], "format": "jsonl"}
        r = _post(svc, "globex", m)
        assert r.status_code == 422 and "outside the prefixes tenant 'globex' may read" in r.text, (what, r.text)
    tilde = manifest("~/", str(svc.root / "out" / "g3"))       # never resolved in the server's home
    r = _post(svc, "globex", {**tilde, "input": {**tilde["input"], "format": "jsonl"}})
    assert r.status_code == 422 and "neither a URI nor an absolute path" in r.text, r.text
    write_jsonl(svc.root / "in" / "globex" / "b.jsonl", 5, bad=False)
    for what, out in (("system path", "/var/tmp/batchinf-squat"), ("home", str(svc.root / "home" / "x"))):
        r = _post(svc, "globex", manifest(str(svc.root / "in" / "globex") + "/", out, name=what))
        assert r.status_code == 422, (what, r.text)


def test_an_input_manifest_naming_another_tenants_object_fails_at_pinning(svc: Service,
                                                                         victim: dict[str, Any]) -> None:
    """The input manifest itself lies in globex's grant, but it names acme's object by a path
    globex may not read: the job fails when it is pinned, naming the object, and no record of it
    (not even an id, with id_field pointed at the secret) reaches globex."""
    listing = svc.root / "in" / "globex" / "objects.jsonl"
    listing.parent.mkdir(parents=True, exist_ok=True)
    outside = svc.root / "elsewhere" / "acme-copy.jsonl"
    outside.parent.mkdir(parents=True, exist_ok=True)
    outside.write_bytes(victim["src"].read_bytes())
    listing.write_text(json.dumps({"uri": str(outside)}) + "\n")
    m = manifest(str(svc.root / "in" / "globex"), str(svc.root / "out" / "g-manifest"), name="via-manifest",
                 input={"manifest": str(listing), "id_field": "secret", "text_field": "nope"})
    r = _post(svc, "globex", m)
    assert r.status_code == 201, r.text
    job_id = r.json()["job_id"]
    svc.drive(job_id).join(timeout=120)
    final = svc.wait("globex", job_id)
    assert final["status"] == "failed" and "acme-copy.jsonl" in final["error"]
    assert "outside the prefixes tenant 'globex' may read" in final["error"]
    with svc.client("globex") as c:
        errors = c.get(f"/v1/jobs/{job_id}/errors").text
    assert "s3cr3t" not in errors and "s3cr3t" not in json.dumps(final)
