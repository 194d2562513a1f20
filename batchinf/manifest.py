"""Job manifests, described once: the typed models below validate a manifest read from YAML or
JSON (unknown keys rejected by name, every message naming the field's path and the fix), and
the JSON Schema in manifests/job.schema.json is generated from them:

    python -m batchinf.manifest --schema > manifests/job.schema.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Union

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)
from pydantic.json_schema import GenerateJsonSchema

from batchinf.documents import DocumentError, parse_document
from batchinf.engines import ENGINES
from batchinf.errors import ManifestError
from batchinf.manifest_rules import (BOOLEAN, DURATION, INT64_MIN, KEY, LIMITED, NAME, NULL_IS_DEFAULT, OUTPUT, STRING, TEXT,
                                     Section, Refused, choice, integer, manifest_error, nullable, number, parse_duration,
                                     positive)
from batchinf.tasks import TASKS as TASK_REGISTRY
from batchinf.tasks import EmbedOptions, GenerateOptions
from batchinf.tasks.embed import DEVICES

__all__ = ["DEVICES", "FORMATS", "TASKS", "EmbedOptions", "GenerateOptions", "InputSpec", "JobManifest",
           "ShardSpec", "job_schema", "load_manifest", "manifest_from_dict", "parse_duration", "parse_manifest",
           "schema_text"]

TASKS = tuple(TASK_REGISTRY)
FORMATS = ("jsonl", "parquet", "openai-batch", "audio")
MAX_TARGET_WORKERS = 10_000
NOT_A_MAPPING = "a job manifest must be a mapping with name, task, bundle, input and output"




class InputSpec(Section):
    """Where the records come from, and the fields each record is read by."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [   # exactly one of uri or manifest
        {"required": [key], "properties": {key: {"type": "string", "minLength": 1}}} for key in ("uri", "manifest")]})
    uri: Annotated[str | None, nullable(STRING)] = Field(
        None, description="a prefix (ending in /) or one object: s3://, file:// or a local path")
    manifest: Annotated[str | None, nullable(STRING)] = Field(
        None, description="instead of uri: a JSONL list of objects, {uri} or {bucket, key}, optional version_id")
    format: Annotated[str, choice(FORMATS)] = Field(
        "jsonl", description="openai-batch: lines {custom_id, method, url, body} for /v1/chat/completions, "
                             "/v1/completions or /v1/embeddings; their custom_id and body say everything; "
                             "audio: each object is an audio file (task transcribe), its key under the prefix its id")
    id_field: Annotated[str, STRING] = Field("id", description="the field holding each record's id")
    text_field: Annotated[str, STRING] = Field("text", description="embed: the field holding the text")
    prompt_field: Annotated[str | None, nullable(STRING)] = Field(
        None, description='generate: the field holding a plain prompt (default "prompt")')
    messages_field: Annotated[str | None, nullable(STRING)] = Field(
        None, description="generate, instead of a prompt: the field holding chat messages [{role, content}], "
                          "rendered with the bundle's chat template")
    include_hidden: Annotated[bool, BOOLEAN] = Field(
        False, description="also read objects under the prefix whose names start with _ or . (_SUCCESS, "
                           "_common_metadata, .crc files, _work/), which a listing skips by default")

    query_field: Annotated[str | None, nullable(STRING)] = Field(
        None, description='score: the field holding the query (default "query")')
    document_field: Annotated[str | None, nullable(STRING)] = Field(
        None, description='score, one pair per record: the field holding the document (default "document")')
    documents_field: Annotated[str | None, nullable(STRING)] = Field(
        None, description="score, one query per record: the field holding its list of documents")
    image_field: Annotated[str | None, nullable(STRING)] = Field(
        None, description='classify_image: the field holding the image, bytes or an object URI (default "image")')
    audio_field: Annotated[str | None, nullable(STRING)] = Field(
        None, description='transcribe, jsonl / parquet records: the field holding the audio, bytes or an object URI '
                          '(default "audio")')

    def value_field(self, task: str) -> tuple[str, str]:
        """(field name, kind) a jsonl/parquet record is read by: kind text, prompt, messages or record."""
        return TASK_REGISTRY[task].read_as(self)


class ShardSpec(Section):
    """How the input is cut into shards, the unit of work, retry and output."""
    max_records: Annotated[int, LIMITED] = Field(4096, description="records per shard, at most")
    max_tokens: Annotated[int, LIMITED] = Field(1_000_000, description="input tokens per shard, at most")
    target_workers: Annotated[int | None, nullable(positive(MAX_TARGET_WORKERS))] = Field(
        None, description="workers the job is cut for (default: the embedded pool's size, or the workers "
                          "the controller saw lately)")


OPTIONS: dict[str, type[Section]] = {name: t.options for name, t in TASK_REGISTRY.items()}
TaskOptions = Union[tuple(OPTIONS.values())]  # type: ignore[valid-type]  # noqa: UP007 -- built from the registry


def _default_options(data: dict[str, Any]) -> Section:
    return OPTIONS.get(data.get("task", "embed"), EmbedOptions)()


class JobManifest(Section):
    """A batch inference job: which model bundle runs over which input, where the output goes, and how."""
    # a document names output and deadline; Python code output_uri and deadline_seconds
    model_config = ConfigDict(title="batchinf job manifest", validate_by_name=True, validate_by_alias=True)

    name: Annotated[str, NAME] = Field(description="the job's name, shown in its status (printable, at most 200 "
                                                    "characters)")
    task: Annotated[str, choice(TASKS)] = "embed"
    bundle: Annotated[str, TEXT] = Field(
        description="NAME (newest), NAME@ALIAS, or sha256:HEX; resolved to a digest at submit")
    engine: Annotated[str | None, nullable(choice(ENGINES))] = Field(
        None, description="what executes the bundle: native (batchinf's runtime), vllm, or openai-http (the server "
                          "the bundle names); default: the bundle's declared engine, else native. The job waits for "
                          "a worker that has it")
    input: InputSpec
    output_uri: Annotated[str, OUTPUT] = Field(alias="output", description="where the output is published")
    shards: Annotated[ShardSpec, NULL_IS_DEFAULT] = Field(default_factory=ShardSpec)
    options: TaskOptions = Field(
        default_factory=_default_options,
        description="the task's options: " + ", ".join(o.__name__ for o in OPTIONS.values()))
    deadline_seconds: Annotated[float | None, DURATION] = Field(
        None, alias="deadline", description="e.g. 90s, 30m, 6h, 1d (or seconds): a job not finished this long "
                                           "after submit is cancelled")
    priority: Annotated[int, integer(INT64_MIN)] = Field(
        0, description="higher runs first; the operator bounds it (default -100..100)")
    max_error_fraction: Annotated[float | None, nullable(number(0, 1, lo_open=True))] = Field(
        None, description="fail the job once this fraction (0 < x <= 1) of its planned records has failed "
                          "(invalid at planning, or error rows as shards commit); default off")
    idempotency_key: Annotated[str | None, KEY] = Field(
        None, description="same key, same job, never a second one; default: a hash of the manifest")

    @model_validator(mode="before")
    @classmethod
    def _output_uri(cls, data: Any) -> Any:
        """In Python, JobManifest(output_uri=URI); a document says output: {uri: URI}."""
        if isinstance(data, dict) and isinstance(data.get("output_uri"), str):
            return {**data, "output_uri": {"uri": data["output_uri"]}}
        return data

    @field_validator("options", mode="before")
    @classmethod
    def _options_of_task(cls, v: Any, info: ValidationInfo) -> Any:
        if "task" not in info.data:          # the task is wrong: that is the error to report
            return EmbedOptions()
        kind = OPTIONS[info.data["task"]]
        if isinstance(v, BaseModel):
            if not isinstance(v, kind):
                raise Refused(f"options of task {info.data['task']} are {kind.__name__}, not {type(v).__name__}")
            return v
        try:
            return kind.model_validate({} if v is None else v)
        except ValidationError as exc:
            raise Refused(str(manifest_error(exc, kind, "options"))) from None

    @model_validator(mode="after")
    def _input_suits_task(self) -> JobManifest:
        problem = _input_problem(self.input, self.task)
        if problem:
            raise Refused(problem)
        return self

    def to_dict(self) -> dict[str, Any]:
        d = self.model_dump()
        d["output"] = {"uri": d.pop("output_uri")}
        return d

    def content_key(self) -> str:
        """Default idempotency key: the same manifest resumes the same job. Only the fields that
        differ from their defaults count, so a field added later changes no key until it is set."""
        d = self.model_dump(mode="json", exclude_defaults=True)
        d["output"] = {"uri": d.pop("output_uri")}
        blob = json.dumps(_without_empty(d), sort_keys=True).encode()
        return "manifest-sha256:" + hashlib.sha256(blob).hexdigest()


def _without_empty(d: dict[str, Any]) -> dict[str, Any]:
    """`d` less the sections left empty by exclude_defaults: `options: {}` and no options are one."""
    out = {k: _without_empty(v) if isinstance(v, dict) else v for k, v in d.items()}
    return {k: v for k, v in out.items() if v != {}}


def _input_problem(inp: InputSpec, task: str) -> str | None:
    if bool(inp.uri) == bool(inp.manifest):
        return "input needs exactly one of uri (a prefix or object) or manifest (a JSONL list of objects)"
    if inp.format == "openai-batch":
        # each line's custom_id, url and body say everything; field names do not apply
        if (inp.id_field, inp.text_field, inp.prompt_field, inp.messages_field, inp.query_field, inp.document_field,
                inp.documents_field, inp.image_field, inp.audio_field) != ("id", "text", None, None, None, None, None, None,
                                                                          None):
            return ("input.format openai-batch reads custom_id and body from each line; "
                    "remove input.id_field / text_field / prompt_field / messages_field")
        return None
    return TASK_REGISTRY[task].input_problem(inp)


def parse_manifest(raw: Any) -> JobManifest:
    """A manifest document (parsed YAML/JSON) -> JobManifest, or ManifestError naming the first problem."""
    try:
        return JobManifest.model_validate(raw, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise manifest_error(exc, JobManifest, "", NOT_A_MAPPING) from None


def load_manifest(path: str | Path) -> JobManifest:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc.strerror}") from exc
    try:
        raw = parse_document(text, "json" if path.suffix == ".json" else "yaml")
    except DocumentError as exc:
        raise ManifestError(f"manifest {path} is not valid YAML/JSON: {exc}") from exc
    return parse_manifest(raw)


def manifest_from_dict(d: dict[str, Any]) -> JobManifest:
    """Inverse of JobManifest.to_dict (as stored in the ledger)."""
    d = dict(d)
    deadline = d.pop("deadline_seconds", None)
    m = parse_manifest({k: v for k, v in d.items() if v is not None})
    return m.model_copy(update={"deadline_seconds": deadline})


# --- JSON Schema ---------------------------------------------------------------------------------


class _Schema(GenerateJsonSchema):
    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def job_schema() -> dict[str, Any]:
    """The JSON Schema of a manifest document, generated from the models (checked in as
    manifests/job.schema.json). Which options a manifest may give depends on its task."""
    schema = JobManifest.model_json_schema(by_alias=True, mode="validation", schema_generator=_Schema)
    props = schema["properties"]
    props["options"] = {"type": ["object", "null"], "description": props["options"]["description"]}
    default_task = JobManifest.model_fields["task"].default
    by_task = []
    for task, kind in OPTIONS.items():
        named = {"required": ["task"], "properties": {"task": {"const": task}}}
        by_task.append({"if": {"anyOf": [{"not": {"required": ["task"]}}, named]} if task == default_task
                        else named,
                        "then": {"properties": {"options": {"anyOf": [{"$ref": f"#/$defs/{kind.__name__}"},
                                                                      {"type": "null"}]}}}})
    head = {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "https://batchinf.dev/schemas/job-manifest.json"}
    order = ["title", "description", "type", "additionalProperties", "required", "properties"]
    return {**head, **{k: schema[k] for k in order}, "allOf": by_task, "$defs": schema["$defs"]}


def schema_text() -> str:
    """job_schema() as the text of manifests/job.schema.json."""
    return json.dumps(job_schema(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m batchinf.manifest", description=__doc__.splitlines()[0])
    parser.add_argument("--schema", action="store_true", help="print the JSON Schema of a job manifest")
    if not parser.parse_args(argv).schema:
        parser.error("nothing to do; --schema prints the JSON Schema of a job manifest")
    print(schema_text(), end="")


if __name__ == "__main__":
    main()
