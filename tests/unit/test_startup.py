"""A job's fixed cost: planning never imports torch (the planner only tokenizes) and a worker
opening its bundle builds the model without initialising weights the checkpoint replaces (which
would import torch._dynamo, about a second per process), each checked in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from batchinf.manifest import parse_manifest
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from tests.helpers.corpus import manifest, write_jsonl

ROOT = Path(__file__).resolve().parents[2]

PLAN = """
import json, sys
from tests.helpers.stages import plan_job
plan_job(sys.argv[1])
print(json.dumps(sorted(m for m in ("torch", "transformers", "sentence_transformers") if m in sys.modules)))
"""

OPEN = """
import json, sys
from batchinf.bundles import open_runtime
from batchinf.ledger import jobs
runtime = open_runtime(jobs.get(sys.argv[1]).bundle_digest, device="cpu")
assert runtime.embed([[5, 6, 7]]) is not None
print(json.dumps(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)))
"""


def _child(code: str, job_id: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code, job_id], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_planning_and_bundle_load_import_only_what_they_need(tmp_path: Path, tiny_bundle: str) -> None:
    write_jsonl(tmp_path / "in" / "part-0.jsonl", 50, seed=1)
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in") + "/", str(tmp_path / "out"))), OPERATOR)
    assert _child(PLAN, job_id) == []
    assert _child(OPEN, job_id) == []


def test_the_schema_head_read_without_alembic_is_alembics() -> None:
    from alembic.script import ScriptDirectory

    from batchinf.ledger.db import alembic_config, script_head

    assert script_head() == ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


DECODERS = """
import json, sys
from batchinf.runtime.llama import load_llama
for d in sys.argv[1:]:
    load_llama(d)
print(json.dumps(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)))
"""


def test_building_a_decoder_imports_no_dynamo(tmp_path: Path) -> None:
    """Every decoder family, rope scalings included: its construction on the meta device computes
    nothing there (a meta tensor's arithmetic imports torch._dynamo: 2.4 s a worker on a 2-core
    EPYC, before any weight is read)."""
    from tests.helpers.tiny_llama import make_family_dirs

    dirs = [str(d) for d in make_family_dirs(tmp_path).values()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", DECODERS, *dirs], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []
