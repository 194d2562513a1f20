"""Task strategies: the registry of tasks a manifest may name (`task:`), and bundle import's
detection of a model's task from its config.json. Adding a task is adding a module here and its
entry in TASKS; plan, execute, verify and the bundle registry call only the Task protocol
(tasks/base.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchinf.errors import BundleError, ManifestError
from batchinf.runtime.families import FAMILIES
from batchinf.tasks.base import RunOutput, Task
from batchinf.tasks.classify import Classify, ClassifyOptions
from batchinf.tasks.classify_image import ClassifyImage, ClassifyImageOptions
from batchinf.tasks.embed import Embed, EmbedOptions
from batchinf.tasks.generate import Generate, GenerateOptions
from batchinf.tasks.generate_image import GenerateImage, GenerateImageOptions
from batchinf.tasks.score import Score, ScoreOptions
from batchinf.tasks.transcribe import Transcribe, TranscribeOptions

__all__ = ["TASKS", "ClassifyImageOptions", "ClassifyOptions", "EmbedOptions",
           "GenerateImageOptions", "GenerateOptions", "RunOutput", "ScoreOptions", "Task", "TranscribeOptions",
           "build_meta", "get_task", "prepared"]

TASKS: dict[str, Task] = {t.name: t for t in (Embed(), Generate(), Score(), Classify(), ClassifyImage(),
                                            GenerateImage(), Transcribe())}
# bundle import asks the tasks in this order (more specific model heads first)
DETECTION_ORDER = ("transcribe", "generate", "classify_image", "score", "classify", "embed")
SUPPORTED = ("; ".join(f"{', '.join(f.model_types)} ({', '.join(f.tasks)})" for f in FAMILIES)
             + "; Bert/XLMRobertaForSequenceClassification (score: cross-encoders; classify)"
             + "; ViTForImageClassification (classify_image)"
             + "; diffusers StableDiffusionPipeline directories, model_index.json (generate_image)"
             + "; Whisper in CTranslate2 format (transcribe)")


def get_task(name: str) -> Task:
    task = TASKS.get(name)
    if task is None:
        raise ManifestError(f"task {name!r} is not supported; use one of {', '.join(TASKS)}")
    return task


def detect(config: dict[str, Any], src: Path) -> Task:
    """The task a model directory serves, from its config.json."""
    for name in DETECTION_ORDER:
        if TASKS[name].detects(config, src):
            return TASKS[name]
    from batchinf.runtime.hf_fallback import causal_lm_architecture, fallback_architecture

    # no native family: transformers' own model class computes it
    if config.get("model_type") and causal_lm_architecture(config, src) is not None:
        return TASKS["generate"]
    if config.get("model_type") and fallback_architecture(config, src) is not None:
        return TASKS["embed"]
    raise BundleError(f"{src}: model_type {config.get('model_type')!r} is not supported yet (architectures "
                      f"{config.get('architectures')}); supported: {SUPPORTED}")


def build_meta(src: Path, *, max_length: int | None = None, dtype: str = "float32") -> dict[str, Any]:
    """bundle.json for a model directory: its task detected from config.json, then that task's
    settings, file digests and fixtures computed with our own runtime on CPU in float32."""
    from batchinf.runtime.bundle import bundle_files, require_weights

    files = bundle_files(src, weights=None)
    if "model_index.json" in files and "config.json" not in files:     # a diffusers pipeline directory
        return TASKS["generate_image"].build_meta(src, files, max_length=max_length, dtype=dtype)
    if "config.json" not in files:
        raise BundleError(f"{src}: a bundle needs config.json (and tokenizer.json, or preprocessor_config.json "
                          "for an image model)")
    config = json.loads((src / "config.json").read_text())
    task = detect(config, src)
    require_weights(src, files, task.weights)
    missing = [f for f in task.needs if f not in files]
    if missing:
        raise BundleError(f"{src}: a bundle needs {' and '.join(task.needs)}; {', '.join(missing)} is missing")
    return task.build_meta(src, files, max_length=max_length, dtype=dtype)


def prepared(src: Path, tmp: Path) -> Path:
    """The directory bundle import reads: `src`, or what a task made of a model directory in
    another engine's layout (a CTranslate2 Whisper directory: model.bin renamed model.ct2)."""
    for task in TASKS.values():
        made = task.prepare(src, tmp)
        if made is not None:
            return made
    return src
