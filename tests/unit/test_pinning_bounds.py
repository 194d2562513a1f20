"""Pinning reads what a tenant named through its job's grant-scoped Storage, bounded per job: an
object outside the grants, listed twice, or past the job's objects, bytes or manifest size is
refused before any byte of it is hashed, with a message that names the bound and the fix and says
nothing about whether an object outside the grants exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchinf import scopes
from batchinf.ledger import jobs
from batchinf.ledger.states import JobStatus
from batchinf.lifecycle import step
from batchinf.limits import set_tenant_limit
from batchinf.manifest import parse_manifest
from batchinf.scopes import Caller
from batchinf.store import local
from batchinf.submit import submit
from tests.helpers.corpus import manifest, write_jsonl
from tests.helpers.stages import InProcess


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the local files the store hashes (every pin of a file:// object hashes it)."""
    seen: list[str] = []
    real = local.sha256_fileobj

    def counting(f):  # noqa: ANN001, ANN202
        seen.append(Path(f.name).name)
        return real(f)
    monkeypatch.setattr(local, "sha256_fileobj", counting)
    return seen


def _tenant(tmp_path: Path, tenant: str = "umbrella") -> Path:
    root = tmp_path / tenant
    scopes.grant(tenant, read=[str(root / "in")], write=[str(root / "out")])
    return root


def _pin(tmp_path: Path, root: Path, listed: list[str], tenant: str = "umbrella", name: str = "j") -> str:
    """Submit a job for `tenant` (a tenant's request) whose input manifest lists `listed`, then
    step it once (pinning); returns the job's error ('' when it pinned)."""
    listing = root / "in" / f"{name}.jsonl"
    listing.parent.mkdir(parents=True, exist_ok=True)
    listing.write_text("".join(json.dumps({"uri": u}) + "\n" for u in listed))
    m = manifest(str(root / "in") + "/", str(root / "out" / name) + "/", name=name, input={"manifest": str(listing)})
    job_id, _ = submit(parse_manifest(m), Caller(tenant))
    step(job_id, InProcess())
    job = jobs.get(job_id)
    return job.error or "" if job.status == JobStatus.FAILED else ""


def test_an_object_outside_the_grants_is_refused_before_it_is_hashed_and_existence_does_not_show(
        tmp_path: Path, tiny_bundle: str, hashed: list[str]) -> None:
    root = _tenant(tmp_path)
    outside = tmp_path / "elsewhere" / "private.jsonl"
    write_jsonl(outside, 30, bad=False)
    there = _pin(tmp_path, root, [str(outside)], name="exists")
    missing = _pin(tmp_path, root, [str(outside.with_name("nothing-here.jsonl"))], name="missing")
    assert "outside the prefixes tenant 'umbrella' may read" in there
    assert there.replace("private.jsonl", "X") == missing.replace("nothing-here.jsonl", "X")
    assert "private.jsonl" not in hashed


def test_an_object_listed_twice_is_refused_before_any_is_hashed(tmp_path: Path, tiny_bundle: str,
                                                                hashed: list[str]) -> None:
    root = _tenant(tmp_path)
    big = root / "in" / "data" / "big.jsonl"
    write_jsonl(big, 2000, bad=False)
    other = root / "in" / "data" / "small.jsonl"
    write_jsonl(other, 3, bad=False)
    error = _pin(tmp_path, root, [str(other)] + [str(big)] * 23)
    assert f"lists file://{big} twice (entries 2 and 3)" in error
    assert "big.jsonl" not in hashed and "small.jsonl" not in hashed


def test_a_job_is_bounded_in_objects_and_bytes_per_tenant(tmp_path: Path, tiny_bundle: str,
                                                          hashed: list[str]) -> None:
    root = _tenant(tmp_path)
    files = [root / "in" / "data" / f"p{i}.jsonl" for i in range(7)]
    for i, f in enumerate(files):
        write_jsonl(f, 20, seed=i, bad=False)
    set_tenant_limit("umbrella", "input_objects", 6)
    error = _pin(tmp_path, root, [str(f) for f in files], name="many")
    assert "more than 6 objects (limit input_objects)" in error and "batchinf tenant limit umbrella input_objects" in error
    assert hashed == []                                 # counted while listing, before any HEAD
    set_tenant_limit("umbrella", "input_objects", None)

    size = files[0].stat().st_size
    set_tenant_limit("umbrella", "input_bytes", 2 * size + 1)
    error = _pin(tmp_path, root, [str(f) for f in files], name="heavy")
    assert f"more than {2 * size + 1} bytes together (limit input_bytes" in error
    assert "p0.jsonl" in hashed                         # HEADed (hashed) until the bound was passed
    # a listed prefix is bounded the same way, by the sizes the listing tells: nothing is hashed
    hashed.clear()
    m = manifest(str(root / "in" / "data") + "/", str(root / "out" / "prefix") + "/", name="prefix")
    job_id, _ = submit(parse_manifest(m), Caller("umbrella"))
    step(job_id, InProcess())
    assert "limit input_bytes" in (jobs.get(job_id).error or "")
    assert hashed == []


def test_an_oversized_input_manifest_is_refused_unread(tmp_path: Path, tiny_bundle: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.config import settings

    root = _tenant(tmp_path)
    write_jsonl(root / "in" / "data" / "a.jsonl", 3, bad=False)
    monkeypatch.setenv("BATCHINF_MAX_INPUT_MANIFEST_BYTES", "300")
    settings.cache_clear()
    error = _pin(tmp_path, root, [str(root / "in" / "data" / "a.jsonl")] * 1 + [
        str(root / "in" / "data" / f"absent-{i}.jsonl") for i in range(10)])
    assert "over the limit of 300 bytes" in error and "j.jsonl" in error


def test_relative_paths_of_a_tenant_request_are_refused_without_resolving_them(tmp_path: Path,
                                                                                tiny_bundle: str) -> None:
    from batchinf.errors import ManifestError

    root = _tenant(tmp_path)
    for out in ("out/x/", "~/x/", "./x/"):
        m = manifest(str(root / "in") + "/", out, name="rel")
        with pytest.raises(ManifestError, match="neither a URI nor an absolute path") as err:
            submit(parse_manifest(m), Caller("umbrella"))
        assert str(Path.cwd()) not in str(err.value) and str(Path.home()) not in str(err.value)
    # the operator's CLI resolves them, as any command does
    job_id, _ = submit(parse_manifest(manifest(str(root / "in") + "/", str(root / "out" / "cli"))),
                       Caller("umbrella", operator=True))
    assert jobs.get(job_id).confined         # the tenant has grants: confined whoever submits


def test_refusals_name_uris_as_written_and_never_resolve_them_on_the_server(tmp_path: Path, tiny_bundle: str) -> None:
    from batchinf.errors import ManifestError

    root = _tenant(tmp_path)
    secret_dir = tmp_path / "server-secret-dir"
    write_jsonl(secret_dir / "a.jsonl", 2, bad=False)
    link = root / "in" / "innocent"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(secret_dir)
    m = manifest(str(link) + "/", str(root / "out" / "x") + "/", name="link")
    with pytest.raises(ManifestError, match="outside the prefixes tenant 'umbrella' may read") as err:
        submit(parse_manifest(m), Caller("umbrella"))
    assert str(link) in str(err.value) and "server-secret-dir" not in str(err.value)
    for entry in ("~/notes.jsonl", "relative/notes.jsonl"):
        error = _pin(tmp_path, root, [entry], name=f"entry-{len(entry)}")
        assert "neither a URI nor an absolute path" in error, error
        assert str(Path.home()) not in error and str(Path.cwd()) not in error
