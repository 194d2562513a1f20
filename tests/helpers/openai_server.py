"""A real `batchinf serve` for the OpenAI-compatible API tests (and the OpenAI guide's script): started as a
subprocess over the environment the test set up, with a token per tenant, plus the few client
steps every test repeats (upload a JSONL file, wait for a batch, read a file's lines)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import reset_process_state as _reset_process_state
from tests.helpers.services import launch_serve
from tests.helpers.services import stop_process


@dataclass
class Server:
    url: str
    tokens: dict[str, str]
    log: Path
    env: dict[str, str]

    def client(self, tenant: str = "acme") -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.tokens[tenant], max_retries=0, timeout=60)

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, check=False)


def _cli(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env=dict(os.environ), capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout


def import_tiny_bundles(root: Path) -> None:
    """tiny@prod (an encoder) and tinyllama@prod (a decoder), generated."""
    from batchinf.bundles import import_bundle
    from tests.helpers.tiny_llama import make_tiny_llama
    from tests.helpers.tiny_models import make_tiny_bert

    import_bundle(make_tiny_bert(root / "tiny-bert"), "tiny", alias="prod")
    import_bundle(make_tiny_llama(root / "tiny-llama"), "tinyllama", alias="prod")


def start(root: Path, serve_args: list[str], procs: list[subprocess.Popen]) -> Server:
    """Start `batchinf serve` (appended to procs, for the caller to stop) once the bundles it needs
    are imported; returns when /healthz answers."""
    tokens = {t: json.loads(_cli("token", "create", "--tenant", t, "--json"))["token"] for t in ("acme", "globex")}
    _reset_process_state()
    log = root / "serve.log"
    proc, url = launch_serve(log, dict(os.environ), *serve_args)
    procs.append(proc)
    return Server(url, tokens, log, dict(os.environ))


def set_env(mp: pytest.MonkeyPatch, root: Path, **extra: str) -> None:
    mp.setenv("BATCHINF_HOME", str(root / "home"))
    for k in ("BATCHINF_DATABASE_URL", "BATCHINF_BUNDLE_STORE", "BATCHINF_FILES_URI", "BATCHINF_TENANT"):
        mp.delenv(k, raising=False)
    mp.setenv("BATCHINF_HEARTBEAT_SECONDS", "0.5")
    mp.setenv("BATCHINF_LEASE_SECONDS", "5")
    mp.setenv("BATCHINF_OPENAI_SHARD_RECORDS", "8")
    mp.setenv("BATCHINF_OPENAI_MODELS", "gpt-4o-mini=tinyllama@prod,text-embedding-3-small=tiny@prod")
    for k, v in extra.items():
        mp.setenv(k, v)
    _reset_process_state()


def upload(client: Any, lines: list[dict[str, Any]], tmp: Path, name: str) -> Any:
    path = tmp / f"{name}.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with open(path, "rb") as fh:
        return client.files.create(file=fh, purpose="batch")


def wait_for(client: Any, batch_id: str, until: set[str], timeout: float = 240, log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in until:
            return b
        time.sleep(0.3)
    raise AssertionError(f"batch {batch_id} is {b.status}\n{log.read_text()[-3000:] if log else ''}")


def file_lines(client: Any, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]




@contextmanager
def serving(root: Path, serve_args: list[str], prepare: Callable[[Path], None]) -> Iterator[Server]:
    """An embedded `batchinf serve` under `root` (set_env's environment), after `prepare(root)`
    imported the bundles it needs; stopped, and the environment restored, on exit."""
    mp = pytest.MonkeyPatch()
    set_env(mp, root)
    procs: list[subprocess.Popen] = []
    try:
        prepare(root)
        yield start(root, serve_args, procs)
    finally:
        for p in procs:
            stop_process(p, timeout=20)
        mp.undo()
        _reset_process_state()
