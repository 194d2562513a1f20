"""Model bundles: import, content digest, verification, loading.

A bundle is a directory of HF-format files plus `bundle.json`, whose canonical JSON's sha256 is
the bundle digest. `bundle.json` pins every file's sha256 and carries fixtures (texts with their
expected token IDs and embeddings); loading checks all of it before the first record is touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from batchinf.digests import sha256_file, sha256_file_cached
from batchinf.errors import BundleError
from batchinf.runtime.embed import EmbedRuntime
from batchinf.runtime.families import DECODER_ARCHITECTURES, DECODER_TYPES, ENCODER_TYPES

BUNDLE_FORMAT = 1
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
FIXTURE_TEXTS = [
    "batchinf pins every input and the model before it runs.",
    "Short.",
    "Ünïcödé, emoji 🚀 and CJK 中文 survive tokenization.",
    " ".join(["A long fixture that runs past the maximum length of the bundle."] * 60),
]


def canonical(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def digest_of(meta: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(canonical(meta)).hexdigest()


def _refuse_pickles(paths: list[str], where: str) -> None:
    for p in paths:
        if p.lower().endswith(PICKLE_SUFFIXES):
            raise BundleError(f"{where}: refusing pickle checkpoint {p!r}: pickles can execute code "
                              "when loaded. Convert it to safetensors and remove it from the bundle.")


def file_path(root: Path, name: object, where: str = "bundle.json") -> Path:
    """`root / name` for a file name listed in bundle.json, refusing any name that could reach
    outside the bundle directory: absolute, `..`, backslashes, or resolving elsewhere."""
    bad = (not isinstance(name, str) or not name or "\\" in name or "\x00" in name or name == "bundle.json"
           or PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts)
    if not bad:
        path = root / name
        bad = not path.resolve().is_relative_to(root.resolve())
    if bad:
        raise BundleError(f"{where}: refusing file name {name!r}: bundle file names are relative paths inside "
                          "the bundle directory (no absolute paths, '..' or links that lead outside it)")
    return path


def file_names(meta: Any, where: str) -> dict[str, str]:
    """bundle.json's `files` (name -> sha256), each name checked with `file_path`."""
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise BundleError(f"{where}: 'files' must map file names to sha256 digests; re-import the bundle")
    for name in files:
        file_path(Path("/bundle"), name, where)
    return files


def _bundle_files(src: Path, weights: str | None = ".safetensors") -> list[str]:
    """The model directory's files. A symlink is followed only when it stays inside the directory
    (e.g. a shared blob next to it); one that leads elsewhere is refused. `weights`: the suffix
    its weight files must have (None: the caller checks them)."""
    src = src.resolve()
    found = [p for p in src.rglob("*")
             if p.is_file() and not any(part.startswith(".") for part in p.relative_to(src).parts)
             and p.name != "bundle.json"]
    for p in found:
        if not p.resolve().is_relative_to(src):
            raise BundleError(f"{src}: refusing {p.relative_to(src)}: it is a symlink to {p.resolve()}, outside "
                              "the model directory; copy the real file in (e.g. `cp -rL`) and import again")
    files = sorted(str(p.relative_to(src)) for p in found)
    _refuse_pickles(files, str(src))
    if weights is not None:
        require_weights(src, files, weights)
    return files


def require_weights(src: Path, files: list[str], weights: str) -> None:
    if not any(f.endswith(weights) for f in files):
        raise BundleError(f"{src}: no *{weights} weights found; batchinf loads safetensors only "
                          "(and CTranslate2 Whisper directories, whose model.bin import renames model.ct2)")


GREEDY_FIXTURES = 2         # fixtures that also pin a greedy continuation
GREEDY_FIXTURE_TOKENS = 8


def _family(config: dict[str, Any]) -> tuple[str, str]:
    model_type = config.get("model_type", "")
    if model_type in ENCODER_TYPES:
        return model_type, "embed"
    if model_type in DECODER_TYPES or any(a in DECODER_ARCHITECTURES for a in config.get("architectures") or ()):
        return "llama", "generate"
    raise BundleError(f"model_type {model_type!r} is not supported yet; supported families: "
                      f"{', '.join(ENCODER_TYPES)} (embed), llama ({', '.join(DECODER_TYPES)}: generate)")


def bundle_files(src: Path, weights: str | None = ".safetensors") -> list[str]:
    """The files a bundle of `src` pins (hidden files and bundle.json aside); pickles refused."""
    return _bundle_files(src, weights)


def build_meta(src: Path, *, max_length: int | None = None, dtype: str = "float32") -> dict[str, Any]:
    """bundle.json for a BERT encoder or a Llama-family decoder directory (the task registry's
    `batchinf.tasks.build_meta` covers every task)."""
    files = _bundle_files(src)
    if "tokenizer.json" not in files or "config.json" not in files:
        raise BundleError(f"{src}: a bundle needs config.json and tokenizer.json")
    family, _ = _family(json.loads((src / "config.json").read_text()))
    if family == "llama":
        return _build_generate_meta(src, files, max_length=max_length, dtype=dtype)
    return build_embed_meta(src, files, max_length=max_length, dtype=dtype)


def build_embed_meta(src: Path, files: list[str], *, max_length: int | None = None,
                     dtype: str = "float32") -> dict[str, Any]:
    """bundle.json for an embedding model (an encoder, or a native decoder shipped as a
    sentence-transformers model): file digests, max length, the sentence-transformers pipeline
    (pooling, Dense, Normalize, prompts), and fixtures (one more per prompt, the prompt prepended)
    computed with our own runtime on CPU in float32."""
    from batchinf.runtime.encoder import sentence_transformers_max_length
    from batchinf.runtime.st_modules import read_pipeline
    from batchinf.runtime.tokenizer import TextTokenizer

    config = json.loads((src / "config.json").read_text())
    model_type = str(config.get("model_type", ""))
    decoder = model_type in DECODER_TYPES
    fallback = model_type not in ENCODER_TYPES and not decoder
    if fallback:
        from batchinf.runtime.hf_fallback import fallback_architecture

        if fallback_architecture(config, src) is None:
            _family(config)     # raises, naming what is supported
    offset = int(config.get("pad_token_id", 1) or 0) + 1 if model_type in ("xlm-roberta", "roberta") else 0
    limit = int(config.get("max_position_embeddings", 512)) - offset
    max_length = max_length or sentence_transformers_max_length(src) or limit
    if max_length > limit:
        raise BundleError(f"max length {max_length} exceeds the model's {limit} positions")
    tok = TextTokenizer.from_file(src / "tokenizer.json", max_length)
    specials = {name: tok.token_id(tok_str) for name, tok_str in
                (("pad", "[PAD]"), ("cls", "[CLS]"), ("sep", "[SEP]"), ("unk", "[UNK]"), ("mask", "[MASK]"),
                 ("pad", "<pad>"), ("bos", "<s>"), ("eos", "</s>"), ("unk", "<unk>")) if tok.token_id(tok_str) is not None}
    meta: dict[str, Any] = {
        "format": BUNDLE_FORMAT, "task": "embed", "family": model_type, "dtype": dtype, "max_length": max_length,
        **read_pipeline(src), "special_tokens": specials, "files": {f: sha256_file(src / f) for f in files},
    }
    if decoder:
        meta["encoder"] = "decoder"
    if fallback:
        from batchinf.runtime.hf_fallback import IMPLEMENTATION, implementation

        meta["encoder"], meta["implementation"] = IMPLEMENTATION, implementation()
    if not meta["dense"]:
        del meta["dense"]   # bundle.json of a plain encoder stays as it was (same digest)
    runtime = EmbedRuntime(src, meta, device="cpu", dtype_override="float32")
    texts = [(t, None) for t in FIXTURE_TEXTS] + [(p + FIXTURE_TEXTS[0], n) for n, p in meta.get("prompts", {}).items()]
    encoded = [e.ids for e in runtime.tokenizer.encode_batch([t for t, _ in texts])]
    vectors, _ = runtime.embed(encoded)
    meta["fixtures"] = [{"text": t, "token_ids": ids, "embedding": [round(float(x), 7) for x in v],
                         **({"prompt_name": n} if n else {})} for (t, n), ids, v in zip(texts, encoded, vectors)]
    return meta


def _json_or_empty(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _build_generate_meta(src: Path, files: list[str], *, max_length: int | None, dtype: str) -> dict[str, Any]:
    """bundle.json for a Llama-family decoder: context length, special tokens, decoding defaults,
    and fixtures (token ids of fixed texts; greedy continuations of the first few) computed with
    our own runtime on CPU in float32."""
    from batchinf.runtime.families import is_decoder
    from batchinf.runtime.generation.runtime import GenerateRuntime
    from batchinf.runtime.generation.sampling import SamplingParams
    from batchinf.runtime.generation.seq import GenRequest

    if dtype not in ("float32", "bfloat16", "float16"):
        raise BundleError(f"dtype {dtype!r} is not supported; use float32 or bfloat16")
    config = json.loads((src / "config.json").read_text())
    native = is_decoder(config)
    if native:
        from batchinf.runtime.llama import config_of

        cfg = config_of(config)
        if cfg.bidirectional:
            raise BundleError(f"{src}: use_bidirectional_attention makes this model an encoder (EmbeddingGemma); "
                              "it cannot generate. Import it as a sentence-transformers directory (modules.json "
                              "with a Pooling module) for task embed")
        family, model_type, limit = "llama", cfg.model_type, cfg.context_length
    else:   # no native decoder: transformers' own causal LM computes it (runtime/hf_decoder.py)
        from batchinf.runtime.hf_decoder import context_length

        family = model_type = str(config.get("model_type"))
        limit = context_length(config)
    context = max_length or limit
    if context > limit:
        raise BundleError(f"max length {context} exceeds the model's {limit} positions")
    gen_cfg = _json_or_empty(src / "generation_config.json")
    tok_cfg = _json_or_empty(src / "tokenizer_config.json")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))

    def ids_of(value: Any) -> list[int]:
        return [int(v) for v in (value if isinstance(value, list) else [value]) if v is not None]

    def token_of(name: str) -> str | None:
        value = tok_cfg.get(name)
        return value.get("content") if isinstance(value, dict) else value

    eos_ids = ids_of(gen_cfg.get("eos_token_id")) or ids_of(config.get("eos_token_id"))
    if token_of("eos_token") and tok.token_to_id(token_of("eos_token")) is not None:
        eos_ids.append(tok.token_to_id(token_of("eos_token")))
    if not eos_ids:
        raise BundleError(f"{src}: no eos token id in generation_config.json, config.json or tokenizer_config.json")
    bos = ids_of(gen_cfg.get("bos_token_id")) or ids_of(config.get("bos_token_id"))
    specials = {"eos_ids": sorted(set(eos_ids)), "bos_id": bos[0] if bos else None,
                **{name: token_of(name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}}
    do_sample = bool(gen_cfg.get("do_sample", False))
    decoding = {"temperature": float(gen_cfg.get("temperature", 1.0)) if do_sample else 0.0,
                "top_k": int(gen_cfg.get("top_k", 0) or 0) if do_sample else 0,
                "top_p": float(gen_cfg.get("top_p", 1.0) or 1.0) if do_sample else 1.0}
    meta: dict[str, Any] = {
        "format": BUNDLE_FORMAT, "task": "generate", "family": family, "model_type": model_type,
        "dtype": dtype, "context_length": context, "special_tokens": specials,
        "chat_template": bool(tok_cfg.get("chat_template")), "decoding": decoding,
        "files": {f: sha256_file(src / f) for f in files},
    }
    if not native:
        from batchinf.runtime.hf_fallback import implementation

        meta["implementation"] = implementation()
    runtime = GenerateRuntime(src, meta, device="cpu", dtype_override="float32")
    check_chat_template(runtime, src)
    fixtures: list[dict[str, Any]] = [{"text": t, "token_ids": runtime.encode_prompt(t)} for t in FIXTURE_TEXTS]
    requests = [GenRequest(i, fx["token_ids"], SamplingParams(max_tokens=GREEDY_FIXTURE_TOKENS))
                for i, fx in enumerate(fixtures[:GREEDY_FIXTURES])]
    for r in runtime.generate(requests):
        fixtures[r.key].update(continuation=r.token_ids, finish_reason=r.finish_reason)
    meta["fixtures"] = fixtures
    return meta


CHAT_FIXTURES = ([{"role": "user", "content": FIXTURE_TEXTS[0]}],
                 [{"role": "user", "content": FIXTURE_TEXTS[1]}, {"role": "assistant", "content": FIXTURE_TEXTS[2]},
                  {"role": "user", "content": FIXTURE_TEXTS[3]}])


def check_chat_template(runtime: Any, src: Path) -> None:
    """A bundle's chat template must render its fixture conversations within the sandbox's limits
    (the first, one user message, must render at all); else the bundle is refused."""
    from batchinf.runtime.chat_template import TemplateLimitError

    if not runtime.meta.get("chat_template"):
        return
    for i, messages in enumerate(CHAT_FIXTURES):
        try:
            runtime.render_chat(messages)
        except BundleError:         # it does not compile
            raise
        except Exception as e:  # noqa: BLE001 -- whatever the template does, the bundle is refused with it
            if i == 0 or isinstance(e.__cause__, TemplateLimitError) or not isinstance(e, ValueError):
                raise BundleError(f"{src / 'tokenizer_config.json'}: the chat template cannot render fixture "
                                  f"conversation {i} ({e}); fix or remove chat_template") from e


def verify_files(root: Path, meta: dict[str, Any], digest: str | None = None, *,
                 cache_dir: Path | None = None) -> None:
    """Every file bundle.json pins is present and has its sha256 (remembered in `cache_dir` per
    file identity, see `digests.sha256_file_cached`); no pickle file anywhere."""
    if digest is not None and digest_of(meta) != digest:
        raise BundleError(f"{root}/bundle.json does not match digest {digest}: the bundle was modified "
                          "after import; re-import it")
    files = file_names(meta, f"{root}/bundle.json")
    _refuse_pickles(list(files), f"{root}/bundle.json")
    present = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    _refuse_pickles(present, str(root))
    for name, want in files.items():
        path = file_path(root, name, f"{root}/bundle.json")
        if not path.is_file():
            raise BundleError(f"bundle file {path} is missing; re-import the bundle")
        got = sha256_file_cached(path, cache_dir)
        if got != want:
            raise BundleError(f"bundle file {path} was modified (sha256 {got[:12]}…, bundle.json says "
                              f"{want[:12]}…); restore it or re-import the bundle")


def verify_tokenizer_fixtures(runtime: Any) -> None:
    """Embed or generate runtime: each fixture text must give its recorded token ids."""
    for i, fx in enumerate(runtime.meta["fixtures"]):
        got = runtime.encode_fixture(fx["text"])
        if got != fx["token_ids"]:
            first = next((j for j, (a, b) in enumerate(zip(got, fx["token_ids"])) if a != b),
                         min(len(got), len(fx["token_ids"])))
            raise BundleError(
                f"tokenizer drift in {runtime.root / 'tokenizer.json'}: fixture {i} ({fx['text'][:40]!r}) "
                f"tokenizes differently from import time (first difference at position {first}); "
                "pin the tokenizers version the bundle was imported with, or re-import the bundle")


def verify_model_fixtures(runtime: Any) -> None:
    """Encoder: each fixture's embedding within cosine 0.9999 (float32); decoder: see below."""
    if hasattr(runtime, "generate"):     # a decoder (native or the transformers fallback)
        return verify_generate_fixtures(runtime)
    ids = [fx["token_ids"] for fx in runtime.meta["fixtures"]]
    got, _ = runtime.embed(ids)
    want = np.asarray([fx["embedding"] for fx in runtime.meta["fixtures"]], dtype=np.float32)
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1) + 1e-12)
    import torch

    floor = 0.9999 if next(runtime.model.parameters()).dtype == torch.float32 else 0.99
    if runtime.meta.get("precision") == "int8":     # runtime/int8.py: the bound its import was gated on
        floor = float(runtime.meta["precision_gate"]["min_cosine"])
    bad = np.flatnonzero(cos < floor)
    if bad.size:
        i = int(bad[0])
        raise BundleError(f"model fixture {i} of bundle {runtime.root} gives cosine {cos[i]:.6f} < "
                          f"{floor} against its recorded embedding: weights or runtime changed"
                          f"{' (int8, against the float32 reference)' if 'precision_gate' in runtime.meta else ''}")


def verify_generate_fixtures(runtime: Any) -> None:
    """Greedy continuations must match exactly in float32; in lower precision each recorded token
    must stay among the model's top 5 when the recorded continuation is fed back (teacher forcing)."""
    import torch

    from batchinf.runtime.generation.sampling import SamplingParams
    from batchinf.runtime.generation.seq import GenRequest

    pinned = [(i, fx) for i, fx in enumerate(runtime.meta["fixtures"]) if "continuation" in fx]
    exact = runtime.model.dtype == torch.float32
    if exact:
        reqs = [GenRequest(i, fx["token_ids"], SamplingParams(max_tokens=GREEDY_FIXTURE_TOKENS)) for i, fx in pinned]
        got = {r.key: (r.token_ids, r.finish_reason) for r in runtime.generate(reqs)}
    for i, fx in pinned:
        want = (fx["continuation"], fx["finish_reason"])
        if exact:
            ok = got[i] == want
        else:
            ok = runtime.teacher_forced_rank(fx["token_ids"], fx["continuation"]) < 5
        if not ok:
            raise BundleError(f"model fixture {i} of bundle {runtime.root} no longer gives its recorded greedy "
                              f"continuation {want[0]}{' (got ' + str(got[i][0]) + ')' if exact else ''}: "
                              "weights or runtime changed; restore the bundle or re-import it")


def write_bundle_dir(src: Path, dst: Path, meta: dict[str, Any]) -> None:
    """Copy the bundle's files and its bundle.json into dst (atomically via a temp dir)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".import-", dir=dst.parent))
    for name in file_names(meta, f"{src}/bundle.json"):
        target = file_path(tmp, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(file_path(src, name), target)
    (tmp / "bundle.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    if dst.exists():
        shutil.rmtree(tmp)
        return
    os.replace(tmp, dst)


def read_meta(root: Path) -> dict[str, Any]:
    path = root / "bundle.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise BundleError(f"{path} is missing; import the directory with `batchinf bundle import`") from exc
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path} is not valid JSON ({exc}); re-import the bundle") from exc
