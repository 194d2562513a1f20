"""Job manifests (DESIGN.md §4): parsed from YAML or JSON, unknown keys rejected by name."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from batchinf.errors import ManifestError

TASKS = ("embed", "generate")
FORMATS = ("jsonl", "parquet", "openai-batch")
DEVICES = ("auto", "cpu", "cuda")
IMPLEMENTED_TASKS = TASKS
IMPLEMENTED_FORMATS = FORMATS


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    uri: str | None = None          # a prefix or one object
    manifest: str | None = None     # instead of uri: a JSONL list of objects (key/uri, version_id)
    format: str = "jsonl"
    id_field: str = "id"
    text_field: str = "text"            # embed: the text to embed
    prompt_field: str | None = None     # generate: a plain prompt (default "prompt")
    messages_field: str | None = None   # generate: chat messages [{role, content}], instead of a prompt

    def value_field(self, task: str) -> tuple[str, str]:
        """(field name, kind) a jsonl/parquet record is read by: kind is text, prompt or messages."""
        if task == "embed":
            return self.text_field, "text"
        if self.messages_field:
            return self.messages_field, "messages"
        return self.prompt_field or "prompt", "prompt"


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    max_records: int = 4096
    max_tokens: int = 1_000_000


@dataclass(frozen=True, kw_only=True)
class EmbedOptions:
    max_length: int | None = None          # default: the bundle's max length (never above it)
    max_batch_tokens: int = 2048           # padded tokens per forward batch (CPU sweet spot)
    truncate: bool = True                  # False: over-long records become error rows
    device: str = "auto"                   # auto | cpu | cuda


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    max_tokens: int = 256                  # generated tokens per record, at most
    temperature: float = 0.0               # 0: greedy
    top_k: int = 0                         # 0: off
    top_p: float = 1.0
    seed: int = 0                          # job seed; each record samples with derive_seed(seed, id)
    stop: tuple[str, ...] = ()             # stop strings: text ends before the first match
    stop_token_ids: tuple[int, ...] = ()   # in addition to the bundle's end-of-sequence ids
    max_batch_tokens: int = 16384          # KV-cache budget: sum over slots of prompt + max_tokens
    max_slots: int = 64                    # sequences decoded together
    device: str = "auto"


@dataclass(frozen=True, kw_only=True)
class JobManifest:
    name: str
    task: str
    bundle: str
    input: InputSpec
    output_uri: str
    shards: ShardSpec = field(default_factory=ShardSpec)
    options: EmbedOptions | GenerateOptions = field(default_factory=EmbedOptions)
    deadline_seconds: float | None = None
    priority: int = 0
    idempotency_key: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["output"] = {"uri": d.pop("output_uri")}
        return d

    def content_key(self) -> str:
        """Default idempotency key: the same manifest resumes the same job."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return "manifest-sha256:" + hashlib.sha256(blob).hexdigest()


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def parse_duration(value: Any, where: str) -> float:
    m = None if isinstance(value, bool) else _DURATION.match(str(value))
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)] if m else 0.0
    if seconds <= 0:
        raise ManifestError(f"{where}: {value!r} is not a positive duration; write e.g. 90s, 30m, 6h or 1d")
    return seconds


def _section(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ManifestError(f"{where} must be a mapping, got {type(raw).__name__}")
    known = {f for f in cls.__dataclass_fields__}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ManifestError(f"unknown key {where}.{unknown[0]}; allowed keys: {', '.join(sorted(known))}")
    defaults = cls()
    values = {}
    for k, v in raw.items():
        expect = type(getattr(defaults, k))
        if getattr(defaults, k) is None:
            # optional field: check the type its annotation names ("int | None"); null stays allowed
            hint = str(cls.__dataclass_fields__[k].type).split("|")[0].strip()
            expect = {"int": int, "str": str}.get(hint) if v is not None else None
        if expect is bool and not isinstance(v, bool):
            raise ManifestError(f"{where}.{k} must be true or false, got {v!r}")
        if expect is int and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ManifestError(f"{where}.{k} must be a positive integer, got {v!r}")
        if expect is str and not isinstance(v, str):
            raise ManifestError(f"{where}.{k} must be a string, got {v!r}")
        values[k] = v
    return cls(**values)


def _number(v: Any, where: str, lo: float, hi: float, *, lo_open: bool = False) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        raise ManifestError(f"{where} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _strings(v: Any, where: str) -> tuple[str, ...]:
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise ManifestError(f"{where} must be a non-empty string or a list of them, got {v!r}")
    return tuple(v)


def _generate_options(raw: Any) -> GenerateOptions:
    """Generate options: ints and the device through _section, then the fields _section cannot
    type (floats, seed 0, top_k 0, lists)."""
    if raw is None:
        return GenerateOptions()
    if not isinstance(raw, dict):
        raise ManifestError(f"options must be a mapping, got {type(raw).__name__}")
    special = {"temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids"}
    opts = _section(GenerateOptions, {k: v for k, v in raw.items() if k not in special}, "options")
    values: dict[str, Any] = {}
    if "temperature" in raw:
        values["temperature"] = _number(raw["temperature"], "options.temperature", 0, 2)
    if "top_p" in raw:
        values["top_p"] = _number(raw["top_p"], "options.top_p", 0, 1, lo_open=True)
    for k in ("top_k", "seed"):
        v = raw.get(k, 0)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ManifestError(f"options.{k} must be a non-negative integer, got {v!r}")
        values[k] = v
    if raw.get("stop") is not None:
        values["stop"] = _strings(raw["stop"], "options.stop")
    ids = raw.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ManifestError(f"options.stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}")
    values["stop_token_ids"] = tuple(ids)
    return GenerateOptions(**{**opts.__dict__, **values})


def _check_input(inp: InputSpec, task: str) -> None:
    if bool(inp.uri) == bool(inp.manifest):
        raise ManifestError("input needs exactly one of uri (a prefix or object) or manifest "
                            "(a JSONL list of objects)")
    if inp.format not in FORMATS:
        raise ManifestError(f"input.format {inp.format!r} is not supported; use one of {', '.join(FORMATS)}")
    if inp.format not in IMPLEMENTED_FORMATS:
        raise ManifestError(f"input.format {inp.format!r} is not implemented yet; use "
                            f"{' or '.join(IMPLEMENTED_FORMATS)}")
    if inp.format == "openai-batch":
        # each line's custom_id, url and body say everything; field names do not apply
        if (inp.id_field, inp.text_field, inp.prompt_field, inp.messages_field) != ("id", "text", None, None):
            raise ManifestError("input.format openai-batch reads custom_id and body from each line; "
                                "remove input.id_field / text_field / prompt_field / messages_field")
        return
    if task == "embed" and (inp.prompt_field or inp.messages_field):
        raise ManifestError("input.prompt_field and input.messages_field are for task: generate; "
                            "an embed job reads input.text_field")
    if task == "generate" and inp.prompt_field and inp.messages_field:
        raise ManifestError("input: give prompt_field (plain prompts) or messages_field (chat "
                            "messages), not both")
    if task == "generate" and inp.text_field != "text":
        raise ManifestError("input.text_field is for task: embed; a generate job reads "
                            "input.prompt_field (plain prompts) or input.messages_field (chat)")


TOP_KEYS = {"name", "task", "bundle", "input", "output", "shards", "options", "deadline",
            "priority", "idempotency_key"}


def parse_manifest(raw: Any) -> JobManifest:
    if not isinstance(raw, dict):
        raise ManifestError("a job manifest must be a mapping with name, task, bundle, input and output")
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise ManifestError(f"unknown key {unknown[0]!r}; allowed keys: {', '.join(sorted(TOP_KEYS))}")
    for key in ("name", "bundle", "input", "output"):
        if key not in raw:
            raise ManifestError(f"missing required key {key!r}")
    task = raw.get("task", "embed")
    if task not in TASKS:
        raise ManifestError(f"task {task!r} is not supported; use one of {', '.join(TASKS)}")
    if task not in IMPLEMENTED_TASKS:
        raise ManifestError(f"task {task!r} is not implemented yet; this version runs: "
                            f"{', '.join(IMPLEMENTED_TASKS)}")
    inp = _section(InputSpec, raw["input"], "input")
    _check_input(inp, task)
    options = (_generate_options(raw.get("options")) if task == "generate"
               else _section(EmbedOptions, raw.get("options"), "options"))
    if options.device not in DEVICES:
        raise ManifestError(f"options.device {options.device!r} is not one of {', '.join(DEVICES)}")
    out = raw["output"]
    if not isinstance(out, dict) or set(out) != {"uri"} or not isinstance(out["uri"], str):
        raise ManifestError("output must be a mapping with exactly one key, uri")
    priority = raw.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ManifestError(f"priority must be an integer, got {priority!r}")
    key = raw.get("idempotency_key")
    if key is not None and (not isinstance(key, str) or not key):
        raise ManifestError("idempotency_key must be a non-empty string")
    return JobManifest(
        name=str(raw["name"]), task=task, bundle=str(raw["bundle"]), input=inp,
        output_uri=out["uri"], shards=_section(ShardSpec, raw.get("shards"), "shards"),
        options=options,
        deadline_seconds=parse_duration(raw["deadline"], "deadline") if raw.get("deadline") is not None else None,
        priority=priority, idempotency_key=key)


def load_manifest(path: str | Path) -> JobManifest:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc.strerror}") from exc
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ManifestError(f"manifest {path} is not valid YAML/JSON: {exc}") from exc
    return parse_manifest(raw)


def manifest_from_dict(d: dict[str, Any]) -> JobManifest:
    """Inverse of JobManifest.to_dict (as stored in the ledger)."""
    d = dict(d)
    deadline = d.pop("deadline_seconds", None)
    d["output"] = d.pop("output")
    m = parse_manifest({k: v for k, v in d.items() if v is not None})
    return JobManifest(**{**m.__dict__, "deadline_seconds": deadline})
