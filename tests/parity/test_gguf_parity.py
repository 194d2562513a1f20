"""Our GGUF reader against the `gguf` package (test-only, the reference implementation): metadata,
and every tensor type we dequantise."""

from __future__ import annotations

import struct
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from batchinf.errors import BundleError
from batchinf.runtime import gguf_quants
from batchinf.runtime.gguf import GGML_TYPES, SUPPORTED_GGUF_TYPES, GGUFFile

pytestmark = pytest.mark.parity

TYPE_NAMES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]   # gguf can quantise these
# The K-quants and IQ4s have no quantiser in gguf: their blocks are random bytes, every bit pattern
# of scales and quants (NaN and infinite scales included) dequantised by both.
RAW_NAMES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


@pytest.fixture(scope="module")
def gguf() -> ModuleType:
    """The `gguf` package: a test-only dependency (batchinf itself never imports it), imported here
    rather than at the top so that collecting the suite imports no reference implementation."""
    import gguf

    return gguf


def _write(gguf: ModuleType, path: Path, tensors: dict[str, tuple[np.ndarray, object]],
           **meta: object) -> dict[str, np.ndarray]:
    """Write a GGUF file with gguf's writer; returns gguf's own dequantisation of each tensor."""
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in meta.items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_array(k, v)
    want = {}
    for name, (x, qtype) in tensors.items():
        q = gguf.quants.quantize(x, qtype)
        w.add_tensor(name, q, raw_dtype=qtype)      # q: floats, or a uint8 byte layout for the rest
        want[name] = gguf.quants.dequantize(q, qtype).reshape(x.shape).astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return want


def _write_raw(gguf: ModuleType, path: Path, tensors: dict[str, tuple[np.ndarray, object]]) -> None:
    """A GGUF file of raw blocks (uint8 [rows, bytes]) of the given ggml types."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (raw, qtype) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_reader_matches_gguf_package(gguf: ModuleType, tmp_path: Path) -> None:
    Q = gguf.GGMLQuantizationType
    TYPES = [Q[name] for name in TYPE_NAMES]
    rng = np.random.default_rng(0)
    tensors = {f"t.{t.name}": (rng.normal(size=(6, 64)).astype(np.float32) * 3, t) for t in TYPES}
    meta = {"general.name": "tiny ünïcode", "x.count": 7, "x.eps": 1e-5, "x.flag": True, "x.ids": [3, 1, 2],
            "x.words": ["a", "b c", "ü"]}
    path = tmp_path / "t.gguf"
    want = _write(gguf, path, tensors, **meta)
    with GGUFFile(path) as g:
        assert g.version == 3
        for k, v in meta.items():
            assert g.metadata[k] == pytest.approx(v) if isinstance(v, float) else g.metadata[k] == v, k
        for name, w in want.items():
            got = g.tensor(name)
            assert got.shape == (6, 64) and got.dtype == np.float32
            np.testing.assert_array_equal(got, w, err_msg=name)
            if "Q" in name:                  # quantised for real: lossy, not the input itself
                assert not np.array_equal(got, tensors[name][0])
    assert {t.value for t in TYPES} <= set(GGML_TYPES)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # NaN and infinite scales, on purpose
def test_every_block_layout_matches_gguf_bit_for_bit(gguf: ModuleType, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_quants, "CHUNK_ELEMENTS", 1000)    # several chunks and a partial last one
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(1)
    path = tmp_path / "raw.gguf"
    blocks = {f"t.{name}": (rng.integers(0, 256, size=(5, 6 * gguf.GGML_QUANT_SIZES[Q[name]][1]), dtype=np.uint8),
                            Q[name]) for name in RAW_NAMES + TYPE_NAMES[3:]}     # 5 rows of 6 blocks
    _write_raw(gguf, path, blocks)
    want = {n: gguf.quants.dequantize(raw, qt).astype(np.float32) for n, (raw, qt) in blocks.items()}
    with GGUFFile(path) as g:
        for name, ref in want.items():
            got = g.tensor(name)
            assert got.shape == ref.shape and got.dtype == np.float32
            np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32), err_msg=name)
    assert set(RAW_NAMES + TYPE_NAMES) == set(SUPPORTED_GGUF_TYPES)


def test_unsupported_type_and_bad_files_are_clear_errors(gguf: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "iq2.gguf"
    _write_raw(gguf, path, {"blk.0.attn_q.weight": (np.zeros((2, 66), np.uint8), gguf.GGMLQuantizationType.IQ2_XXS)})
    with GGUFFile(path) as g, pytest.raises(BundleError, match=r"blk\.0\.attn_q\.weight has ggml type 16.*Q6_K"):
        g.tensor("blk.0.attn_q.weight")
    # a K-quant tensor whose rows (128) are shorter than its block (256), the element count unchanged
    kq = tmp_path / "rows.gguf"
    _write_raw(gguf, kq, {"t": (np.zeros((2, 144), np.uint8), gguf.GGMLQuantizationType.Q4_K)})
    raw = kq.read_bytes()
    dims = struct.pack("<IQQ", 2, 256, 2)
    assert raw.count(dims) == 1
    kq.write_bytes(raw.replace(dims, struct.pack("<IQQ", 2, 128, 4)))
    with pytest.raises(BundleError, match="rows of 128 elements, not a multiple of its type's block of 256"):
        GGUFFile(kq)
    (tmp_path / "short.gguf").write_bytes(path.read_bytes()[:40])
    with pytest.raises(BundleError, match="truncated or corrupt"):
        GGUFFile(tmp_path / "short.gguf")
