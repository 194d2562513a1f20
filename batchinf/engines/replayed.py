"""Fixture replays remembered per machine: a worker that loads a bundle replays its fixtures
through the engine (engines.verify_model) unless this machine already replayed them, with the
same result guaranteed, for the same bundle on the same engine and device, under the same
software and CPU. The same goes for a bundle's input checks (Task.verify_inputs: its tokenizer's
fixtures, a speech bundle's fixture clip decoded to features), which every load runs, the
planning driver's included, before the model: remembered apart (`cache/inputs-checked/`), under a
key taken once the libraries they run on are loaded (the tokenizer's, the audio decoder's).

The replay is deterministic given what the key covers: the bundle's digest (every file is checked
against it at each load, runtime/bundle.verify_files), the engine and device, the versions of the
libraries loaded in the process (the engine's, numpy's, the tokenizer's, the audio decoder's), the
CPU (model and instruction-set flags: a kernel choice can change a result), the Python version,
and batchinf's own code (each module's size and modification time). Change any of them and the
key changes, so the next load replays again. What is remembered is a marker file under
`$BATCHINF_HOME/cache/replayed/`, written after a replay passed; a failed replay writes nothing.

Why: a replay is a forward pass per fixture, on one thread often the largest part of a worker's
load (a Whisper fixture window: 0.45 s of the 1.4 s a CPU worker takes to load tiny.en), paid by
every worker of every job; a speech bundle's input check (its clip decoded and turned into
features, its tokenizer loaded to decode the clip's tokens) was 0.35 s of a driver's planning.
An `openai-http` engine is always replayed: its server can change
between two requests without anything here changing."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Callable

ALWAYS = ("openai-http",)
LIBRARIES = ("torch", "ctranslate2", "onnxruntime", "vllm", "transformers", "numpy", "tokenizers", "av",
             "safetensors", "jinja2", "PIL", "diffusers")


@lru_cache(maxsize=1)
def _code_stamp() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        st = path.stat()
        h.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


@lru_cache(maxsize=1)
def cpu_stamp() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(dict.fromkeys(lines))       # the first CPU's lines (every core's repeat them)
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _libraries() -> dict[str, str]:
    out = {}
    for name in LIBRARIES:
        if name in sys.modules:
            try:
                out[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                out[name] = str(getattr(sys.modules[name], "__version__", "?"))
    return out


def _device(device: str) -> str:
    if device.startswith("cuda") and "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            return f"{device} {torch.cuda.get_device_name(torch.device(device))}"
    return device


def key(digest: str, engine: str, device: str) -> str:
    """What the replay's result depends on, hashed (module docstring)."""
    parts = {"digest": digest, "engine": engine, "device": _device(device), "libraries": _libraries(),
             "cpu": cpu_stamp(), "python": sys.version, "batchinf": _code_stamp()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def replay_once(replay: Callable[[], None], digest: str, engine: str, device: str, cache_dir: Path) -> bool:
    """Run `replay` unless this machine passed it under the same key; True if it ran."""
    if engine in ALWAYS:
        replay()
        return True
    marker = cache_dir / key(digest, engine, device)
    if marker.is_file():
        return False
    replay()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_name(f".{marker.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"digest": digest, "engine": engine, "device": device}) + "\n")
        os.replace(tmp, marker)
    except OSError:
        pass        # a cache that cannot be written costs the next load its replay, nothing else
    return True
