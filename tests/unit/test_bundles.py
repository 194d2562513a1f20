"""Bundle import, content digests, reference resolution, load-time verification and the CLI."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchinf import bundles
from tests.helpers.env import OPERATOR
from batchinf.bundles import (
    get_info,
    import_bundle,
    list_bundles,
    local_dir,
    open_runtime,
    resolve_ref,
    set_alias,
    verify_bundle,
)
from batchinf.errors import BundleError
from batchinf.runtime.bundle import FIXTURE_TEXTS, digest_of
from batchinf.runtime.embed import EmbedRuntime
from batchinf.runtime.tokenizer import Encoded, TextTokenizer


def _stored_dir(home: Path, digest: str) -> Path:
    return home / "bundles" / digest.removeprefix("sha256:")


def _fresh_open(digest: str) -> None:
    bundles._loaded.clear()
    open_runtime(digest)


# --- import ----------------------------------------------------------------------------------------


def test_import_digest_is_digest_of_stored_bundle_json(bi_home: Path, tiny_model_dir: Path) -> None:
    info = import_bundle(tiny_model_dir, "tiny")
    assert info.digest.startswith("sha256:")
    hexpart = info.digest.removeprefix("sha256:")
    assert len(hexpart) == 64 and all(c in "0123456789abcdef" for c in hexpart)

    stored = _stored_dir(bi_home, info.digest)
    meta = json.loads((stored / "bundle.json").read_text())
    assert digest_of(meta) == info.digest
    assert local_dir(info.digest) == stored
    assert info.name == "tiny" and info.task == "embed" and info.family == "bert"

    src_files = sorted(str(p.relative_to(tiny_model_dir)) for p in tiny_model_dir.rglob("*") if p.is_file())
    assert sorted(meta["files"]) == src_files
    assert "1_Pooling/config.json" in meta["files"]
    for name, sha in meta["files"].items():
        assert sha == hashlib.sha256((tiny_model_dir / name).read_bytes()).hexdigest()
        assert (stored / name).read_bytes() == (tiny_model_dir / name).read_bytes()

    assert meta["task"] == "embed"
    assert meta["family"] == "bert"
    assert meta["max_length"] == 128          # sentence_bert_config max_seq_length of the tiny model
    assert meta["pooling"] == "mean"
    assert meta["normalize"] is True
    assert meta["special_tokens"] == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}

    fixtures = meta["fixtures"]
    assert [fx["text"] for fx in fixtures] == FIXTURE_TEXTS
    tok = TextTokenizer.from_file(tiny_model_dir / "tokenizer.json", 128)
    for fx in fixtures:
        assert fx["token_ids"] == tok.encode(fx["text"]).ids
        assert fx["token_ids"][0] == 2 and fx["token_ids"][-1] == 3   # [CLS] ... [SEP]
        assert len(fx["token_ids"]) <= 128
        assert len(fx["embedding"]) == 32
        norm = sum(x * x for x in fx["embedding"]) ** 0.5
        assert norm == pytest.approx(1.0, abs=1e-5)
    assert len(fixtures[-1]["token_ids"]) == 128   # the long fixture is truncated at max_length


def test_reimport_same_dir_gives_same_digest_and_no_duplicate(bi_home: Path, tiny_model_dir: Path) -> None:
    first = import_bundle(tiny_model_dir, "tiny")
    second = import_bundle(tiny_model_dir, "tiny")
    assert second.digest == first.digest
    assert second.created_at == first.created_at
    assert [b.digest for b in list_bundles()] == [first.digest]

    # a copy elsewhere has the same content, hence the same digest
    copy = shutil.copytree(tiny_model_dir, bi_home.parent / "copy-of-tiny")
    assert import_bundle(copy, "tiny").digest == first.digest
    assert len(list_bundles()) == 1


def test_import_refuses_non_directory_and_non_bert(bi_home: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(BundleError, match="not a directory"):
        import_bundle(tiny_model_dir / "config.json", "x")
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    # an encoder-decoder: no native family, and neither a bare encoder nor a causal LM for the fallback
    cfg["model_type"], cfg["architectures"] = "t5", ["T5ForConditionalGeneration"]
    (tiny_model_dir / "config.json").write_text(json.dumps(cfg))
    (tiny_model_dir / "modules.json").unlink()
    with pytest.raises(BundleError, match="'t5' is not supported"):
        import_bundle(tiny_model_dir, "x")
    assert list_bundles() == []


# --- resolve_ref -----------------------------------------------------------------------------------


def test_resolve_ref_name_alias_digest_and_unknown(bi_home: Path, tiny_model_dir: Path) -> None:
    old = import_bundle(tiny_model_dir, "tiny", alias="prod", max_length=64)
    new = import_bundle(tiny_model_dir, "tiny", max_length=32)
    assert old.digest != new.digest
    assert get_info(old.digest).created_at < get_info(new.digest).created_at

    assert resolve_ref("tiny") == new.digest                 # NAME -> newest import
    assert resolve_ref("tiny@prod") == old.digest            # NAME@ALIAS
    assert resolve_ref(old.digest) == old.digest             # sha256:HEX
    assert resolve_ref(new.digest) == new.digest
    assert get_info(old.digest).aliases == ("tiny@prod",)
    assert get_info(new.digest).aliases == ()

    for ref in ("nope", "tiny@stable", "nope@prod", "sha256:" + "0" * 64):
        with pytest.raises(BundleError) as ei:
            resolve_ref(ref)
        msg = str(ei.value)
        assert repr(ref) in msg
        assert "not found" in msg and "batchinf bundle import" in msg and "bundle list" in msg


def test_set_alias_validates(bi_home: Path, tiny_bundle: str) -> None:
    with pytest.raises(BundleError, match="NAME@ALIAS"):
        set_alias("tiny", tiny_bundle)
    with pytest.raises(BundleError, match="no bundle with digest"):
        set_alias("tiny@prod", "sha256:" + "1" * 64)
    assert resolve_ref("tiny@prod") == tiny_bundle
    set_alias("tiny@stable", tiny_bundle.removeprefix("sha256:"))   # bare hex is accepted
    assert resolve_ref("tiny@stable") == tiny_bundle


def test_alias_refuses_a_bundle_of_another_task(bi_home: Path, tiny_bundle: str, tmp_path: Path) -> None:
    """`bundle alias tiny@x <a generate bundle>` would silently turn `bundle: tiny@x` into a
    generate job: refused, naming both tasks; the same bundle under its own name is fine."""
    from tests.helpers.tiny_llama import make_tiny_llama

    gen = import_bundle(make_tiny_llama(tmp_path / "llama"), "tinyllama").digest
    with pytest.raises(BundleError, match=r"tiny@x cannot point at .*generate bundle.*tiny's bundles are embed"):
        set_alias("tiny@x", gen)
    with pytest.raises(BundleError, match="embed bundle"):
        set_alias("tinyllama@prod", tiny_bundle)
    assert resolve_ref("tiny@prod") == tiny_bundle
    set_alias("tinyllama@prod", gen)
    assert resolve_ref("tinyllama@prod") == gen


# --- load-time verification ------------------------------------------------------------------------


def test_open_runtime_good_bundle(bi_home: Path, tiny_bundle: str) -> None:
    rt = open_runtime(tiny_bundle)
    assert rt.model is not None
    assert rt.meta["max_length"] == 128
    assert open_runtime(tiny_bundle) is rt                   # loaded once per process
    assert verify_bundle("tiny@prod") == {"digest": tiny_bundle, "ok": True,
                                          "files": len(rt.meta["files"]), "fixtures": len(FIXTURE_TEXTS)}


def test_tampered_weights_are_refused_naming_the_file(bi_home: Path, tiny_bundle: str) -> None:
    weights = _stored_dir(bi_home, tiny_bundle) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError) as ei:
        _fresh_open(tiny_bundle)
    assert str(weights) in str(ei.value)
    assert "modified" in str(ei.value)
    with pytest.raises(BundleError, match="model.safetensors"):
        verify_bundle("tiny@prod")


def test_missing_bundle_file_is_refused(bi_home: Path, tiny_bundle: str) -> None:
    vocab = _stored_dir(bi_home, tiny_bundle) / "vocab.txt"
    vocab.unlink()
    with pytest.raises(BundleError, match=r"vocab\.txt is missing"):
        _fresh_open(tiny_bundle)


def test_tampered_bundle_json_is_refused_by_digest(bi_home: Path, tiny_bundle: str) -> None:
    path = _stored_dir(bi_home, tiny_bundle) / "bundle.json"
    meta = json.loads(path.read_text())
    meta["max_length"] = 64
    path.write_text(json.dumps(meta))
    with pytest.raises(BundleError) as ei:
        _fresh_open(tiny_bundle)
    msg = str(ei.value)
    assert "bundle.json does not match digest" in msg and tiny_bundle in msg

    path.write_text("{not json")
    with pytest.raises(BundleError, match="bundle.json is not valid JSON"):
        _fresh_open(tiny_bundle)


def test_tokenizer_drift_is_refused(bi_home: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_encode = TextTokenizer.encode

    def drifted(self: TextTokenizer, text: str) -> Encoded:   # as a tokenizers upgrade might
        e = real_encode(self, text)
        ids = list(e.ids)
        ids[1] = (ids[1] + 1) % 50
        return Encoded(ids=ids, truncated=e.truncated)

    monkeypatch.setattr(TextTokenizer, "encode", drifted)
    with pytest.raises(BundleError) as ei:
        _fresh_open(tiny_bundle)
    msg = str(ei.value)
    assert "tokenizer drift" in msg
    assert str(_stored_dir(bi_home, tiny_bundle) / "tokenizer.json") in msg
    assert "first difference at position 1" in msg

    monkeypatch.setattr(TextTokenizer, "encode", real_encode)
    _fresh_open(tiny_bundle)


def test_model_fixture_mismatch_is_refused(bi_home: Path, tiny_bundle: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    real_embed = EmbedRuntime.embed

    def perturbed(self: EmbedRuntime, batch: list[list[int]]):  # noqa: ANN202
        vecs, padded = real_embed(self, batch)
        vecs = vecs.copy()
        vecs[:, 0] += 1.0
        return vecs, padded

    monkeypatch.setattr(EmbedRuntime, "embed", perturbed)
    with pytest.raises(BundleError, match="model fixture 0 .* cosine"):
        _fresh_open(tiny_bundle)


def test_pickle_checkpoint_refused_at_import(bi_home: Path, tiny_model_dir: Path) -> None:
    (tiny_model_dir / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(BundleError) as ei:
        import_bundle(tiny_model_dir, "tiny")
    assert "'pytorch_model.bin'" in str(ei.value)
    assert "pickle" in str(ei.value)
    assert list_bundles() == []
    assert not (bi_home / "bundles").exists() or not any((bi_home / "bundles").iterdir())


def test_pickle_dropped_into_stored_bundle_refused_at_load(bi_home: Path, tiny_bundle: str) -> None:
    _fresh_open(tiny_bundle)
    (_stored_dir(bi_home, tiny_bundle) / "extra.pt").write_bytes(b"\x80\x04")
    with pytest.raises(BundleError) as ei:
        _fresh_open(tiny_bundle)
    assert "'extra.pt'" in str(ei.value) and "pickle" in str(ei.value)


def test_missing_safetensors_refused(bi_home: Path, tiny_model_dir: Path) -> None:
    (tiny_model_dir / "model.safetensors").unlink()
    with pytest.raises(BundleError, match="no \\*.safetensors"):
        import_bundle(tiny_model_dir, "tiny")


# --- alias moved after submit ----------------------------------------------------------------------


def _manifest(tmp: Path, key: str, out: str):  # noqa: ANN202
    from batchinf.manifest import parse_manifest

    inp = tmp / "in.jsonl"
    inp.write_text('{"id": 1, "text": "hello world"}\n{"id": 2, "text": "batch data"}\n')
    return parse_manifest({
        "name": "alias-move", "task": "embed", "bundle": "tiny@prod",
        "input": {"uri": str(inp), "format": "jsonl"},
        "output": {"uri": str(tmp / out)},
        "idempotency_key": key,
    })


def test_alias_moved_after_submit_does_not_change_job(bi_home: Path, tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    from batchinf.ledger.jobs import get as job_row
    from batchinf.ledger.status import status
    from batchinf.submit import submit

    first = import_bundle(tiny_model_dir, "tiny", alias="prod").digest
    job1, created = submit(_manifest(tmp_path, "k1", "out1"), OPERATOR)
    assert created
    assert job_row(job1).bundle_digest == first
    assert job_row(job1).bundle_ref == "tiny@prod"

    second = import_bundle(tiny_model_dir, "tiny", max_length=64).digest
    assert second != first
    set_alias("tiny@prod", second)
    assert resolve_ref("tiny@prod") == second

    assert job_row(job1).bundle_digest == first
    assert status(job1)["bundle_digest"] == first
    # resubmitting the same key returns the same job, still on the old digest
    again, created = submit(_manifest(tmp_path, "k1", "out1"), OPERATOR)
    assert (again, created) == (job1, False)
    assert job_row(again).bundle_digest == first

    job2, created = submit(_manifest(tmp_path, "k2", "out2"), OPERATOR)
    assert created and job2 != job1
    assert job_row(job2).bundle_digest == second


# --- CLI -------------------------------------------------------------------------------------------


def test_cli_bundle_commands(bi_home: Path, tiny_model_dir: Path) -> None:
    from batchinf.cli import main

    runner = CliRunner()
    r = runner.invoke(main, ["bundle", "import", str(tiny_model_dir), "--name", "x", "--alias", "prod", "--json"])
    assert r.exit_code == 0, r.output
    imported = json.loads(r.stdout)
    digest = imported["digest"]
    assert digest.startswith("sha256:")
    assert imported["name"] == "x" and imported["aliases"] == ["x@prod"] and imported["task"] == "embed"
    assert json.loads((_stored_dir(bi_home, digest) / "bundle.json").read_text())["max_length"] == 128

    r = runner.invoke(main, ["bundle", "list", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [(b["name"], b["digest"], b["aliases"]) for b in rows] == [("x", digest, ["x@prod"])]

    r = runner.invoke(main, ["bundle", "verify", "x@prod", "--json"])
    assert r.exit_code == 0, r.output
    v = json.loads(r.stdout)
    assert v["ok"] is True and v["digest"] == digest and v["fixtures"] == len(FIXTURE_TEXTS)

    r = runner.invoke(main, ["bundle", "alias", "x@stable", digest, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"alias": "x@stable", "digest": digest}
    assert resolve_ref("x@stable") == digest

    r = runner.invoke(main, ["bundle", "import", str(tiny_model_dir), "--name", "x", "--max-length", "48",
                             "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["digest"] != digest
    assert len(json.loads(runner.invoke(main, ["bundle", "list", "--json"]).stdout)) == 2


@pytest.mark.parametrize("args, expect", [
    (["bundle", "verify", "nope@prod", "--json"], "'nope@prod' not found"),
    (["bundle", "alias", "x@prod", "sha256:" + "0" * 64, "--json"], "no bundle with digest"),
    (["bundle", "alias", "x", "sha256:" + "0" * 64], "must look like NAME@ALIAS"),
])
def test_cli_bundle_errors_are_one_line(bi_home: Path, args: list[str], expect: str) -> None:
    from batchinf.cli import main

    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert isinstance(r.exception, SystemExit)
    assert r.stdout == ""
    err = r.stderr.strip()
    assert "Traceback" not in r.output
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and expect in err


def test_cli_import_pickle_dir_exits_2(bi_home: Path, tiny_model_dir: Path) -> None:
    from batchinf.cli import main

    (tiny_model_dir / "weights.ckpt").write_bytes(b"x")
    r = CliRunner().invoke(main, ["bundle", "import", str(tiny_model_dir), "--name", "x", "--json"])
    assert r.exit_code == 2
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "weights.ckpt" in err and "Traceback" not in r.output


def test_submit_refuses_max_length_above_the_bundle(bi_home: Path, tiny_bundle: str, tmp_path: Path) -> None:
    """`max_length: 100000` used to be clamped without a word: now a manifest error naming the limit."""
    from batchinf.errors import ManifestError
    from batchinf.ledger.registry import meta
    from batchinf.manifest import parse_manifest
    from batchinf.submit import submit
    from tests.helpers.corpus import manifest

    limit = meta(tiny_bundle)["max_length"]
    m = manifest(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), options={"max_length": 100000})
    with pytest.raises(ManifestError, match=rf"options.max_length 100000 exceeds bundle tiny@prod's max length {limit}"):
        submit(parse_manifest(m), OPERATOR)
    job_id, created = submit(parse_manifest(dict(m, options={"max_length": limit})), OPERATOR)
    assert created and job_id.startswith("job-")
