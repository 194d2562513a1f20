"""The vllm engine's pooling tasks (embed, score) end to end on CPU, in the vllm venv (as
test_vllm_engine.py): the checks of tests/helpers/vllm_pooling_checks.py run there in one process and
report what this test asserts, against native on the real all-MiniLM-L6-v2, a tiny cross-encoder and a
tiny classifier."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.helpers.real_models import minilm_dir
from tests.helpers.vllm_env import REPO, vllm_python

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    python = vllm_python()
    minilm = minilm_dir()                 # from this venv: the vllm venv has batchinf's dependencies only
    tmp = tmp_path_factory.mktemp("vllm-pooling")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINF_")}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([str(python), "-m", "tests.helpers.vllm_pooling_checks", str(tmp / "home"), str(minilm)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=2400)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_minilm_opens_on_vllm_with_its_pooling_and_fixtures(report: dict) -> None:
    assert report["embed_engine"] == "vllm"
    assert report["embed_pooling"] == ["mean", True]
    assert all(abs(n - 1.0) < 1e-5 for n in report["embed_norms"])       # normalised as the bundle says


def test_minilm_vectors_on_vllm_equal_native(report: dict) -> None:
    longest, limit = report["embed_longest"]
    assert longest == limit               # a text truncated at the bundle's max length is among them
    assert report["embed_min_cosine"] >= 0.9999


def test_an_engine_that_pools_otherwise_is_refused_naming_the_fixture(report: dict) -> None:
    assert report["embed_drift_refused"].startswith("vllm fixture 0 of bundle"), report["embed_drift_refused"]
    assert "cosine" in report["embed_drift_refused"]


def test_cross_encoder_logits_on_vllm_equal_native(report: dict) -> None:
    assert report["score_engine"] == "vllm" and report["score_pair_types"] is True
    assert report["score_max_rel_diff"] <= 1e-4


def test_classifier_logits_on_vllm_equal_native(report: dict) -> None:
    assert report["classify_engine"] == "vllm" and report["classify_max_rel_diff"] <= 1e-4


def test_logits_that_drift_are_refused_naming_the_fixture(report: dict) -> None:
    assert report["score_drift_refused"].startswith("vllm fixture 1 of bundle"), report["score_drift_refused"]


def test_embed_and_score_jobs_on_vllm_publish_the_same_rows_as_native(report: dict) -> None:
    assert report["jobs"] == {"embed-vllm": "succeeded", "embed-native": "succeeded",
                              "score-vllm": "succeeded", "score-native": "succeeded"}, report["jobs"]
    assert report["embed_job_same_ids"] and report["embed_job_same_fields"]
    assert report["embed_job_cosine"] >= 0.9999
    assert report["score_job_same_ids"] and report["score_job_same_fields"]
    assert report["score_job_diff"] <= 1e-4
