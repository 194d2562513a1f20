"""Hostile model files: crafted GGUF headers are BundleErrors that say what is wrong (never a raw
ValueError, ZeroDivisionError or a wrapped-around size); `bundle import` does not follow symlinks
out of the model directory; the bundle cache verifies bundle.json against the ledger's digest
before it uses any file name in it, and never writes outside the bundle directory."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from batchinf.errors import BundleError
from batchinf.runtime import bundle as rb
from batchinf.runtime.gguf import GGUFFile, convert_gguf


def _s(text: str | bytes, n: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if n is None else n) + raw


def _kv_u32(key: str, value: int) -> bytes:
    return _s(key) + struct.pack("<I", 4) + struct.pack("<I", value)


def _gguf(kvs: list[bytes] = (), tensors: list[bytes] = (), *, n_kv: int | None = None,
          n_tensors: int | None = None, tail: bytes = b"\0" * 64) -> bytes:
    head = b"GGUF" + struct.pack("<I", 3)
    head += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    return head + b"".join(kvs) + b"".join(tensors) + tail


def _tensor(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    return (_s(name) + struct.pack("<I", len(dims) if n_dims is None else n_dims)
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ggml_type, offset))


CRAFTED = {
    "empty file": (b"", "cannot read GGUF file"),
    "not gguf": (b"PK\x03\x04" + b"\0" * 60, "is not a GGUF file"),
    "2**63 metadata entries": (_gguf(n_kv=1 << 63), "claims 9223372036854775808 metadata entries"),
    "2**40 tensors": (_gguf(n_tensors=1 << 40), "tensor infos"),
    "a 2**60-byte key": (_gguf([_s("k", 1 << 60)], n_kv=1), "bytes of string"),
    "a 2**62-item array": (_gguf([_s("a") + struct.pack("<IIQ", 9, 5, 1 << 62)]), "array items"),
    "a 2**62-item string array": (_gguf([_s("a") + struct.pack("<IIQ", 9, 8, 1 << 62)]), "array items"),
    "arrays nested 1000 deep": (_gguf([_s("a") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) * 1000]),
                                "nested deeper"),
    "unknown value type": (_gguf([_s("a") + struct.pack("<I", 77)]), "unknown GGUF metadata value type 77"),
    "alignment 0": (_gguf([_kv_u32("general.alignment", 0)]), "general.alignment 0"),
    "alignment 3": (_gguf([_kv_u32("general.alignment", 3)]), "general.alignment 3"),
    "100 dims": (_gguf(tensors=[_tensor("t", [2], n_dims=100)]), "has 100 dimensions"),
    "a zero dim": (_gguf(tensors=[_tensor("t", [4, 0])]), "empty dimension"),
    "dims whose numpy product wraps to 0": (_gguf(tensors=[_tensor("t", [1 << 32, 1 << 32])]), "runs past the end"),
    "a tensor past the end": (_gguf(tensors=[_tensor("t", [64, 64])]), "runs past the end"),
    "an offset past the end": (_gguf(tensors=[_tensor("t", [4], offset=1 << 62)]), "runs past the end"),
    "a cut header": (_gguf([_kv_u32("general.alignment", 32)], tail=b"")[:-2], "truncated or corrupt"),
}


@pytest.mark.parametrize("data, says", CRAFTED.values(), ids=CRAFTED.keys())
def test_crafted_gguf_headers_are_bundle_errors_that_say_what_is_wrong(tmp_path: Path, data: bytes, says: str) -> None:
    path = tmp_path / "crafted.gguf"
    path.write_bytes(data)
    with pytest.raises(BundleError, match=says) as exc:
        GGUFFile(path).close()
    assert str(path) in str(exc.value)


def test_malformed_metadata_is_a_bundle_error_at_conversion(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    arch = _s("general.architecture") + struct.pack("<I", 8) + _s("llama")
    many = _s("llama.block_count") + struct.pack("<I", 8) + _s("many")       # a string where a count belongs
    path.write_bytes(_gguf([arch, _kv_u32("llama.attention.head_count", 4), many]))
    with pytest.raises(BundleError, match="m.gguf: malformed GGUF model") as exc:
        convert_gguf(path, tmp_path / "out")
    assert not isinstance(exc.value.__cause__, BundleError)


def test_a_good_header_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "ok.gguf"
    path.write_bytes(_gguf([_kv_u32("general.alignment", 32)], [_tensor("t", [4, 2])], tail=b"\0" * 128))
    with GGUFFile(path) as g:
        assert g.metadata == {"general.alignment": 32} and g.tensor("t").shape == (2, 4)


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "a/../../x", "a\\..\\x", "", "bundle.json", 7])
def test_bundle_file_names_that_leave_the_directory_are_refused(tmp_path: Path, name: object) -> None:
    with pytest.raises(BundleError, match="refusing file name"):
        rb.file_path(tmp_path, name)
    assert rb.file_path(tmp_path, "sub/model.safetensors") == tmp_path / "sub/model.safetensors"


def test_import_refuses_symlinks_out_of_the_model_directory(tmp_path: Path, bi_home: Path,
                                                           tiny_model_dir: Path) -> None:
    from batchinf.bundles import import_bundle, local_dir

    secret = tmp_path / "secret.txt"
    secret.write_text("not a model file")
    os.symlink(secret, tiny_model_dir / "notes.txt")
    with pytest.raises(BundleError, match="refusing notes.txt: it is a symlink to .*secret.txt, outside"):
        import_bundle(tiny_model_dir, "tiny")
    # a link that stays inside the directory is read like the file it names
    (tiny_model_dir / "notes.txt").unlink()
    (tiny_model_dir / "blobs").mkdir()
    (tiny_model_dir / "blobs" / "n").write_text("inside")
    os.symlink(tiny_model_dir / "blobs" / "n", tiny_model_dir / "notes.txt")
    info = import_bundle(tiny_model_dir, "tiny")
    stored = local_dir(info.digest)
    assert {"notes.txt", "blobs/n"} <= set(rb.read_meta(stored)["files"])
    assert not (stored / "notes.txt").is_symlink() and (stored / "notes.txt").read_text() == "inside"


def test_the_bundle_cache_checks_the_digest_before_it_uses_a_name(tmp_path: Path, bi_home: Path, s3_bucket: str,
                                                                tiny_model_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf import bundles
    from batchinf.config import settings
    from batchinf.ledger import registry
    from batchinf.store import get_store, join

    monkeypatch.setenv("BATCHINF_BUNDLE_STORE", f"{s3_bucket}/bundles/")
    settings.cache_clear()
    info = bundles.import_bundle(tiny_model_dir, "tiny")
    store = get_store(info.uri)
    meta = json.loads(store.get_bytes(join(info.uri, "bundle.json")))
    escape = bi_home / "escaped.txt"
    depth = len((settings().home / "cache" / "bundles" / "x").relative_to(bi_home).parts)
    evil = dict(meta, files={**meta["files"], "../" * depth + "escaped.txt": "0" * 64})
    store.put_bytes(join(info.uri, "bundle.json"), json.dumps(evil).encode())    # tampered in the store
    with pytest.raises(BundleError, match="does not match digest"):
        bundles.local_dir(info.digest)
    assert not escape.exists()

    # even a ledger row that names such a bundle.json (its own digest) gets no file written outside
    digest = rb.digest_of(evil)
    registry.add(digest, "evil", info.uri, "embed", "bert", json.dumps(evil), None)
    with pytest.raises(BundleError, match="refusing file name"):
        bundles.local_dir(digest)
    assert not escape.exists()

    store.put_bytes(join(info.uri, "bundle.json"), json.dumps(meta).encode())     # restored: it loads
    assert (bundles.local_dir(info.digest) / "config.json").is_file()
