"""The transformers fallback end to end through the real `batchinf` command: a tiny DistilBERT
(no native implementation) imported as a bundle, run as an embed job with a prompt, its vectors
equal to sentence-transformers' `encode`, `_MANIFEST.json` naming transformers and its version;
and the refusals: remote code (auto_map, shipped *.py) and a missing transformers install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from tests.helpers.corpus import manifest
from tests.helpers.tiny_st import make_st_distilbert

pytestmark = pytest.mark.integration


def bi(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    head = ["-c", code] if code else ["-m", "batchinf.cli"]
    return subprocess.run([sys.executable, *head, *args], env=dict(os.environ), capture_output=True, text=True,
                          timeout=300)


def test_distilbert_runs_through_transformers(tmp_path: Path, bi_home: Path) -> None:
    import transformers
    from sentence_transformers import SentenceTransformer

    d = make_st_distilbert(tmp_path / "distilbert")
    r = bi("bundle", "import", str(d), "--name", "mb")
    assert r.returncode == 0, r.stderr
    texts = [f"record {i}: the water of the world and the people in it " * (1 + i % 4) for i in range(40)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n"
                                               for i, t in enumerate(texts)))
    m = tmp_path / "m.yaml"
    m.write_text(yaml.safe_dump(manifest(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), bundle="mb",
                                         options={"prompt_name": "query", "max_batch_tokens": 256},
                                         shards={"max_records": 16})))
    r = bi("run", str(m), "--workers", "1", "--threads", "1")
    assert r.returncode == 0, r.stderr
    rows = sorted(pq.read_table(tmp_path / "out", ignore_prefixes=["_", "errors"]).to_pylist(),
                  key=lambda row: int(row["record_id"][1:]))
    got = np.array([row["embedding"] for row in rows], dtype=np.float32)
    want = SentenceTransformer(str(d), device="cpu").encode(texts, prompt_name="query", batch_size=8)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5
    done = json.loads((tmp_path / "out" / "_MANIFEST.json").read_text())
    assert done["implementation"] == {"name": "transformers", "version": transformers.__version__}


def test_remote_code_is_refused(tmp_path: Path, bi_home: Path) -> None:
    d = make_st_distilbert(tmp_path / "remote")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModel": "modeling_x.XModel"}}))
    r = bi("bundle", "import", str(d), "--name", "remote")
    assert r.returncode != 0 and "remote code" in r.stderr and "auto_map" in r.stderr, r.stderr
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "modeling_x.py").write_text("raise SystemExit('remote code ran')\n")
    r = bi("bundle", "import", str(d), "--name", "remote")
    assert r.returncode != 0 and "modeling_x.py" in r.stderr and "remote code ran" not in r.stderr + r.stdout


def test_missing_transformers_names_the_install(tmp_path: Path, bi_home: Path) -> None:
    d = make_st_distilbert(tmp_path / "mb")
    code = "import sys; sys.modules['transformers'] = None; from batchinf.cli import main; main()"
    r = bi("bundle", "import", str(d), "--name", "mb", code=code)
    assert r.returncode != 0 and "pip install transformers" in r.stderr and "Traceback" not in r.stderr, r.stderr
