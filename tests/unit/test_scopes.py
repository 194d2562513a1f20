"""Storage scopes on an embedded ledger: URI spellings, tenants' grants, output ownership, symlinks,
and `verify` refusing parts it did not publish."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from batchinf import scopes
from batchinf.errors import ManifestError, StoreError, VerificationError
from batchinf.ledger import jobs
from batchinf.ledger.states import JobStatus
from batchinf.lifecycle import step
from batchinf.manifest import parse_manifest
from batchinf.store import normalize_uri
from batchinf.submit import submit
from batchinf.scopes import Caller
from batchinf.verify import verify_output
from tests.helpers.corpus import manifest, write_jsonl
from tests.helpers.stages import InProcess, plan_job, publish_job


@pytest.mark.parametrize("spelling", ["s3://Bucket/a/b/", "S3://bucket/a//b/", "s3://bucket/a/./b/",
                                      "s3://bucket/a/x/../b/", "s3://bucket//a/b/"])
def test_every_spelling_of_a_prefix_normalises_to_one(spelling: str) -> None:
    assert normalize_uri(spelling) == "s3://bucket/a/b/"


@pytest.mark.parametrize("hostile", ["s3://b/a/%2e%2e/c", "s3://b/a%2Fb", "file:///tmp/x%5cy", "s3://b/a\x00b",
                                     "s3://b/../other-bucket/x", "file:///../../etc/passwd"])
def test_hostile_spellings_are_refused(hostile: str) -> None:
    with pytest.raises(StoreError):
        normalize_uri(hostile)


def test_within_compares_whole_segments() -> None:
    assert scopes.within("s3://b/acme/x.jsonl", "s3://b/acme/")
    assert not scopes.within("s3://b/acme-evil/x.jsonl", "s3://b/acme/")
    assert not scopes.within("file:///data/a.jsonl2", "file:///data/a.jsonl")


def _tree(root: Path, tenant: str, n: int = 20) -> dict[str, str]:
    write_jsonl(root / tenant / "in" / "a.jsonl", n, bad=False)
    return manifest(str(root / tenant / "in") + "/", str(root / tenant / "out"))


def test_a_confined_tenant_reads_and_writes_only_what_it_was_granted(tmp_path: Path, tiny_bundle: str) -> None:
    m = _tree(tmp_path, "acme")
    with pytest.raises(ManifestError, match="batchinf tenant grant acme --read PREFIX"):
        submit(parse_manifest(m), Caller("acme"))        # the API never runs unrestricted
    scopes.grant("acme", read=[str(tmp_path / "acme" / "in")], write=[str(tmp_path / "acme" / "out")])
    job_id, created = submit(parse_manifest(m), Caller("acme"))
    assert created and jobs.get(job_id).confined
    _tree(tmp_path, "globex")
    for field, value in (("input", {"uri": str(tmp_path / "globex" / "in") + "/"}),
                         ("output", {"uri": str(tmp_path / "acme" / "in" / "sneaky")}),   # read-only grant
                         ("output", {"uri": "/etc/batchinf-out"})):
        with pytest.raises(ManifestError, match="outside the prefixes tenant 'acme' may"):
            submit(parse_manifest({**m, field: value, "name": f"try-{field}"}), Caller("acme"))


def test_the_cli_runs_unrestricted_until_a_tenant_has_grants(tmp_path: Path, tiny_bundle: str) -> None:
    m = _tree(tmp_path, "ops")
    job_id, _ = submit(parse_manifest(m), Caller("ops", operator=True))
    assert not jobs.get(job_id).confined
    scopes.grant("ops2", read=[str(tmp_path / "elsewhere")])
    with pytest.raises(ManifestError, match="outside the prefixes tenant 'ops2'"):
        submit(parse_manifest({**m, "output": {"uri": str(tmp_path / "ops2-out")}}), Caller("ops2", operator=True))


def test_outputs_never_overlap_another_jobs_prefixes_and_never_name_another_tenants_job(
        tmp_path: Path, tiny_bundle: str) -> None:
    m = _tree(tmp_path, "acme")
    victim, _ = submit(parse_manifest(m), Caller("acme", operator=True))
    out = tmp_path / "acme" / "out"
    attempts = {                        # every spelling of "the same place", and nesting both ways
        "equal": str(out) + "/./",
        "inside": str(out / "errors"),
        "contains": str(tmp_path / "acme"),
        "inside-input": str(tmp_path / "acme" / "in" / "x"),
        "parent-dir-trick": str(tmp_path / "acme" / "zzz" / ".." / "out"),
    }
    write_jsonl(tmp_path / "globex" / "in" / "a.jsonl", 5, bad=False)
    for what, uri in attempts.items():
        g = {**m, "input": {"uri": str(tmp_path / "globex" / "in") + "/"}, "output": {"uri": uri}, "name": what}
        with pytest.raises(ManifestError) as err:
            submit(parse_manifest(g), Caller("globex", operator=True))
        assert victim not in str(err.value) and "another job" in str(err.value), (what, str(err.value))
        with pytest.raises(ManifestError, match=f"job {victim}"):             # its own tenant is told which
            submit(parse_manifest({**g, "name": what + "-own"}), Caller("acme", operator=True))


def test_outputs_never_land_in_the_home_the_bundle_store_or_the_own_input(tmp_path: Path, tiny_bundle: str,
                                                                         bi_home: Path) -> None:
    m = _tree(tmp_path, "acme")
    for uri, name in ((str(bi_home / "bundles" / "x"), "the bundle store"), (str(bi_home / "out"), "BATCHINF_HOME"),
                      (str(tmp_path / "acme" / "in" / "out"), "this job's own input")):
        with pytest.raises(ManifestError, match=name.split()[-1]):
            submit(parse_manifest({**m, "output": {"uri": uri}}), Caller("acme", operator=True))


def test_a_symlink_out_of_the_granted_prefix_is_refused_and_nothing_of_it_is_read(
        tmp_path: Path, tiny_bundle: str) -> None:
    secret = tmp_path / "globex" / "secret.jsonl"
    secret.parent.mkdir(parents=True)
    secret.write_text(json.dumps({"id": "globex-secret-id", "text": "globex's private text"}) + "\n")
    before = hashlib.sha256(secret.read_bytes()).hexdigest()
    m = _tree(tmp_path, "acme")
    os.symlink(secret, tmp_path / "acme" / "in" / "b.jsonl")
    scopes.grant("acme", read=[str(tmp_path / "acme" / "in")], write=[str(tmp_path / "acme" / "out")])
    job_id, _ = submit(parse_manifest(m), Caller("acme"))
    assert not step(job_id, InProcess())
    job = jobs.get(job_id)
    assert job.status == JobStatus.FAILED and "b.jsonl" in job.error and "outside the prefixes" in job.error
    assert "globex-secret-id" not in job.error and "private text" not in job.error
    assert hashlib.sha256(secret.read_bytes()).hexdigest() == before


def test_verify_refuses_a_part_the_manifest_does_not_list(tmp_path: Path, tiny_bundle: str) -> None:
    from batchinf.ledger import leases, shards
    from batchinf.execute import execute_shard

    m = _tree(tmp_path, "acme")
    job_id, _ = submit(parse_manifest(m), Caller("acme", operator=True))
    plan_job(job_id)
    shards.dispatch_ready(job_id)
    while (lease := leases.claim_next([job_id], "t:1", 30)) is not None:
        execute_shard(lease)
    assert shards.verify_when_done(job_id)
    publish_job(job_id)
    out = tmp_path / "acme" / "out"
    assert verify_output(str(out))["ok"]
    (out / "errors").mkdir(exist_ok=True)
    (out / "errors" / "part-00099.parquet").write_bytes(next(out.glob("part-*.parquet")).read_bytes())
    with pytest.raises(VerificationError, match="not listed"):
        verify_output(str(out))


def test_every_tenant_may_use_its_own_space_in_the_files_store_and_no_one_elses(tmp_path: Path,
                                                                                tiny_bundle: str) -> None:
    from batchinf.store import join

    own = scopes.own_space("acme")
    scopes.check("acme", join(own, "files", "f.jsonl"), scopes.WRITE, "output")         # no grant needed
    with pytest.raises(ManifestError, match="outside the prefixes tenant 'acme'"):
        scopes.check("acme", join(scopes.own_space("globex"), "files", "f.jsonl"), scopes.READ, "input")
    m = _tree(tmp_path, "acme")
    with pytest.raises(ManifestError, match="files store"):        # another tenant's space is reserved
        submit(parse_manifest({**m, "output": {"uri": join(scopes.own_space("globex"), "x/")}}), Caller("acme", operator=True))
