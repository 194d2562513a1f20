"""The int8 CPU precision (runtime/int8.py): import gate, what the bundle records, loading."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from batchinf import bundles
from batchinf.bundles import import_bundle, list_bundles, open_runtime
from batchinf.errors import BundleError
from batchinf.runtime import int8, int8_linear
from batchinf.runtime.bundle import FIXTURE_TEXTS, read_meta
from tests.helpers.tiny_models import with_activation_outlier

TEXTS = ["a short one", "quick brown fox jumps over the lazy dog " * 3, "batch"]


def _vectors(digest: str, texts: list[str]) -> np.ndarray:
    rt = open_runtime(digest)
    vecs, _ = rt.embed([e.ids for e in rt.tokenizer.encode_batch(texts)])
    return vecs


def test_int8_import_records_precision_and_runs_int8(bi_home: Path, tiny_model_dir: Path) -> None:
    f32 = import_bundle(tiny_model_dir, "tiny", alias="f32").digest
    q = import_bundle(tiny_model_dir, "tiny", alias="int8", precision="int8").digest
    assert q != f32
    meta = read_meta(bundles.local_dir(q))
    assert meta["precision"] == "int8"
    assert meta["precision_gate"]["min_cosine"] == int8.MIN_COSINE <= meta["precision_gate"]["measured"] <= 1.0
    # the fixtures are the float32 reference, unchanged
    assert meta["fixtures"] == read_meta(bundles.local_dir(f32))["fixtures"]
    assert "precision" not in read_meta(bundles.local_dir(f32))

    bundles._loaded.clear()
    rt = open_runtime(q)                  # verified at load against the float32 fixtures
    layer = rt.model.encoder.layer[0]
    assert isinstance(layer.attention.self.int8, int8_linear.Int8Linear) and layer.attention.self.query is None
    assert isinstance(layer.intermediate.dense, int8_linear.Int8Linear)
    got, want = _vectors(q, TEXTS), _vectors(f32, TEXTS)
    assert int8.cosines(got, want).min() >= int8.MIN_COSINE
    assert not np.allclose(got, want, atol=1e-6)      # it really is another computation
    # per-token activation scales: a record's vector does not depend on its batch neighbours
    alone = np.concatenate([_vectors(q, [t]) for t in TEXTS])
    assert int8.cosines(alone, got).min() > 0.99999


def test_int8_import_refused_when_it_drifts_past_the_bound(bi_home: Path, tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    outlier = with_activation_outlier(tiny_model_dir, tmp_path / "outlier")
    import_bundle(outlier, "outlier", alias="f32")            # a fine float32 model
    with pytest.raises(BundleError, match=r"refusing the int8 import: fixture \d .* minimum cosine 0\.\d+ "
                                          r"against float32, below the bound 0\.995") as exc:
        import_bundle(outlier, "outlier", alias="int8", precision="int8")
    got = float(str(exc.value).split("minimum cosine ")[1].split()[0])
    assert got < 0.99      # drifted well past the bound, not a rounding accident
    assert [list(b.aliases) for b in list_bundles()] == [["outlier@f32"]]


def test_int8_load_checks_the_declared_bound(bi_home: Path, tiny_model_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    q = import_bundle(tiny_model_dir, "tiny", precision="int8").digest
    coarse = int8.Scheme(wmax=1, ffn_output=True, needs_vnni=False)     # far worse than the import's
    monkeypatch.setattr(int8, "SCHEMES", {s: coarse for s in int8.SCHEMES})
    bundles._loaded.clear()
    with pytest.raises(BundleError, match=r"model fixture \d .* cosine .* < 0\.995 .*int8, against the float32"):
        open_runtime(q)


def test_int8_scope_cpu_and_native_bert_embedding_only() -> None:
    fixtures = [{"text": "x", "token_ids": [1], "embedding": [1.0]}]
    meta = {"task": "embed", "family": "bert", "fixtures": fixtures}
    int8.check_supported(meta, "cpu")
    with pytest.raises(BundleError, match="int8, a CPU precision; run it with device cpu"):
        int8.check_supported(meta, "cuda")
    for other in ({"task": "generate", "family": "llama", "fixtures": [{"text": "x", "token_ids": [1]}]},
                  {"task": "score", "family": "bert", "fixtures": [{"text": "x", "token_ids": [1], "logits": [0.0]}]},
                  {**meta, "family": "modernbert"}, {**meta, "family": "mpnet", "encoder": "transformers"}):
        with pytest.raises(BundleError, match="import it in float32"):
            int8.check_supported(other, "cpu")


def test_int8_linear_matches_float_linear() -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(48, 40, generator=g), torch.randn(48, generator=g), torch.randn(3, 7, 40, generator=g)
    x[0, 0] *= 50                                  # one loud token: only its own row's scale grows
    r = torch.randn(3, 7, 48, generator=g)
    want = torch.nn.functional.linear(x, w, b)
    # a CPU without VNNI saturates the 8-bit scheme's pair sums: it refuses those bundles (below)
    for scheme in (s for s in int8.SCHEMES.values() if int8.has_vnni() or not s.needs_vnni):
        lin = int8_linear.Int8Linear(w, b, scheme.wmax)
        for got, ref in ((lin(x), want), (lin(x, r), want + r)):   # the residual add fused or not
            assert got.shape == ref.shape
            rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
            assert float(rel.max()) < 0.03, rel
    # 254 steps between a row's extremes: both map inside u8, exactly onto its ends
    lin = int8_linear.Int8Linear(torch.eye(40), None, 127)
    rows = torch.stack([torch.linspace(-3, 5, 40), torch.linspace(0, 1e-3, 40), torch.full((40,), 7.0)])
    assert torch.allclose(lin(rows), rows, atol=float((rows.amax(1) - rows.amin(1)).max()) / 254)


def _layers_in_int8(digest: str) -> list[bool]:
    layer = open_runtime(digest).model.encoder.layer[0]
    return [isinstance(m, int8_linear.Int8Linear) for m in (layer.attention.self.int8, layer.attention.output.int8,
                                                      layer.intermediate.dense, layer.output.int8)]


def test_int8_schemes_recorded_and_pinned(bi_home: Path, tiny_model_dir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    portable = import_bundle(tiny_model_dir, "tiny", alias="avx2", precision="int8", int8_scheme="avx2").digest
    assert read_meta(bundles.local_dir(portable))["int8_scheme"] == "avx2"
    assert _layers_in_int8(portable) == [True, True, True, False]     # the FFN output stays float32
    default = import_bundle(tiny_model_dir, "tiny", alias="best", precision="int8").digest
    assert read_meta(bundles.local_dir(default))["int8_scheme"] == int8.best_scheme()
    if int8.has_vnni():                        # this CPU can run the 8-bit scheme: every projection int8
        vnni = import_bundle(tiny_model_dir, "tiny", alias="vnni", precision="int8", int8_scheme="vnni").digest
        assert vnni == default != portable
        assert _layers_in_int8(vnni) == [True, True, True, True]
        monkeypatch.setattr(int8, "has_vnni", lambda: False)            # a worker without VNNI ...
        bundles._loaded.clear()
        with pytest.raises(BundleError, match="'vnni' scheme .* needs a CPU with AVX-512 VNNI or AVX-VNNI"):
            open_runtime(vnni)                                          # ... refuses it
        assert _layers_in_int8(portable) == [True, True, True, False]  # and runs the portable one
    else:                                      # this CPU would saturate: the import is refused
        with pytest.raises(BundleError, match="needs a CPU with AVX-512 VNNI or AVX-VNNI.*--int8-scheme avx2"):
            import_bundle(tiny_model_dir, "tiny", alias="vnni", precision="int8", int8_scheme="vnni")
    # bundles from before schemes existed are avx2
    assert int8.scheme_of({"precision": "int8"}) == "avx2"


def test_cli_import_precision(bi_home: Path, tiny_model_dir: Path) -> None:
    from batchinf.cli import main

    runner = CliRunner()
    r = runner.invoke(main, ["bundle", "import", str(tiny_model_dir), "--name", "t", "--precision", "int8", "--json"])
    assert r.exit_code == 0, r.output
    assert read_meta(bundles.local_dir(json.loads(r.stdout)["digest"]))["precision"] == "int8"
    r = runner.invoke(main, ["bundle", "import", str(tiny_model_dir), "--name", "t", "--precision", "int4"])
    assert r.exit_code == 2 and "int4" in r.output
    r = runner.invoke(main, ["bundle", "import", str(tiny_model_dir), "--name", "t", "--int8-scheme", "avx2"])
    assert r.exit_code == 2 and "only with --precision int8" in r.output
    r = runner.invoke(main, ["bundle", "import", str(tiny_model_dir), "--name", "t", "--precision", "int8",
                             "--int8-scheme", "avx2", "--json"])
    assert read_meta(bundles.local_dir(json.loads(r.stdout)["digest"]))["int8_scheme"] == "avx2"
    assert len(FIXTURE_TEXTS) == len(read_meta(bundles.local_dir(json.loads(
        runner.invoke(main, ["bundle", "list", "--json"]).stdout)[0]["digest"]))["fixtures"])
