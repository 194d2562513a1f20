"""The choke points, replayed through the surfaces that once went around them: a retry through the
REST API is created for the tenant that asked (confined: it writes only where that tenant may),
the job behind an OpenAI batch is confined and shows no server path, and an S3 Inventory's files
and the objects they list are read only through the job's grant-scoped Storage, refused before a
byte of them reaches the job (or its error message)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchinf import scopes
from batchinf.ledger import jobs
from batchinf.ledger.states import JobStatus
from batchinf.lifecycle import step
from batchinf.manifest import parse_manifest
from batchinf.scopes import Caller
from batchinf.store import get_store
from batchinf.submit import submit
from tests.helpers.api_service import Service, checksums, cli, start_service
from tests.helpers.corpus import manifest, write_jsonl
from tests.helpers.stages import InProcess

pytestmark = pytest.mark.integration

LOOSE = "drifter"        # a tenant with a token and no grants at all


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    for s in start_service(tmp_path_factory.mktemp("choke")):
        s.tokens[LOOSE] = json.loads(cli("token", "create", "--tenant", LOOSE, "--json").stdout)["token"]
        yield s


def test_a_retry_through_the_api_writes_only_where_the_tenant_may(svc: Service,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator ran a job for a tenant without grants (the CLI may); that tenant's retry of it
    through the API is its own request: confined, so no output it names, nor the default one, is
    writable, and another tenant's granted prefix stays untouched."""
    victim = svc.root / "out" / "acme-kept"
    write_jsonl(victim / "seed.jsonl", 4, bad=False)
    before = checksums(victim)
    src = svc.root / "ops" / "in" / "a.jsonl"
    write_jsonl(src, 25, seed=4)
    m = manifest(str(src.parent) + "/", str(svc.root / "ops" / "out") + "/", name="ops-for-drifter")
    old, _ = submit(parse_manifest(m), Caller(LOOSE, operator=True))
    assert not jobs.get(old).confined
    # an inference error to retry (input errors are never retried); the workers read it at start
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.record[r3]=raise;execute.record[r5]=raise")
    svc.drive(old).join(timeout=120)
    assert svc.wait(LOOSE, old)["status"] == "succeeded"

    targets = [f"file://{victim}/x/", f"{victim}/y/", f"{svc.root}/out/drifter-new/", "/var/tmp/drifter-retry/", None]
    with svc.client(LOOSE) as c:
        for out in targets:
            r = c.post(f"/v1/jobs/{old}/retry", json={"errors": ["all"], **({"output": out} if out else {})})
            assert r.status_code == 422, (out, r.text)
            assert f"outside the prefixes tenant '{LOOSE}' may" in r.text, (out, r.text)
        assert [j["job_id"] for j in c.get("/v1/jobs").json()["items"]] == [old]     # no job was created
    assert checksums(victim) == before
    assert not Path("/var/tmp/drifter-retry").exists() and not (svc.root / "out" / "drifter-new").exists()

    # a tenant that may read the input still writes only inside its write grants
    write_jsonl(svc.root / "in" / "globex-retry" / "a.jsonl", 25, seed=5)
    with svc.client("globex") as c:
        own = c.post("/v1/jobs", json=manifest(str(svc.root / "in" / "globex-retry") + "/",
                                               str(svc.root / "out" / "globex-retry") + "/", name="g-retry")).json()
    svc.drive(own["job_id"]).join(timeout=120)
    monkeypatch.delenv("BATCHINF_FAILPOINTS")
    assert svc.wait("globex", own["job_id"])["status"] == "succeeded"
    with svc.client("globex") as c:
        for out in (f"file://{svc.root}/in/globex-retry-out/", f"{svc.root}/elsewhere/"):    # read-only, ungranted
            r = c.post(f"/v1/jobs/{own['job_id']}/retry", json={"errors": ["all"], "output": out})
            assert r.status_code == 422 and "outside the prefixes tenant 'globex' may write" in r.text, (out, r.text)
        r = c.post(f"/v1/jobs/{own['job_id']}/retry", json={"errors": ["all"]})       # its own default: granted
        assert r.status_code == 201, r.text
        assert jobs.get(r.json()["job_id"]).confined


def test_the_job_behind_an_openai_batch_is_confined_and_names_no_server_path(svc: Service) -> None:
    lines = "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": "tiny@prod", "input": f"text {i}"}}) + "\n" for i in range(7))
    with svc.client(LOOSE) as c:
        f = c.post("/v1/files", files={"file": ("b.jsonl", lines.encode())}, data={"purpose": "batch"})
        assert f.status_code == 200, f.text
        b = c.post("/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/embeddings",
                                        "completion_window": "24h"})
        assert b.status_code == 200, b.text
        (job,) = [j for j in c.get("/v1/jobs").json()["items"] if j["name"] == b.json()["id"]]
    assert jobs.get(job["job_id"]).confined
    home = str(svc.root / "home")
    for uri in (job["input_uri"], job["output_uri"]):
        assert uri.startswith(scopes.FILES_SCHEME) and home not in uri, uri
    with svc.client(LOOSE) as c:
        assert home not in c.get(f"/v1/jobs/{job['job_id']}").text


def test_relative_paths_are_refused_without_the_servers_directory(svc: Service) -> None:
    write_jsonl(svc.root / "in" / "globex-rel" / "a.jsonl", 3, bad=False)
    with svc.client("globex") as c:
        for out in ("out/rel/", "~/rel/", "../rel/"):
            r = c.post("/v1/jobs", json=manifest(str(svc.root / "in" / "globex-rel") + "/", out, name="rel"))
            assert r.status_code == 422 and "neither a URI nor an absolute path" in r.text, r.text
            assert str(Path.cwd()) not in r.text and str(Path.home()) not in r.text


# --- S3 Inventory: its files and the objects they list, through the job's Storage ------------------


def _inventory_csv(rows: list[tuple[str, str]]) -> bytes:
    buf = io.StringIO()
    csv.writer(buf, quoting=csv.QUOTE_ALL).writerows(rows)
    return buf.getvalue().encode()


def _inventory_job(s3_bucket: str, tenant: str, data_key: str, tmp_path: Path, name: str) -> str:
    """A job of `tenant` whose input manifest (in its own prefix) is an Inventory manifest.json
    naming `data_key` as its data file; stepped once (pinning). Returns the job id."""
    bucket = s3_bucket.removeprefix("s3://")
    doc = {"sourceBucket": bucket, "destinationBucket": f"arn:aws:s3:::{bucket}", "fileFormat": "CSV",
           "fileSchema": "Bucket, Key", "files": [{"key": data_key, "size": 1, "MD5checksum": "x"}]}
    uri = f"{s3_bucket}/{tenant}/inv/{name}/manifest.json"
    get_store(uri).put_bytes(uri, json.dumps(doc).encode())
    m = manifest(f"{s3_bucket}/{tenant}/", str(tmp_path / tenant / "out" / name) + "/", name=name,
                 input={"manifest": uri})
    job_id, _ = submit(parse_manifest(m), Caller(tenant))
    step(job_id, InProcess())
    return job_id


def test_inventory_files_and_listed_objects_outside_the_grants_are_never_read(
        s3_bucket: str, tmp_path: Path, tiny_bundle: str) -> None:
    bucket = s3_bucket.removeprefix("s3://")
    secret = "hunter2-first-line-of-acme"
    store = get_store(s3_bucket)
    store.put_bytes(f"{s3_bucket}/acme/inv/data.csv", _inventory_csv([(secret, "k")]))
    store.put_bytes(f"{s3_bucket}/acme/records/a.jsonl", b'{"id": "a1", "text": "acme private"}\n')
    store.put_bytes(f"{s3_bucket}/globex/inv/ok.csv", _inventory_csv([(bucket, "acme/records/a.jsonl")]))
    scopes.grant("globex", read=[f"{s3_bucket}/globex/"], write=[str(tmp_path / "globex" / "out")])

    for name, data_key, named in (("file-outside", "acme/inv/data.csv", "S3 Inventory file"),
                                  ("climbing", "globex/../acme/inv/data.csv", "S3 Inventory file"),
                                  ("object-outside", "globex/inv/ok.csv", "input object")):
        job = jobs.get(_inventory_job(s3_bucket, "globex", data_key, tmp_path, name))
        assert job.status == JobStatus.FAILED, (name, job.status)
        assert f"{named} s3://{bucket}/" in (job.error or "") and "outside the prefixes tenant 'globex'" in job.error
        assert secret not in job.error and "acme private" not in job.error
        assert jobs.inputs(job.id) == []                      # nothing of acme's was pinned
