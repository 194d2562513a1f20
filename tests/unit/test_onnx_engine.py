"""The onnxruntime engine: the ONNX export made at bundle import (pinned by the bundle's digest,
checked against the fixtures), its runtimes against native's, the engine a job gets (the bundle's
measured choice, a manifest's override) and the refusals, on tiny generated models."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pyarrow.parquet as pq
import pytest

from batchinf import bundles, engines
from batchinf.bundles import import_bundle, open_runtime
from batchinf.errors import BundleError, ManifestError
from batchinf.ledger import jobs, shards
from batchinf.manifest import parse_manifest
from batchinf.runtime import int8
from batchinf.runtime.bundle import read_meta
from batchinf.planning.sizing import SHARDS_PER_WORKER, min_shard_work
from batchinf.runtime.onnx_bundle import GRAPH, INT8_GRAPH, REFERENCE_SHARDS, faster, reference_tokens
from batchinf.runtime.fixture_checks import cosines
from batchinf.runtime.onnx_encoder import OrtEmbedRuntime
from batchinf.scopes import Caller
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from tests.helpers.stages import plan_job, publish_job
from tests.helpers.tiny_models import ENCODER_TEXTS
from tests.helpers.tiny_st import make_st_bert


def _vectors(digest: str, engine: str, texts: list[str] = ENCODER_TEXTS) -> np.ndarray:
    rt = open_runtime(digest, engine=engine)
    return rt.embed([e.ids for e in rt.tokenizer.encode_batch(texts)])[0]


def _job(tmp_path: Path, name: str, bundle: str, engine: str | None = None, caller: Caller = OPERATOR,
         **options: object) -> str:
    inp = tmp_path / f"{name}.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(ENCODER_TEXTS)))
    raw = {"name": name, "task": "embed", "bundle": bundle, "input": {"uri": str(inp)},
           "output": {"uri": str(tmp_path / "out" / name)}, **({"engine": engine} if engine else {}),
           **({"options": options} if options else {})}
    return submit(parse_manifest(raw), caller)[0]


def test_the_export_is_pinned_by_the_digest_and_computes_what_native_does(bi_home: Path, tmp_path: Path) -> None:
    src = make_st_bert(tmp_path / "st", ["mean"], dense_out=24)        # pooling, Dense and Normalize in the graph
    plain = import_bundle(src, "st", alias="plain").digest
    digest = import_bundle(src, "st", alias="onnx", onnx=True).digest
    meta = read_meta(bundles.local_dir(digest))
    assert digest != plain and "onnx" not in read_meta(bundles.local_dir(plain))
    root = bundles.local_dir(digest)
    assert meta["onnx"]["graph"] == GRAPH and meta["files"][GRAPH] == _sha256(root / GRAPH)
    # ORT's BERT optimizer fused what it recognises: GELU with its bias, the layer norms
    assert meta["onnx"]["fused"].get("BiasGelu") == 2 and meta["onnx"]["fused"].get("LayerNormalization")
    measured = meta["onnx"]["measured"]
    speeds, loads = measured["tokens_per_s"], measured["load_cpu_s"]
    assert speeds["native"] > 0 and speeds["onnxruntime"] > 0
    assert loads["native"] > loads["onnxruntime"] > 0        # a native worker imports PyTorch, an ORT one does not
    assert (engines.declared(meta) == "onnxruntime") == (faster(measured) == "onnxruntime")
    # the fixtures are native's, unchanged by the export
    assert meta["fixtures"] == read_meta(bundles.local_dir(plain))["fixtures"]
    got, want = _vectors(digest, "onnxruntime"), _vectors(digest, "native")
    assert got.shape == want.shape == (len(ENCODER_TEXTS), 24)
    assert cosines(got, want).min() >= 0.9999
    # a record's vector does not depend on the batch (padding beside it)
    alone = np.concatenate([_vectors(digest, "onnxruntime", [t]) for t in ENCODER_TEXTS])
    assert cosines(alone, got).min() >= 0.99999


@pytest.mark.parametrize("pooling", ["cls", "max", "lasttoken"])
def test_every_pooling_mode_runs_in_the_graph(bi_home: Path, tmp_path: Path, pooling: str) -> None:
    digest = import_bundle(make_st_bert(tmp_path / pooling, [pooling]), pooling, onnx=True).digest
    assert cosines(_vectors(digest, "onnxruntime"), _vectors(digest, "native")).min() >= 0.9999


def _sha256(path: Path) -> str:
    from batchinf.digests import sha256_file

    return sha256_file(path)


def test_a_changed_graph_file_is_refused_by_its_digest(bi_home: Path, tiny_model_dir: Path) -> None:
    digest = import_bundle(tiny_model_dir, "tiny", onnx=True).digest
    graph = bundles.local_dir(digest) / GRAPH
    graph.write_bytes(graph.read_bytes()[:-16] + b"\0" * 16)
    bundles._loaded.clear()
    with pytest.raises(BundleError, match="ort/model.onnx"):
        open_runtime(digest, engine="onnxruntime")


def _copy(root: Path, dst: Path) -> Path:
    shutil.copytree(root, dst)
    return dst


def test_a_graph_that_computes_something_else_fails_its_fixtures_at_load(bi_home: Path, tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    import onnx
    from onnx import numpy_helper

    digest = import_bundle(tiny_model_dir, "tiny", onnx=True).digest
    root = _copy(bundles.local_dir(digest), tmp_path / "tampered")
    meta = read_meta(root)
    model = onnx.load(str(root / GRAPH))
    big = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))     # the word embeddings
    w = numpy_helper.to_array(big)
    big.CopyFrom(numpy_helper.from_array(w[::-1].copy(), big.name))
    onnx.save(model, str(root / GRAPH))
    with pytest.raises(BundleError, match=r"onnxruntime fixture \d .* cosine .* < 0\.9999"):
        rt = OrtEmbedRuntime(root, meta)
        rt.verify_fixtures()
    # and a fixture that no longer matches the (intact) graph is refused the same way
    root2 = _copy(bundles.local_dir(digest), tmp_path / "fixture")
    meta2 = read_meta(root2)
    meta2["fixtures"][1]["embedding"] = [-x for x in meta2["fixtures"][1]["embedding"]]
    with pytest.raises(BundleError, match="onnxruntime fixture 1 "):
        OrtEmbedRuntime(root2, meta2).verify_fixtures()


@pytest.mark.parametrize("scheme", [s for s, v in int8.SCHEMES.items() if int8.has_vnni() or not v.needs_vnni])
def test_int8_graph_computes_natives_int8_under_the_int8_gate(bi_home: Path, tiny_model_dir: Path, scheme: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    f32 = import_bundle(tiny_model_dir, "tiny", alias="f32").digest
    native8 = import_bundle(tiny_model_dir, "tiny", alias="native8", precision="int8", int8_scheme=scheme).digest
    q = import_bundle(tiny_model_dir, "tiny", alias="int8", precision="int8", int8_scheme=scheme, onnx=True).digest
    meta = read_meta(bundles.local_dir(q))
    assert meta["precision"] == "int8" and meta["onnx"]["graph"] == INT8_GRAPH and GRAPH not in meta["files"]
    assert "per-token int8" in meta["onnx"]["quantizer"]
    got, ref = _vectors(q, "onnxruntime"), _vectors(f32, "native")
    assert cosines(got, ref).min() >= int8.MIN_COSINE
    assert not np.allclose(got, ref, atol=1e-6)          # it really is another computation
    # ... native's int8 one: per-token u8 activations, per-channel int8 weights (float32's own
    # rounding differences can move a value across a quantisation step, hence not bit-equal)
    assert cosines(got, _vectors(native8, "native")).min() >= 0.9999
    ops = [n.op_type for n in onnx.load(str(bundles.local_dir(q) / INT8_GRAPH)).graph.node]
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    # each layer's QKV, attention output, FFN input and (vnni only) FFN output projections
    assert ops.count("MatMulIntegerToFloat") == layers * (4 if scheme == "vnni" else 3)
    assert "DynamicQuantizeMatMul" not in ops
    # the load check holds the int8 graph to the gate's bound, not float32's
    strict = {**meta, "precision_gate": {**meta["precision_gate"], "min_cosine": 1.000001}}
    with pytest.raises(BundleError, match=r"onnxruntime fixture \d .* < 1\.000001"):
        OrtEmbedRuntime(bundles.local_dir(q), strict).verify_fixtures()
    if scheme == "vnni":       # as native: a CPU without VNNI refuses the 8-bit weights (MLAS would saturate)
        monkeypatch.setattr(int8, "has_vnni", lambda: False)
        with pytest.raises(BundleError, match="'vnni' scheme .* needs a CPU with AVX-512 VNNI or AVX-VNNI"):
            OrtEmbedRuntime(bundles.local_dir(q), meta).load_model()


def test_a_job_runs_on_onnxruntime_and_writes_natives_vectors(bi_home: Path, tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    from batchinf.execute import execute_shard
    from batchinf.ledger import leases

    import_bundle(tiny_model_dir, "tiny", alias="prod", onnx=True)
    out = {}
    for engine in ("onnxruntime", "native"):
        job_id = _job(tmp_path, engine, "tiny@prod", engine)
        assert jobs.get(job_id).engine == engine
        plan_job(job_id)
        shards.dispatch_ready(job_id)
        while (lease := leases.claim_next([job_id], "t:1", 30, None, (engine,), ("any", "cpu"))) is not None:
            execute_shard(lease)
        assert shards.verify_when_done(job_id)
        manifest = publish_job(job_id)
        assert manifest["counts"]["records_succeeded"] == len(ENCODER_TEXTS)
        t = pq.read_table(tmp_path / "out" / engine, ignore_prefixes=["_", "errors"]).sort_by("record_id")
        out[engine] = np.asarray(t.column("embedding").to_pylist(), dtype=np.float32)
    assert cosines(out["onnxruntime"], out["native"]).min() >= 0.9999


def test_the_engine_a_job_gets_and_the_refusals(bi_home: Path, tiny_model_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import_bundle(tiny_model_dir, "tiny", alias="plain")
    with pytest.raises(ManifestError, match=r"needs a bundle with an ONNX export; .*--onnx"):
        _job(tmp_path, "no-export", "tiny@plain", "onnxruntime")
    meta = read_meta(bundles.local_dir(import_bundle(tiny_model_dir, "tiny", alias="onnx", onnx=True).digest))
    assert engines.job_engine("native", meta, "embed", "tiny@onnx") == "native"
    assert engines.job_engine("onnxruntime", meta, "embed", "tiny@onnx") == "onnxruntime"
    assert engines.job_device("auto", meta, "onnxruntime", "tiny@onnx") == "cpu"
    chosen = {**meta, "engine": {"name": "onnxruntime"}}           # what a bundle measured faster declares
    assert engines.job_engine(None, chosen, "embed", "tiny@onnx") == "onnxruntime"
    assert engines.job_engine(None, {k: v for k, v in meta.items() if k != "engine"}, "embed", "x") == "native"
    assert engines.job_engine(None, chosen, "embed", "tiny@onnx", "cuda") == "native"   # a CUDA job: native's
    with pytest.raises(ManifestError, match="engine onnxruntime runs on CPU"):
        engines.job_engine("onnxruntime", meta, "embed", "tiny@onnx", "cuda")
    with pytest.raises(ManifestError, match="engine onnxruntime runs task embed, score, classify, not generate"):
        engines.job_engine("onnxruntime", meta, "generate", "tiny@onnx")
    job_id = _job(tmp_path, "override", "tiny@onnx", "native")
    assert jobs.get(job_id).engine == "native"
    # without ONNX Runtime here: a job naming it is refused with the fix, a bundle's choice falls back to native
    monkeypatch.setitem(engines.PACKAGES, "onnxruntime", ("batchinf_no_such_package", "pip install 'batchinf[onnx]'"))
    with pytest.raises(ManifestError, match=r"needs the batchinf_no_such_package package.*batchinf\[onnx\]"):
        engines.job_engine("onnxruntime", meta, "embed", "tiny@onnx")
    assert engines.job_engine(None, chosen, "embed", "tiny@onnx") == "native"


def test_the_export_is_refused_for_what_the_engine_does_not_run(bi_home: Path, tmp_path: Path) -> None:
    from tests.helpers.tiny_llama import make_tiny_llama

    with pytest.raises(BundleError, match="the onnxruntime engine runs embed, score, classify bundles, not generate"):
        import_bundle(make_tiny_llama(tmp_path / "llama"), "llama", onnx=True)


@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_an_embed_worker_on_onnxruntime_never_imports_torch(bi_home: Path, tiny_model_dir: Path,
                                                            precision: str) -> None:
    digest = import_bundle(tiny_model_dir, "tiny", onnx=True, precision=precision, int8_scheme="avx2").digest
    code = ("import sys\nfrom batchinf.bundles import open_runtime\n"
            f"rt = open_runtime({digest!r}, engine='onnxruntime')\n"
            "rt.embed([rt.tokenizer.encode('hello world').ids])\n"
            "print('torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"


def test_the_engine_chosen_computes_a_reference_share_sooner_load_included() -> None:
    """ORT a little slower a token but two CPU-seconds lighter to load wins a worker's share of the
    reference job; far slower, or the reference far larger, native wins."""
    m = {"tokens_per_s": {"native": 4400, "onnxruntime": 4200}, "load_cpu_s": {"native": 2.6, "onnxruntime": 0.6},
         "reference_tokens": reference_tokens()}
    assert REFERENCE_SHARDS == SHARDS_PER_WORKER and reference_tokens() == SHARDS_PER_WORKER * min_shard_work()
    assert faster(m) == "onnxruntime"
    assert faster({**m, "tokens_per_s": {"native": 4400, "onnxruntime": 2000}}) == "native"
    assert faster({**m, "reference_tokens": 10_000_000}) == "native"
    assert faster({**m, "load_cpu_s": {"native": 0.6, "onnxruntime": 0.6}}) == "native"


def test_a_job_on_onnxruntime_passes_the_same_grants(bi_home: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The engine changes what computes, not what a tenant may read or write: a tenant without
    grants is refused at job creation, and one granted elsewhere cannot read this input."""
    from batchinf import scopes

    import_bundle(tiny_model_dir, "tiny", alias="onnx", onnx=True)
    with pytest.raises(ManifestError, match="batchinf tenant grant drifter --read PREFIX"):
        _job(tmp_path, "ungranted", "tiny@onnx", "onnxruntime", Caller("drifter"))
    scopes.grant("drifter", read=[str(tmp_path / "elsewhere")], write=[str(tmp_path / "out")])
    with pytest.raises(ManifestError, match="outside the prefixes tenant 'drifter' may"):
        _job(tmp_path, "outside", "tiny@onnx", "onnxruntime", Caller("drifter"))


def test_int8_graph_with_a_dense_head_computes_natives_int8(bi_home: Path, tmp_path: Path) -> None:
    src = make_st_bert(tmp_path / "m", ["cls"], dense_out=24)
    native8 = import_bundle(src, "m", alias="native8", precision="int8", int8_scheme="avx2").digest
    q = import_bundle(src, "m", alias="ort8", precision="int8", int8_scheme="avx2", onnx=True).digest
    texts = ["int8 on another family", "a second, longer sentence to embed with the same bundle"]
    assert cosines(_vectors(q, "onnxruntime", texts), _vectors(native8, "native", texts)).min() >= 0.9999
    ops = [n.op_type for n in onnx.load(str(bundles.local_dir(q) / INT8_GRAPH)).graph.node]
    assert ops.count("MatMulIntegerToFloat") >= 3      # the layers' projections, not the Dense head
