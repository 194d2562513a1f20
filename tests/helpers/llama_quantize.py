"""llama.cpp's `llama-quantize` and `llama-server`, built once from the `llama-cpp-python` source package (PyPI), and the
SmolLM2 GGUF re-quantised with it to K-quant types for the real-file tests.

The tool and the files live in a cache outside the repository (BATCHINF_TOOL_CACHE, default
~/.cache/batchinf-tests), so a fresh clone on the same machine (CI) reuses them; the first build takes
a few minutes on 2 cores (llama.cpp's CPU backend and libllama at -O1, the quantize target only). A
build that fails is `unavailable` (skip, or fail under BATCHINF_REQUIRE_SERVICES=1)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from tests.helpers.real_models import smollm2_gguf
from tests.helpers.services import unavailable

VERSION = "0.3.36"      # llama-cpp-python, whose sdist vendors llama.cpp
BUILD_TIMEOUT_S = 3600


def cache_dir() -> Path:
    return Path(os.environ.get("BATCHINF_TOOL_CACHE", "~/.cache/batchinf-tests")).expanduser()


def _run(cmd: list[str], log: Path, cwd: Path | None = None, what: str = "llama-quantize") -> None:
    with open(log, "ab") as fh:
        r = subprocess.run(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
    if r.returncode:
        unavailable(f"building {what} failed at `{' '.join(cmd[:4])} ...` (see {log})")


def _build_tool(target: str, opt: str, extra: list[str]) -> Path:
    """One llama.cpp tool built from the sdist (the first time, under a lock so parallel sessions
    build it once); `opt` is the optimisation level, `extra` more cmake switches."""
    root = cache_dir() / f"{target}-{VERSION}"
    tool = root / target
    if tool.is_file():
        return tool
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if tool.is_file():
            return tool
        if not shutil.which("cmake") or not shutil.which("c++"):
            unavailable(f"building {target} needs cmake and a C++ compiler (apt-get install cmake g++)")
        log = root / "build.log"
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={VERSION}", "-d", str(root)], log, what=target)
        with tarfile.open(root / f"llama_cpp_python-{VERSION}.tar.gz") as tf:
            tf.extractall(root, filter="data")
        src = root / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
        _run(["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release",
              f"-DCMAKE_C_FLAGS_RELEASE={opt} -DNDEBUG", f"-DCMAKE_CXX_FLAGS_RELEASE={opt} -DNDEBUG",
              "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_OPENMP=OFF", "-DBUILD_SHARED_LIBS=OFF"] + extra, log, what=target)
        _run(["cmake", "--build", str(src / "build"), "--target", target, "-j2"], log, what=target)
        shutil.copy2(src / "build" / "bin" / target, tool)
        shutil.rmtree(root / f"llama_cpp_python-{VERSION}", ignore_errors=True)
    return tool


def llama_quantize() -> Path:
    """The built tool. -O1 and no llamafile sgemm: it quantises two small files, so compile time is what counts."""
    return _build_tool("llama-quantize", "-O1", ["-DGGML_LLAMAFILE=OFF", "-DLLAMA_BUILD_SERVER=OFF"])


def llama_server() -> Path:
    """llama.cpp's OpenAI-compatible `llama-server` (the openai-http engine's tests and benchmark), -O2:
    it serves a model, so its speed is what the benchmark measures."""
    return _build_tool("llama-server", "-O2", ["-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON"])


def requantised_smollm2(kind: str) -> Path:
    """SmolLM2-135M-Instruct re-quantised from its Q4_1 file to `kind` (Q4_K_M, Q6_K, ...), made once.
    Tensors whose rows are not a multiple of 256 get llama.cpp's fallback type (Q5_0, Q8_0, ...)."""
    out = cache_dir() / "smollm2" / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if out.is_file():
        return out
    src, tool = smollm2_gguf(), llama_quantize()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:    # CI starts making them in the background
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            return out
        tmp = out.with_suffix(".part")
        r = subprocess.run([str(tool), "--allow-requantize", str(src), str(tmp), kind, "2"],
                           capture_output=True, text=True, timeout=600)
        if r.returncode:
            unavailable(f"llama-quantize {kind} failed: {r.stderr[-500:]}")
        tmp.replace(out)
    return out
