"""Benchmarks' short modes run in CI for correctness only (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_embed_throughput_short_mode(minilm_dir: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "embed_throughput.py"), "--short", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["corpus"]["records"] == 400
    assert min(report["min_cosine_vs_batchinf"].values()) >= 0.9999
    assert report["padding_efficiency"]["batchinf"] >= 0.95
    assert set(report["records_per_s"]) >= {"batchinf run (end to end)", "naive loop bs=32 (file order)",
                                            "batchinf run, int8 bundle (end to end)"}
    assert report["int8"]["precision"] == "int8"
    assert min(report["int8"]["min_cosine_vs_float32"], report["int8"]["min_cosine_vs_st"]) >= 0.995


def test_small_job_short_mode(minilm_dir: Path, tmp_path: Path) -> None:
    """A 10-record job and `import torch`, one run each: the job succeeds and its phases from
    _MANIFEST.json are all there, non-negative, within the command's wall time."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "small_job.py"), "--short", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads(r.stdout)
    assert report["records"] == 10 and report["reps"] == 1 and report["order"] == "T B "
    assert report["import_torch"]["median_s"] > 0 and report["ratio"] > 0
    phases = report["phases"]
    assert all(phases[k] is not None and phases[k] >= 0 for k in phases), phases
    assert phases["wall"] <= report["batchinf_run"]["median_s"] and report["after_publish"] >= 0
    assert report["workers"] >= 1 and sum(w["shards"] for w in report["workers_median_run"]) >= 1


def test_embed_peers_short_mode(minilm_dir: Path, tmp_path: Path) -> None:
    """Every contender (batchinf on each engine, the ORT scripts, Ray Data where installed) embeds
    the tiny mixed-lengths corpus (short sentences and docstrings both; one corpus, as each
    contender is a whole process: the three took 10 minutes of CI); float32 vectors within
    cosine 0.9999 of sentence-transformers'."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "embed_peers.py"), "--short", "--json",
                        "--corpus", "mixed lengths"], capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads(r.stdout)
    assert report["records"] == 40 and report["reps"] == 1
    assert set(report["corpora"]) == {"mixed lengths"}
    assert report["engine_chosen_at_import"] in ("native", "onnxruntime")
    for kind, c in report["corpora"].items():
        assert c["records"] == 40, kind
        # batchinf runs the engine its import chose, and the other one by name where that is native;
        # int8 runs the per-token int8 graph (its import passes the gate)
        named = {"batchinf, onnxruntime"} if report["engine_chosen_at_import"] == "native" else set()
        want = {"batchinf", "batchinf int8", "ORT fp32 script", "ORT int8 script"} | named
        assert set(c["median_s"]) - {"Ray Data"} == want
        assert report["int8"] == "enabled"
        cos = c["min_cosine_vs_sentence_transformers"]
        assert min(v for k, v in cos.items() if "int8" not in k) >= 0.9999, cos
        assert min(cos.values()) >= 0.95, cos      # ORT's int8 script: about 0.98
        assert all(v > 0 for v in c["batchinf_ratio"].values())


def test_api_under_attack_short_mode(tmp_path: Path) -> None:
    """Every hostile manifest the attacker cycles through is refused with a 4xx, /healthz still
    answers, and both latency samples are measured (the script exits non-zero otherwise)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "api_under_attack.py"), "--short", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads(r.stdout)
    assert report["requests"] == 40 and report["healthz_after"] == 200
    assert report["idle"]["p50_ms"] > 0 and report["under_attack"]["p50_ms"] > 0
    statuses = report["attack_statuses"]
    assert len(statuses) == 9 and all(int(s) in (400, 413, 422) for v in statuses.values() for s in v), statuses


def test_openai_overhead_short_mode(minilm_dir: Path, tmp_path: Path) -> None:
    """Both contenders (a `batchinf run` and the OpenAI path through a running serve) answer every
    line of the same file with the same vectors, measured side by side."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "openai_overhead.py"), "--short", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads(r.stdout)
    assert report["records"] == 60 and report["order"] == "A B "
    assert report["run"]["records_per_second"] > 0 and report["openai_api"]["records_per_second"] > 0
    assert report["max_abs_diff_vs_run"] <= 1e-6


def test_score_throughput_short_mode(tmp_path: Path) -> None:
    """Both sides score the same pairs (same answers); batchinf's length-sorted token-budget
    batches waste under 3% of the positions they compute; one timed repetition per side."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "score_throughput.py"), "--short", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["pairs"] == 200 and report["max_abs_diff"] < 1e-4
    assert report["batchinf"]["padding_efficiency"] >= 0.97
    assert report["reps"] == 1 and len(report["batchinf"]["seconds"]) == len(report["cross_encoder_predict"]["seconds"]) == 1
    assert 0 < report["cross_encoder_predict"]["padding_efficiency"] <= 1
    assert report["batchinf"]["pairs_per_s"] > 0 and report["cross_encoder_predict"]["pairs_per_s"] > 0


def test_plan_scale_short_mode(tmp_path: Path) -> None:
    """Planning a synthetic job (tokenizer only) and the ledger simulation on PostgreSQL both run
    and count what they claim: every record planned, every commit a committed shard."""
    from tests.helpers.services import fresh_postgres_db

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plan_scale.py"), "--short", "--json",
                        "--database-url", fresh_postgres_db()], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads(r.stdout)
    plan, ledger = report["planning"], report["ledger"]
    assert plan["records"] == 4000 and plan["status"] == "running"
    assert plan["peak_rss_mib"]["global_step"] > 0 and plan["records_per_s_per_planning_process"] > 0
    assert ledger["commits"] > 0 and ledger["committed"] == ledger["commits"]
    assert ledger["ledger_errors"] == 0, "a ledger fault (e.g. a deadlock) under concurrent commits"
    assert ledger["idle"]["status_ms"] > 0 and ledger["under_load"]["tick_ms_p50"] > 0


def test_plan_scale_object_scale_short_mode(tmp_path: Path) -> None:
    """The same records planned as 2 and as 200 objects: both jobs plan every record and run,
    and the ratio of their times is reported (no timing assertion)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plan_scale.py"), "--object-scale", "2,200",
                        "--short", "--json"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads(r.stdout)["object_scale"]
    assert set(report["objects"]) == {"2", "200"} and report["rounds"] == 1
    assert all(o["records"] == 2000 and o["status"] == "running" and o["seconds"] > 0
               for o in report["objects"].values())
    assert report["ratio"] > 0


def test_hostile_neighbours_short_mode(tmp_path: Path) -> None:
    """Beside each hostile job or request of another tenant, the victim's small job still succeeds
    (the script exits non-zero otherwise), and each attack ends refused or bounded."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hostile_neighbours.py"), "--short", "--json"],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = json.loads(r.stdout)["rows"]
    assert set(rows) == {"same file listed 60 times", "many objects", "gzip bomb", "chunked bodies"}
    assert rows["same file listed 60 times"]["attack_ended"].startswith("failed") and "twice" in \
        rows["same file listed 60 times"]["attack_ended"]
    assert rows["many objects"]["attack_ended"].startswith("succeeded")
    answers = rows["chunked bodies"]["attack_ended"].removeprefix("answered ").split(", ")
    assert len(answers) == 3 and all(a.endswith(" 413") for a in answers), answers
    assert all(r["victim_s"] > 0 and r["serve_peak_rss_mib"] > 0 for r in rows.values())


def test_chat_template_sandbox_short_mode(tmp_path: Path) -> None:
    """Every contender renders what the in-process renderer does (the script exits non-zero
    otherwise), and each bomb it replays is stopped with the sandbox's peak RSS under its limit."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chat_template_sandbox.py"), "--short", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads(r.stdout)
    assert report["records"] == 50 and len(report["bombs"]) == 3
    assert all(v > 0 for v in report["render"]["records_per_s"].values())
    assert all(b["stopped"] and b["under_limit"] and b["peak_rss_mib"] > 0 for b in report["bombs"].values())


def test_generate_throughput_short_mode(smollm2_gguf: Path, tmp_path: Path) -> None:
    from tests.helpers.llama_quantize import llama_server

    llama_server()                        # built (or unavailable) before the benchmark needs it
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate_throughput.py"), "--short", "--json",
                        "--gguf", str(smollm2_gguf), "--only", "continuous,static,transformers,structured,llama-server"],
                       check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]      # every contender produced exactly the lengths asked
    report = json.loads(r.stdout)
    contenders = {"batchinf continuous", "batchinf static", "transformers static"}
    assert set(report["tokens_per_s"]) == contenders | {"batchinf structured", "batchinf continuous again",
                                                        "llama-server"}
    assert report["tokens_per_s"]["llama-server"] > 0 and report["ratios"]["continuous / llama-server"] > 0
    assert report["structured_mask_cost"] < 1        # the masked run produced the same number of tokens
    # Greedy decoding: all three produce the same ids for every prompt.
    identical = report["identical_greedy_sequences"]
    assert 0 <= identical.pop("llama-server") <= report["prompts"]      # its own arithmetic: its own tokens
    assert identical == {k: report["prompts"] for k in contenders | {"batchinf continuous again"}}
    waste = report["wasted_decode_slots"]
    assert waste["batchinf continuous"] < waste["batchinf static"]
    # Both static batches hold the same requests; ours differs only where a prompt that shares a
    # prefix gets its first token from the first decode step rather than from prefill.
    assert abs(waste["batchinf static"] - waste["transformers static"]) < 0.1
    assert report["prompt_tokens_from_shared_prefixes"]["batchinf continuous"] > 0.3   # a shared system prompt
    assert report["output_tokens"] >= report["prompts"] * report["output_lengths"][0]


def test_generate_vs_llama_server_short_mode(smollm2_gguf: Path, tmp_path: Path) -> None:
    """`batchinf run` and llama-server answer the same chat prompts on the same GGUF, whole process
    each: both measured (tokens/s and peak memory), every prompt answered by both. The variant with
    the weights float32 instead of the GGUF's blocks (the real SmolLM2 Q4_1, a whole `batchinf run`)
    gives the same answers in more memory."""
    from tests.helpers.llama_quantize import llama_server

    llama_server()                        # built (or unavailable) before the benchmark needs it
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate_vs_llama_server.py"), "--short", "--json",
                        "--also-env", "BATCHINF_BLOCK_WEIGHTS=0"],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads(r.stdout)
    f32 = "batchinf BATCHINF_BLOCK_WEIGHTS=0"
    for side in ("batchinf", "llama-server", f32):
        assert report[side]["output_tokens"] >= report["prompts"] and report[side]["tokens_per_s"] > 0
        assert 0 < report[side]["peak_pss_mib"] <= report[side]["peak_rss_mib"]
    assert report["throughput_ratio"] > 0 and report["memory_ratio"] > 0
    assert report[f32]["same_answers_as_batchinf"] == report["prompts"]
    assert report["batchinf"]["peak_pss_mib"] < report[f32]["peak_pss_mib"]


def test_speech_throughput_short_mode(tmp_path: Path) -> None:
    """batchinf and both faster-whisper contenders transcribe the same clips and long file with
    the real tiny.en (int8), whole process each; every one of them measured, WERs alike."""
    from tests.helpers.real_models import whisper_tiny_en_dir
    from tests.helpers.speech import espeak

    whisper_tiny_en_dir()
    espeak()
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speech_throughput.py"), "--short", "--json"],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads(r.stdout)
    assert report["corpora"]["short clips"]["files"] == 6 and report["corpora"]["long files"]["files"] == 1
    for corpus, speeds in report["audio_seconds_per_second"].items():
        assert set(speeds) == {"batchinf", "faster-whisper batched (16)", "faster-whisper sequential"}
        assert min(speeds.values()) > 0
        assert max(report["wer"][corpus].values()) <= 0.2, report["wer"]
        assert report["batchinf_phases"][corpus]["execute"] > 0       # from the job's _MANIFEST.json


def test_engine_openai_http_short_mode(smollm2_gguf: Path, tmp_path: Path) -> None:
    """The plain client, the engine in process and a whole job all answer the same prompts against
    the same llama-server, side by side; the engine's answers equal the plain client's."""
    from tests.helpers.llama_quantize import llama_server

    llama_server()                        # built (or unavailable) before the benchmark needs it
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_openai_http.py"), "--short", "--json"],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads(r.stdout)
    assert report["prompts"] == 16 and len(report["seconds"]) == 3
    assert report["same_answers_as_plain"]["openai-http engine (in process)"] == 16
    assert all(v > 0 for v in report["completions_per_s"].values())


def test_engine_vllm_short_mode(smollm2_gguf: Path) -> None:
    """native and vllm on the same bundle and prompts, in the vllm venv, side by side."""
    import os

    from tests.helpers.vllm_env import vllm_python

    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINF_")}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([str(vllm_python()), str(ROOT / "benchmarks" / "engine_vllm.py"), "--short", "--json"],
                       capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["prompts"] == 8 and report["same_token_ids"][1] == 8
    assert report["native"]["output_tokens"] > 0 and report["vllm"]["output_tokens"] > 0


def test_image_throughput_short_mode(tmp_path: Path) -> None:
    """The three sides (batchinf's generate_image run, record by record, a naive equal-size
    batcher) make the same images of mixed sizes on the tiny pipeline, each timed once."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "image_throughput.py"), "--short", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads(r.stdout)
    assert report["records"] == 12 and report["shapes"] > 1
    assert max(report["max_uint8_diff_vs_batchinf"].values()) <= 1
    assert all(report[s]["images_per_s"] > 0 for s in ("batchinf", "record_by_record", "naive_batcher"))
