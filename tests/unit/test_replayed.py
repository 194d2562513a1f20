"""Fixture replays remembered per machine (engines/replayed.py): a second load of the same bundle
under the same software skips the replay; anything the result depends on replays it again; a
failed replay is never remembered; `bundle verify` and openai-http always replay. Input checks
(tokenizer fixtures) likewise, apart from the model's replays."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchinf import bundles, engines
from batchinf.bundles import import_bundle, open_runtime, verify_bundle
from batchinf.engines import replayed
from batchinf.errors import BundleError


def _counting(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> list[str]:
    calls: list[str] = []
    real = engines.verify_model

    def verify(task, runtime):  # type: ignore[no-untyped-def]
        calls.append(runtime.meta["task"])
        if fail:
            raise BundleError("model fixture 0 no longer gives its recorded embedding")
        real(task, runtime)

    monkeypatch.setattr(engines, "verify_model", verify)
    return calls


def _fresh_load(digest: str) -> None:
    bundles._loaded.clear()         # a new worker process: nothing loaded yet
    open_runtime(digest)


def test_a_second_load_under_the_same_software_skips_the_replay(bi_home: Path, tiny_model_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    digest = import_bundle(tiny_model_dir, "tiny").digest
    calls = _counting(monkeypatch)
    _fresh_load(digest)
    _fresh_load(digest)
    assert calls == ["embed"]
    assert len(list((bi_home / "cache" / "replayed").iterdir())) == 1
    # what the result depends on changes: the next load replays
    monkeypatch.setattr(replayed, "_libraries", lambda: {"torch": "99.0"})
    _fresh_load(digest)
    monkeypatch.setattr(replayed, "cpu_stamp", lambda: "another CPU: flags avx2")
    _fresh_load(digest)
    replayed._code_stamp.cache_clear()
    monkeypatch.setattr(replayed, "_code_stamp", lambda: "batchinf's code edited")
    _fresh_load(digest)
    assert calls == ["embed"] * 4
    # `bundle verify` replays whatever is remembered
    verify_bundle(digest)
    assert len(calls) == 5


def test_the_key_covers_the_bundle_engine_and_device() -> None:
    base = replayed.key("sha256:" + "a" * 64, "native", "cpu")
    assert base == replayed.key("sha256:" + "a" * 64, "native", "cpu")
    assert len({base, replayed.key("sha256:" + "b" * 64, "native", "cpu"),
                replayed.key("sha256:" + "a" * 64, "onnxruntime", "cpu"),
                replayed.key("sha256:" + "a" * 64, "native", "cuda:0")}) == 4


def test_a_failed_replay_is_not_remembered(bi_home: Path, tiny_model_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    digest = import_bundle(tiny_model_dir, "tiny").digest
    calls = _counting(monkeypatch, fail=True)
    for _ in range(2):
        bundles._loaded.clear()
        with pytest.raises(BundleError, match="fixture 0"):
            open_runtime(digest)
    assert len(calls) == 2 and not (bi_home / "cache" / "replayed").exists()


def test_an_http_engine_is_always_replayed(tmp_path: Path) -> None:
    ran: list[int] = []
    for _ in range(2):
        assert replayed.replay_once(lambda: ran.append(1), "sha256:" + "c" * 64, "openai-http", "cpu", tmp_path)
    assert ran == [1, 1] and not any(tmp_path.iterdir())
    assert replayed.replay_once(lambda: ran.append(2), "sha256:" + "c" * 64, "native", "cpu", tmp_path)
    assert not replayed.replay_once(lambda: ran.append(3), "sha256:" + "c" * 64, "native", "cpu", tmp_path)
    assert ran == [1, 1, 2]


def test_input_checks_are_remembered_apart_and_a_failed_one_refuses_every_load(
        bi_home: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.tasks import base

    digest = import_bundle(tiny_model_dir, "tiny").digest
    checked: list[bool] = []
    real = base.Task.verify_inputs
    drift = False

    def verify_inputs(self, runtime):  # type: ignore[no-untyped-def]
        checked.append(True)
        if drift:
            raise BundleError("tokenizer fixture 0 no longer gives its recorded ids")
        real(self, runtime)

    monkeypatch.setattr(base.Task, "verify_inputs", verify_inputs)
    bundles._loaded.clear()
    open_runtime(digest, with_model=False)      # planning: checks the inputs
    bundles._loaded.clear()
    open_runtime(digest, with_model=False)      # remembered
    assert len(checked) == 1
    assert len(list((bi_home / "cache" / "inputs-checked").iterdir())) == 1
    verify_bundle(digest)                       # `bundle verify` checks whatever is remembered
    assert len(checked) == 2
    # a check that fails is never remembered: another machine state (here, new code) refuses each load
    replayed._code_stamp.cache_clear()
    monkeypatch.setattr(replayed, "_code_stamp", lambda: "batchinf's code edited")
    drift = True
    for _ in range(2):
        bundles._loaded.clear()
        with pytest.raises(BundleError, match="tokenizer fixture 0"):
            open_runtime(digest, with_model=False)
    assert len(checked) == 4 and len(list((bi_home / "cache" / "inputs-checked").iterdir())) == 1
