"""Everyday use through the real `batchinf` command (subprocesses): JSON logs that parse line by
line and carry job_id/shard_id, human output on stdout, full ids when piped, refused unknown
states, `info`, `db current|history|check|downgrade`, and the default home."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.corpus import manifest, write_jsonl

pytestmark = pytest.mark.integration


def bi(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def test_json_logs_every_line_parses_and_carries_job_id(tmp_path: Path, tiny_bundle: str) -> None:
    write_jsonl(tmp_path / "in.jsonl", 120, seed=5)
    m = tmp_path / "m.yaml"
    m.write_text(yaml.safe_dump(manifest(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), shards={"max_records": 50})))
    r = bi("--log-format", "json", "--log-level", "INFO", "run", str(m), "--workers", "1", "--threads", "1")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]          # every line is one JSON object
    assert all({"ts", "level", "logger", "message"} <= rec.keys() for rec in records)
    job_id = json.loads(bi("jobs", "--json").stdout)[0]["job_id"]
    transitions = [rec for rec in records if rec.get("to_status")]
    assert [(t["from_status"], t["to_status"]) for t in transitions][-1] == ("verifying", "succeeded")
    assert {"planning", "running", "verifying", "succeeded"} <= {t["to_status"] for t in transitions}
    assert all(t["job_id"] == job_id for t in transitions)
    shard_lines = [rec for rec in records if rec["logger"] == "batchinf.dispatch"]
    assert shard_lines and all(rec["job_id"] == job_id and rec["shard_id"] for rec in shard_lines)
    assert any("committed" in rec["message"] for rec in shard_lines)

    # human output on stdout; full ids and digests when piped
    st = bi("status", job_id)
    assert st.returncode == 0 and job_id in st.stdout and "succeeded" in st.stdout
    listed = bi("jobs")
    assert job_id in listed.stdout and "…" not in listed.stdout
    bl = bi("bundle", "list")
    assert tiny_bundle in bl.stdout
    v = bi("verify", job_id)
    assert v.returncode == 0 and v.stdout.startswith("ok ") and "{" not in v.stdout

    bad = bi("jobs", "--status", "bogus")
    assert bad.returncode == 2 and "bogus" in bad.stderr and "succeeded" in bad.stderr and bad.stdout == ""


def test_info_db_commands_and_default_home(tmp_path: Path) -> None:
    env = {"XDG_DATA_HOME": str(tmp_path / "xdg"), "BATCHINF_HOME": "", "BATCHINF_DATABASE_URL": "",
           "BATCHINF_BUNDLE_STORE": ""}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    info = json.loads(bi("info", "--json", env=env, cwd=elsewhere).stdout)
    home = tmp_path / "xdg" / "batchinf"
    assert info["home"] == str(home) and info["home_is_default"]
    assert info["ledger"] == f"sqlite:///{home / 'ledger.db'}" and info["bundle_store"] == home.joinpath("bundles").as_uri()
    assert info["versions"]["python"] and info["version"]
    assert json.loads(bi("info", "--json", env=env, cwd=tmp_path).stdout)["home"] == str(home)   # any cwd

    chk = bi("db", "check", "--json", env=env)
    assert chk.returncode == 1 and json.loads(chk.stdout)["current"] is None
    up = json.loads(bi("db", "upgrade", "--json", env=env).stdout)
    assert bi("db", "check", env=env).returncode == 0
    hist = json.loads(bi("db", "history", "--json", env=env).stdout)
    head = max(p.name[:4] for p in (Path(__file__).parents[2] / "migrations" / "versions").glob("0*.py"))
    assert hist[-1]["revision"] == up["revision"] == head and hist[-1]["current"]   # the head migration
    assert [h["revision"] for h in hist][:2] == ["0001", "0002"]
    down = bi("db", "downgrade", "0006", "--yes", "--json", env=env)
    assert down.returncode == 0, down.stderr
    cur = json.loads(bi("db", "current", "--json", env=env).stdout)
    assert (cur["current"], cur["head"], cur["up_to_date"]) == ("0006", head, False)


def test_missing_optional_dependency_names_the_extra(tmp_path: Path) -> None:
    """A postgresql:// ledger without psycopg installed (hidden from this process) says which extra to install."""
    code = "import sys; sys.modules['psycopg'] = None; from batchinf.cli import main; main()"
    r = subprocess.run([sys.executable, "-c", code, "db", "current"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "BATCHINF_DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/postgres",
                            "BATCHINF_HOME": str(tmp_path)})
    assert r.returncode == 2, r.stderr
    assert "install batchinf[postgres]" in r.stderr and "Traceback" not in r.stderr
