"""The transformers fallback end to end through the real `batchinf` command: a tiny DistilBERT
(no native implementation) imported as a bundle, run as an embed job with a prompt, its vectors
equal to sentence-transformers' `encode`, `_MANIFEST.json` naming transformers and its version;
a tiny GPT-NeoX (no native decoder) run as generate jobs: greedy answers equal transformers'
`generate`, a seeded sampled job run twice gives identical rows; and the refusals: remote code
(auto_map, shipped *.py) on an encoder and on a causal LM, and a missing transformers install."""

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
from tests.helpers.tiny_decoders import make_tiny_causal_lm
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


PROMPTS = [f"record {i}: the water of the world and the people in it " * (1 + i % 3) for i in range(12)]


def _generate_job(tmp: Path, name: str, options: dict) -> list[dict]:
    """A generate job of PROMPTS on bundle `gen` through `batchinf run` -> its rows by record."""
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "prompt": t}) + "\n"
                                               for i, t in enumerate(PROMPTS)))
    m = tmp / f"{name}.yaml"
    m.write_text(yaml.safe_dump(manifest(str(tmp / "prompts.jsonl"), str(tmp / name), bundle="gen", name=name,
                                         task="generate", input={"uri": str(tmp / "prompts.jsonl"),
                                                                 "format": "jsonl", "prompt_field": "prompt"},
                                         options={"max_slots": 3, **options}, shards={"max_records": 5})))
    r = bi("run", str(m), "--workers", "1", "--threads", "1")
    assert r.returncode == 0, r.stderr
    return sorted(pq.read_table(tmp / name, ignore_prefixes=["_", "errors"]).to_pylist(),
                  key=lambda row: int(row["record_id"][1:]))


def test_gpt_neox_generates_through_transformers(tmp_path: Path, bi_home: Path) -> None:
    import torch
    import transformers

    d = make_tiny_causal_lm(tmp_path / "neox", "gpt_neox")
    r = bi("bundle", "import", str(d), "--name", "gen")
    assert r.returncode == 0, r.stderr
    rows = _generate_job(tmp_path, "greedy", {"max_tokens": 10})
    assert [row["record_id"] for row in rows] == [f"r{i}" for i in range(len(PROMPTS))]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for row, prompt in zip(rows, PROMPTS):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=0,
                               eos_token_id=eos)[0, len(ids):].tolist()
        want = out[:-1] if out[-1] == eos else out
        assert (row["output_ids"], row["finish_reason"]) == (want, "stop" if out[-1] == eos else "length")
        assert row["input_tokens"] == len(ids)
    done = json.loads((tmp_path / "greedy" / "_MANIFEST.json").read_text())
    assert done["implementation"] == {"name": "transformers", "version": transformers.__version__}
    sampled = {"max_tokens": 12, "temperature": 1.2, "top_p": 0.9, "seed": 7}
    first, second = _generate_job(tmp_path, "s1", sampled), _generate_job(tmp_path, "s2", sampled)
    assert [(x["text"], x["output_ids"], x["seed"]) for x in first] == \
        [(x["text"], x["output_ids"], x["seed"]) for x in second]
    assert [x["output_ids"] for x in first] != [x["output_ids"] for x in rows]


@pytest.mark.parametrize("kind", ["encoder", "causal_lm"])
def test_remote_code_is_refused(tmp_path: Path, bi_home: Path, kind: str) -> None:
    d = make_st_distilbert(tmp_path / "remote") if kind == "encoder" else make_tiny_causal_lm(tmp_path / "remote")
    cfg = json.loads((d / "config.json").read_text())
    auto = "AutoModel" if kind == "encoder" else "AutoModelForCausalLM"
    (d / "config.json").write_text(json.dumps({**cfg, "auto_map": {auto: "modeling_x.XModel"}}))
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
