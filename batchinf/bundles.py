"""The bundle registry: import into the bundle store, aliases, reference resolution, cached loading."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from batchinf.config import settings
from batchinf.errors import BundleError, DeviceUnavailableError
from batchinf.ledger import registry
from batchinf.ledger.models import BundleInfo
from batchinf.runtime import bundle as rb
from batchinf.runtime.malloc import keep_freed_memory, release_freed_memory
from batchinf.runtime.threads import use_torch_threads
from batchinf.store import get_store, join, parse_uri
from batchinf.tasks import build_meta, get_task, prepared
from batchinf.tasks.embed_request import check_matryoshka_dims


def import_bundle(src: str | Path, name: str, *, alias: str | None = None,
                  max_length: int | None = None, dtype: str = "float32",
                  matryoshka_dims: list[int] | None = None, precision: str = "float32",
                  int8_scheme: str | None = None, endpoint: dict[str, Any] | None = None,
                  onnx: bool = False) -> BundleInfo:
    """Compute bundle.json for a model directory, copy it into the bundle store, register it.
    `matryoshka_dims`: an embedding model's declared truncation sizes (part of its identity).
    `precision` int8: the int8 CPU variant (runtime/int8.py), refused unless it matches the
    float32 fixtures within the declared bound; `int8_scheme` vnni or avx2 (default: this CPU's best).
    `endpoint`: an openai-http server that executes the bundle (engines.openai_http.endpoint_spec),
    its answers to the fixture prompts pinned now (part of the bundle's identity).
    `onnx`: add an ONNX export for the onnxruntime engine (runtime/onnx_bundle.py), checked against
    the fixtures, and declare that engine where it measured faster than native."""
    src = Path(src)
    if not src.is_dir():
        raise BundleError(f"{src} is not a directory of model files")
    if precision not in ("float32", "int8"):
        raise BundleError(f"precision {precision!r} is not supported; use float32 or int8")
    with tempfile.TemporaryDirectory(prefix="batchinf-import-") as tmp:
        return _import_dir(prepared(src, Path(tmp)), name, alias=alias, max_length=max_length, dtype=dtype,
                           matryoshka_dims=matryoshka_dims, precision=precision, int8_scheme=int8_scheme,
                           endpoint=endpoint, onnx=onnx, tmp=Path(tmp))


def _import_dir(src: Path, name: str, *, alias: str | None, max_length: int | None, dtype: str,
                matryoshka_dims: list[int] | None, precision: str, int8_scheme: str | None,
                endpoint: dict[str, Any] | None, onnx: bool, tmp: Path) -> BundleInfo:
    meta = build_meta(src, max_length=max_length, dtype=dtype)
    if precision == "int8":
        from batchinf.runtime import int8
        from batchinf.runtime.embed import EmbedRuntime

        meta = int8.gate(EmbedRuntime(src, int8.int8_meta(meta, int8_scheme), device="cpu"))
    if matryoshka_dims:
        meta["matryoshka_dims"] = check_matryoshka_dims(matryoshka_dims, meta)
    if endpoint is not None:
        from batchinf.engines import TASKS
        from batchinf.engines.openai_http import pin_endpoint

        if meta["task"] not in (runs := TASKS["openai-http"] or ()):
            raise BundleError(f"an openai-http endpoint executes {', '.join(runs)} bundles; {src} is a "
                              f"{meta['task']} model")

        meta = pin_endpoint(src, meta, endpoint)
    if onnx:
        from batchinf.runtime.onnx_bundle import add_onnx

        src, meta = add_onnx(src, meta, tmp)
    digest = rb.digest_of(meta)
    uri = join(settings().bundle_store, digest.removeprefix("sha256:"))
    scheme, _, path = parse_uri(uri)
    if scheme == "file":
        rb.write_bundle_dir(src, Path(path), meta)
    else:
        store = get_store(uri)
        for f in rb.file_names(meta, str(src)):
            store.put_file(join(uri, f), rb.file_path(src, f))
        store.put_bytes(join(uri, "bundle.json"), json.dumps(meta, indent=1, sort_keys=True).encode())
    registry.add(digest, name, uri, meta["task"], meta["family"], json.dumps(meta), alias)
    return get_info(digest)


def import_gguf(path: str | Path, name: str, *, alias: str | None = None, dtype: str = "float32",
                endpoint: dict[str, Any] | None = None) -> BundleInfo:
    """Convert a GGUF Llama-family model into an HF-format directory (dequantised safetensors and
    the tokenizer: what vLLM and transformers load too) and import that as a bundle."""
    from batchinf.runtime.gguf import convert_gguf

    with tempfile.TemporaryDirectory(prefix="batchinf-gguf-") as tmp:
        return import_bundle(convert_gguf(path, Path(tmp) / "model", dtype=dtype), name, alias=alias, dtype=dtype,
                             endpoint=endpoint)


def set_alias(ref: str, digest: str) -> None:
    if "@" not in ref:
        raise BundleError(f"alias reference {ref!r} must look like NAME@ALIAS")
    name, alias = ref.split("@", 1)
    registry.set_alias(name, alias, digest if digest.startswith("sha256:") else "sha256:" + digest)


def resolve_ref(ref: str) -> str:
    """NAME (newest import), NAME@ALIAS, or sha256:HEX -> digest."""
    digest = registry.resolve(ref)
    if digest is None:
        raise BundleError(f"bundle {ref!r} not found; import it with `batchinf bundle import DIR --name NAME` "
                          "or see `batchinf bundle list`")
    return digest


def get_info(digest: str) -> BundleInfo:
    return registry.get(digest)


def list_bundles() -> list[BundleInfo]:
    return registry.all_bundles()


def local_dir(digest: str) -> Path:
    """The bundle's files on this machine (downloaded into the cache for remote bundle stores)."""
    info = get_info(digest)
    scheme, _, path = parse_uri(info.uri)
    if scheme == "file":
        return Path(path)
    cache = settings().home / "cache" / "bundles" / digest.removeprefix("sha256:")
    if not (cache / "bundle.json").exists():
        store = get_store(info.uri)
        where = join(info.uri, "bundle.json")
        try:
            meta = json.loads(store.get_bytes(where))
        except (ValueError, RecursionError) as exc:
            raise BundleError(f"{where} is not valid JSON ({exc}); re-import the bundle") from exc
        # verified before any name in it is used: a tampered bundle.json names no file here
        if rb.digest_of(meta) != digest:
            raise BundleError(f"{where} does not match digest {digest}: the bundle store was modified after "
                              "import; re-import the bundle")
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".dl-", dir=cache.parent))
        for f in rb.file_names(meta, where):
            target = rb.file_path(tmp, f, where)
            target.parent.mkdir(parents=True, exist_ok=True)
            store.download_file(join(info.uri, f), target)
        (tmp / "bundle.json").write_text(json.dumps(meta))
        if cache.exists():
            shutil.rmtree(cache)
        tmp.rename(cache)
    return cache


_loaded: dict[tuple[str, str, bool, str], Any] = {}
_loading = threading.RLock()
_unreported: dict[str, float] = {}     # digest -> seconds this process spent loading it, not yet on an attempt


def open_runtime(digest: str, *, device: str = "cpu", with_model: bool = True, engine: str = "native") -> Any:
    """Load a bundle once per process and engine: every digest, and every fixture through the
    engine, is verified before it is returned (an input check or replay this machine passed under
    the same software is remembered: engines/replayed.py). The runtime is the bundle's task's (an EmbedRuntime,
    a GenerateRuntime, ...), executed by `engine` (batchinf/engines); without the model (planning:
    the tokenizer only) every engine's is the native one."""
    engine = engine if with_model else "native"
    key = (digest, device, with_model, engine)
    if with_model:
        require_device(device)
    with _loading:          # the controller plans several jobs at once on threads: one load each
        if key in _loaded:
            return _loaded[key]
        t0 = time.perf_counter()
        runtime = _load(key)
        if with_model:
            _unreported[digest] = _unreported.get(digest, 0.0) + time.perf_counter() - t0
        return runtime


def release_planner(digest: str) -> None:
    """Drop this process's planning runtime of a bundle (its tokenizer and chat-template sandboxes)
    and hand the memory it freed back: a job's driver once the job is planned, which then only
    steps it (a later `open_runtime` loads it again)."""
    with _loading:
        runtime = _loaded.pop((digest, "cpu", False, "native"), None)
    if runtime is None:
        return
    if (close := getattr(runtime, "close", None)) is not None:
        close()
    del runtime
    import gc

    from batchinf.runtime.malloc import release_freed_memory

    gc.collect()
    release_freed_memory()


def take_load_seconds(digest: str) -> float:
    """Seconds this process spent loading the bundle (with its model) since the last call: what
    the attempt that asks first paid for it, or its worker paid ahead (`attempts.load_seconds`)."""
    with _loading:
        return _unreported.pop(digest, 0.0)


def _load(key: tuple[str, str, bool, str], replay: bool = False) -> Any:
    """`replay`: replay the fixtures even where this machine remembers they passed (engines/replayed.py)."""
    from batchinf import engines
    from batchinf.engines.replayed import replay_once

    digest, device, with_model, engine = key
    root = local_dir(digest)
    meta = rb.read_meta(root)
    rb.verify_files(root, meta, digest, cache_dir=settings().home / "cache" / "verified")
    task = get_task(meta.get("task", "embed"))
    runtime = engines.open_runtime(engine, task, root, meta, device)
    cache = settings().home / "cache"
    if replay:
        task.verify_inputs(runtime)
    else:
        replay_once(lambda: task.verify_inputs(runtime), digest, engine, device, cache / "inputs-checked")
    if with_model:
        keep_freed_memory(settings().malloc_keep_bytes)
        if getattr(runtime, "uses_torch", task.uses_torch):
            use_torch_threads()
        runtime.load_model()
        if replay:
            engines.verify_model(task, runtime)
        else:
            replay_once(lambda: engines.verify_model(task, runtime), digest, engine, device, cache / "replayed")
        release_freed_memory()
    _loaded[key] = runtime
    return runtime


def require_device(device: str) -> None:
    """Raise DeviceUnavailableError when `device` is cuda and this process has no CUDA."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise DeviceUnavailableError(f"device {device} requested but this worker has no CUDA; "
                                         "use --device cpu or auto")


def verify_bundle(ref: str) -> dict[str, Any]:
    """Every file against its digest and every fixture replayed, now (what a load may remember)."""
    digest = resolve_ref(ref)
    with _loading:
        runtime = _load((digest, "cpu", True, "native"), replay=True)
    return {"digest": digest, "ok": True, "files": len(runtime.meta["files"]),
            "fixtures": len(runtime.meta["fixtures"])}
