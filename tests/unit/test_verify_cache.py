"""A bundle file verified once on a machine is not re-hashed by the next process, and any change
to it (even one that restores its size and mtime) is hashed again and refused."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from batchinf import digests


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = digests.sha256_file

    def counting(path: str | os.PathLike[str]) -> str:
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(digests, "sha256_file", counting)
    monkeypatch.setattr(digests, "RACY_SECONDS", 0.0)
    return calls


def test_a_verified_file_is_not_hashed_again(tmp_path: Path, counted: list[str]) -> None:
    f, cache = tmp_path / "model.safetensors", tmp_path / "cache"
    f.write_bytes(b"weights" * 1000)
    time.sleep(0.05)
    want = digests.sha256_file(f)
    assert digests.sha256_file_cached(f, cache) == want
    assert digests.sha256_file_cached(f, cache) == want
    assert counted == [str(f), str(f)]          # the explicit hash and the first cached call only


def test_a_change_that_restores_size_and_mtime_is_hashed_again(tmp_path: Path, counted: list[str]) -> None:
    f, cache = tmp_path / "model.safetensors", tmp_path / "cache"
    f.write_bytes(b"A" * 4096)
    time.sleep(0.05)
    first = digests.sha256_file_cached(f, cache)
    st = os.stat(f)
    time.sleep(0.05)
    f.write_bytes(b"B" * 4096)                  # same size ...
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))   # ... and the old mtime back
    assert digests.sha256_file_cached(f, cache) != first
    assert len(counted) == 2


def test_a_file_changed_just_now_is_not_remembered(tmp_path: Path, counted: list[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digests, "RACY_SECONDS", 60.0)
    f, cache = tmp_path / "model.safetensors", tmp_path / "cache"
    f.write_bytes(b"fresh")
    digests.sha256_file_cached(f, cache)
    digests.sha256_file_cached(f, cache)
    assert len(counted) == 2 and not list(cache.glob("*.json"))


def test_a_corrupt_cache_entry_just_hashes_again(tmp_path: Path, counted: list[str]) -> None:
    f, cache = tmp_path / "model.safetensors", tmp_path / "cache"
    f.write_bytes(b"x" * 10)
    time.sleep(0.05)
    digests.sha256_file_cached(f, cache)
    for entry in cache.glob("*.json"):
        entry.write_text("{not json")
    assert digests.sha256_file_cached(f, cache) == digests.sha256_file(f)
