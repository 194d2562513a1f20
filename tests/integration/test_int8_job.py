"""An int8 job end to end on the real all-MiniLM-L6-v2: `batchinf bundle import --precision int8`
passes its gate, `batchinf run` embeds with it, the output records the precision, and the vectors
stay within the declared bound of the float32 job's."""

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

from tests.helpers.corpus import manifest, write_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def bi(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env=dict(os.environ),
                          capture_output=True, text=True, timeout=600)


def _run(tmp_path: Path, precision: str, bundle: str) -> tuple[dict, np.ndarray]:
    out = tmp_path / f"out-{precision}"
    m = tmp_path / f"{precision}.yaml"
    m.write_text(yaml.safe_dump(manifest(str(tmp_path / "in.jsonl"), str(out), bundle=bundle,
                                         shards={"max_records": 100}, options={"device": "cpu"})))
    r = bi("run", str(m), "--json", "--workers", "1", "--threads", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["status"] == "succeeded"
    rows = sorted(pq.read_table(out, ignore_prefixes=["_", "errors"]).to_pylist(), key=lambda r: r["ordinal"])
    return json.loads((out / "_MANIFEST.json").read_text()), np.asarray([r["embedding"] for r in rows])


def test_int8_job_end_to_end(tmp_path: Path, bi_home: Path, minilm_dir: Path) -> None:
    for precision in ("float32", "int8"):
        r = bi("bundle", "import", str(minilm_dir), "--name", "minilm", "--alias", precision,
               "--precision", precision, "--json")
        assert r.returncode == 0, r.stderr[-2000:]
    write_jsonl(tmp_path / "in.jsonl", 300, seed=3)

    f32_manifest, f32 = _run(tmp_path, "float32", "minilm@float32")
    q_manifest, q = _run(tmp_path, "int8", "minilm@int8")
    assert (f32_manifest["precision"], q_manifest["precision"]) == ("float32", "int8")
    assert q_manifest["counts"] == f32_manifest["counts"] and q_manifest["counts"]["records_succeeded"] == 300
    cos = (q * f32).sum(1) / np.linalg.norm(q, axis=1) / np.linalg.norm(f32, axis=1)
    assert cos.min() >= 0.995, f"record {int(cos.argmin())}: cosine {cos.min()}"
    assert cos.max() < 1 - 1e-6        # the int8 job really ran int8
    assert bi("verify", q_manifest["job_id"], "--json").returncode == 0
