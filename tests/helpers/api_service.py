"""A real `batchinf serve` process over a fresh PostgreSQL ledger, with tokens for a few tenants,
for the API tests. Jobs are run by the embedded driver (`controller.drive`) against the same
ledger, in a thread of the test process."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import reset_process_state, subprocess_env, use_database, use_home
from tests.helpers.services import fresh_postgres_db, launch_serve, stop_process

TENANTS = ("acme", "globex", "pager")
PRICE_PER_WORKER_HOUR = "1.5"


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env=subprocess_env(), check=False,
                       capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"batchinf {' '.join(args)} exited {r.returncode}: {r.stderr}")
    return r


@dataclass
class Service:
    url: str
    root: Path
    tokens: dict[str, str]
    metrics_token: str
    bundle_digest: str
    log: Path
    pid: int = 0                  # the `batchinf serve` process
    drivers: list[threading.Thread] = field(default_factory=list)

    def client(self, tenant: str | None = None, token: str | None = None) -> httpx.Client:
        headers = {}
        if tenant or token:
            headers["Authorization"] = f"Bearer {token or self.tokens[tenant or '']}"
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def wait(self, tenant: str, job_id: str, timeout: float = 120) -> dict[str, Any]:
        """The job's status object once it is final (or `timeout` has passed), as `tenant` sees it."""
        deadline = time.monotonic() + timeout
        while True:
            with self.client(tenant) as c:
                s = c.get(f"/v1/jobs/{job_id}").json()
            if s["status"] in ("succeeded", "failed", "cancelled", "expired") or time.monotonic() > deadline:
                return s
            time.sleep(0.5)

    def drive(self, job_id: str) -> threading.Thread:
        """Run the job to a terminal state with one local worker process, in the background."""
        from batchinf.controller import drive

        t = threading.Thread(target=drive, args=(job_id,), kwargs={"workers": 1, "device": "cpu", "threads": 1},
                             daemon=True)
        t.start()
        self.drivers.append(t)
        return t


def checksums(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by relative path: what a victim's files were."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def start_service(root: Path) -> Iterator[Service]:
    from batchinf.bundles import import_bundle
    from tests.helpers.tiny_models import make_tiny_bert

    mp = pytest.MonkeyPatch()
    url = fresh_postgres_db()
    mp.delenv("BATCHINF_TENANT", raising=False)
    use_home(mp, root / "home", BATCHINF_PRICE_PER_WORKER_HOUR=PRICE_PER_WORKER_HOUR,
             BATCHINF_METRICS_TOKEN="metrics-secret")
    use_database(mp, url)
    digest = import_bundle(make_tiny_bert(root / "tiny"), "tiny", alias="prod").digest
    tokens = {t: json.loads(cli("token", "create", "--tenant", t, "--json").stdout)["token"] for t in TENANTS}
    for t in TENANTS:     # the API confines every job to its tenant's grants
        cli("tenant", "grant", t, "--read", str(root / "in"), "--write", str(root / "out"))
    log = root / "serve.log"
    proc, url = launch_serve(log, subprocess_env())
    svc = Service(url, root, tokens, "metrics-secret", digest, log, proc.pid)
    try:
        yield svc
    finally:
        stop_process(proc)
        for t in svc.drivers:
            t.join(timeout=30)
        mp.undo()
        reset_process_state()


def rest_status(job_id: str, tenant: str = "default") -> dict:
    """GET /v1/jobs/{id} in process (the app over this process's ledger), as `tenant`."""
    from fastapi.testclient import TestClient

    from batchinf.api.app import create_app
    from batchinf.tenants import create_token

    token = create_token(tenant)["token"]
    with TestClient(create_app()) as c:
        r = c.get(f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return r.json()
