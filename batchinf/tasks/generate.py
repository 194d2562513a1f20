"""Task generate: text from a decoder (native, or the transformers fallback) for a plain prompt or chat messages. Staged:
prompt token ids and each record's resolved sampling params (length measure: prompt tokens); run:
one continuous batch over the whole shard."""

from __future__ import annotations

import json
from collections import deque
from itertools import islice
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator

import pyarrow as pa
from pydantic import Field

from batchinf.checks import MAX_TOP_LOGPROBS, canonical_response_format, integer_problem, response_format_problem
from batchinf.manifest_rules import BOOLEAN, INT32_MAX, LIMITED, STOP, TOKEN_IDS, Section, Rule, choice, integer, nullable, number
from batchinf.tasks.base import RECORD_FIELDS, STAGE_SCHEMA, RunOutput, StagedRows, Task, ok_rows, record_columns, usable_records
from batchinf.tasks.batching import GenOutcome, generate_isolating
from batchinf.tasks.embed import DEVICES

RENDER_CHUNK = 64        # chat records rendered per round trip to the chat template's sandbox process

# input_ids are the prompt's; each record carries its own resolved sampling params, so a worker
# needs nothing but the staged shard (and a retry reads the very same params)
GENERATE_STAGE_SCHEMA = pa.schema(list(STAGE_SCHEMA) + [
    ("kind", pa.string()),                      # chat | completion
    ("max_tokens", pa.int32()), ("temperature", pa.float64()), ("top_k", pa.int32()),
    ("top_p", pa.float64()), ("seed", pa.int64()), ("stop", pa.list_(pa.string())),
    ("stop_token_ids", pa.list_(pa.int32())),
    ("response_format", pa.string()),           # canonical_response_format JSON; null: plain text
    ("logprobs", pa.int32()),                   # null: off; n: logprobs with the n most likely tokens
])

# one row per record that got an answer. kind: chat | completion; seed: the seed it sampled
# with; output_ids: the generated token ids (without the prompt and the stop token)
GENERATION_SCHEMA = pa.schema(RECORD_FIELDS + [
    ("kind", pa.string()), ("text", pa.string()), ("finish_reason", pa.string()),
    ("input_tokens", pa.int32()), ("output_tokens", pa.int32()),
    ("seed", pa.int64()), ("output_ids", pa.list_(pa.int32())),
    ("logprobs", pa.string()),                  # JSON of OpenAI's logprobs.content list, when asked for
])

RESPONSE_FORMAT = nullable(Rule(response_format_problem, {
    "type": "object", "required": ["type"], "additionalProperties": False,
    "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                   "json_schema": {"type": "object", "required": ["name", "schema"], "additionalProperties": False,
                                   "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                                                  "schema": {"type": "object"}, "description": {"type": "string"},
                                                  "strict": {"type": ["boolean", "null"]}}}},
    "if": {"properties": {"type": {"const": "json_schema"}}}, "then": {"required": ["json_schema"]},
    "else": {"not": {"required": ["json_schema"]}}}))
TOP_LOGPROBS = Rule(lambda v, w: integer_problem(v, w, 0, MAX_TOP_LOGPROBS),
                    {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS})


class GenerateOptions(Section):
    """Options of task generate."""
    max_tokens: Annotated[int, LIMITED] = Field(256, description="generated tokens per record, at most")
    temperature: Annotated[float, number(0, 2)] = Field(0.0, description="0: greedy")
    top_k: Annotated[int, integer(0, INT32_MAX)] = Field(0, description="0: off")
    top_p: Annotated[float, number(0, 1, lo_open=True)] = 1.0
    seed: Annotated[int, integer(0)] = Field(
        0, description="job seed; each record samples with a seed derived from it and the record's id")
    stop: Annotated[tuple[str, ...], STOP] = Field(
        (), description="stop strings: a record's text ends before the first match")
    stop_token_ids: Annotated[tuple[int, ...], TOKEN_IDS] = Field(
        (), description="token ids that end a record, in addition to the bundle's end-of-sequence ids")
    response_format: Annotated[dict[str, Any] | None, RESPONSE_FORMAT] = Field(
        None, description='structured output, as OpenAI: {"type": "json_object"} or {"type": "json_schema", '
                          '"json_schema": {"name", "schema", "strict"}}')
    logprobs: Annotated[bool, BOOLEAN] = Field(False, description="each output token's log-probability")
    top_logprobs: Annotated[int, TOP_LOGPROBS] = Field(
        0, description=f"with logprobs: the most likely tokens at each position (0-{MAX_TOP_LOGPROBS})")
    max_batch_tokens: Annotated[int, LIMITED] = Field(
        16384, description="KV-cache budget: the sum over decoding slots of prompt + max_tokens")
    max_slots: Annotated[int, LIMITED] = Field(64, description="sequences decoded together")
    device: Annotated[str, choice(DEVICES)] = "auto"


def record_params(opts: GenerateOptions, record_id: str, over: dict[str, Any] | None) -> dict[str, Any]:
    """A record's sampling params: the job's options, overridden by the record's own (an
    openai-batch body). The seed is the body's if it gives one (same seed, same answer, as
    OpenAI promises), else derived from the job seed and the record id."""
    from batchinf.runtime.generation.sampling import derive_seed

    over = over or {}
    return {"max_tokens": over.get("max_tokens", opts.max_tokens),
            "temperature": over.get("temperature", opts.temperature),
            "top_k": over.get("top_k", opts.top_k), "top_p": over.get("top_p", opts.top_p),
            "seed": over["seed"] if "seed" in over else derive_seed(opts.seed, record_id),
            "stop": list(over.get("stop", opts.stop)), "stop_token_ids": list(opts.stop_token_ids),
            "response_format": canonical_response_format(over.get("response_format", opts.response_format)),
            "logprobs": (over.get("top_logprobs", opts.top_logprobs)
                         if over.get("logprobs", opts.logprobs) else None)}


class Generate(Task):
    name = "generate"
    options = GenerateOptions
    fields = ("prompt_field", "messages_field")
    stage_schema = GENERATE_STAGE_SCHEMA
    streams = False
    lanes_on_cpu = True         # one copy of the decoder for every core; a decode step's kernels release the GIL
    summary_columns = ("finish_reason",)

    def input_problem(self, inp: Any) -> str | None:
        if inp.prompt_field and inp.messages_field:
            return "input: give prompt_field (plain prompts) or messages_field (chat messages), not both"
        if inp.text_field != "text":
            return ("input.text_field is for task: embed; a generate job reads "
                    "input.prompt_field (plain prompts) or input.messages_field (chat)")
        return super().input_problem(inp)

    def read_as(self, inp: Any) -> tuple[str, str]:
        if inp.messages_field:
            return inp.messages_field, "messages"
        return inp.prompt_field or "prompt", "prompt"

    def limits(self, runtime: Any, options: Any) -> tuple[int, bool]:
        return int(runtime.context_length), False

    def stage(self, obj: Any, runtime: Any, records: Iterator[Any]) -> pa.Table:
        """Tokenize prompts (chat messages through the bundle's chat template) and resolve each
        record's sampling params; a prompt that cannot fit becomes a `prompt_too_long` error row."""
        opts = obj.options or GenerateOptions()
        rows = StagedRows(GENERATE_STAGE_SCHEMA)
        schema_problems: dict[str, str | None] = {}     # each distinct schema compiled once
        rendered: dict[int, Any] = {}       # ordinal -> chat text or its error, for the records read ahead

        def chats(chunk: list[Any]) -> list[Any]:
            return [r for r in chunk if r.error is None and r.messages is not None]

        def render_ahead() -> Iterator[Any]:
            """The records; each chunk's chats rendered in one round trip to the template's sandbox,
            the next chunk's while this one's are tokenized."""
            chunks: deque[list[Any]] = deque()      # read and sent, not handed out yet

            def batches() -> Iterator[list[list[dict]]]:
                it = iter(records)
                while chunk := list(islice(it, RENDER_CHUNK)):
                    chunks.append(chunk)
                    yield [r.messages for r in chats(chunk)]

            for results in runtime.render_batches(batches()):
                chunk = chunks.popleft()
                rendered.clear()
                rendered.update(zip((r.ordinal for r in chats(chunk)), results, strict=True))
                yield from chunk

        for row, r, where in usable_records(obj, render_ahead(), rows):
            try:
                if r.messages is None:
                    ids = runtime.encode_prompt(r.text)
                elif isinstance(text := rendered.pop(r.ordinal), Exception):
                    raise text
                else:
                    ids = runtime.encode_rendered(text)
            except Exception as exc:  # noqa: BLE001 -- a template that rejects a record fails that record
                row.update(error="invalid_messages" if r.messages is not None else "invalid_prompt",
                           message=f"{where}: {exc}")
                continue
            if not ids:
                row.update(error="empty_prompt", message=f"{where}: the prompt encodes to no tokens; nothing to "
                                                         "generate from")
                continue
            params = record_params(opts, r.record_id, r.params)
            need = len(ids) + params["max_tokens"]
            for limit, what, fix in (
                    (obj.max_length, "the bundle's context length",
                     "shorten the prompt or lower max_tokens (options.max_tokens, or the line's body.max_tokens)"),
                    (opts.max_batch_tokens, "options.max_batch_tokens (the KV-cache budget)",
                     "raise options.max_batch_tokens or lower max_tokens")):
                if need > limit:
                    row.update(error="prompt_too_long", message=(
                        f"{where}: prompt of {len(ids)} tokens + max_tokens {params['max_tokens']} = {need} "
                        f"exceeds {what} {limit}; {fix}"))
                    break
            if row["error"] is None and params["response_format"] is not None:
                if params["response_format"] not in schema_problems:
                    from batchinf.runtime.generation.structured import grammar_problem

                    schema_problems[params["response_format"]] = grammar_problem(params["response_format"])
                if (bad := schema_problems[params["response_format"]]):
                    row.update(error="invalid_response_format", message=f"{where}: response_format: {bad}")
            if row["error"] is not None:
                continue
            kind = "chat" if r.messages is not None else "completion"
            row.update(n_tokens=len(ids), input_ids=ids, kind=kind, **params)
        return rows.table()

    def shard_floor(self, options: Any, records: int, work: int, workers: int | None) -> int | None:
        """A shard runs as one continuous batch of up to `max_slots` sequences, a worker's shards
        one after the other: a shard of fewer records than slots leaves them empty for its whole
        run (a worse step per token), while the fixed cost the general floor guards against
        (BATCHINF_MIN_SHARD_TOKENS, ~0.2 s a shard) is under 1% of decoding one full batch. So
        the floor is one full batch's work (or an equal share of the workers, for a job smaller
        than a batch each), capped by the general floor: 128 chat prompts on two workers are two
        shards that start together (the general floor made them one, which a split then cut
        unevenly, one worker idle a third of the job)."""
        from batchinf.config import settings

        if records <= 0:
            return None
        batch = min((options or GenerateOptions()).max_slots, -(-records // max(1, workers or 1)))
        return max(1, min(settings().min_shard_tokens, batch * work // records))

    def result_schema(self, meta: dict[str, Any], options: Any = None) -> pa.Schema:
        return GENERATION_SCHEMA

    def run(self, c: dict[str, list[Any]], runtime: Any, options: Any, check: Callable[[], None],
            split: Callable[[], bool] | None = None, files: Any = None) -> RunOutput:
        """One continuous batch over all of the shard's records in staged order (by prompt
        length), so slots freed by short answers are refilled from the whole shard; rows are
        written in staged order, whatever order sequences finish in. Each record samples with its
        own staged seed (its own generator), so its answer depends on nothing else in the batch:
        a retry, or a split shard's children, give identical bytes. Once `split()` says so, no
        more records are admitted; those in flight finish, the others come back `deferred`.
        Once `split.stop()` says so (a cancel), decoding stops at its next step: every record not
        finished comes back `deferred`."""
        from batchinf.runtime.generation.sampling import SamplingParams
        from batchinf.runtime.generation.seq import GenRequest, GenStats
        from batchinf.runtime.threads import lane_share

        valid = ok_rows(c)
        requests = [GenRequest(i, c["input_ids"][i], SamplingParams(
            max_tokens=c["max_tokens"][i], temperature=c["temperature"][i], top_k=c["top_k"][i],
            top_p=c["top_p"][i], seed=c["seed"][i], stop=tuple(c["stop"][i] or ()),
            stop_token_ids=tuple(c["stop_token_ids"][i] or ()), response_format=c["response_format"][i],
            logprobs=c["logprobs"][i])) for i in valid]
        stats, out = GenStats(), GenOutcome()

        def generate(reqs: list[Any]) -> Any:     # the worker's slots are shared by its lanes
            return runtime.generate(reqs, max_batch_tokens=options.max_batch_tokens,
                                    max_slots=lane_share(options.max_slots), stats=stats,
                                    stop_admitting=split, abort=getattr(split, "stop", None))

        if requests:
            generate_isolating(generate, requests, c["record_id"], out, check)
        ok = [i for i in valid if i in out.results]
        res = [out.results[i] for i in ok]
        table = pa.table({
            **record_columns(c, ok), "kind": [c["kind"][i] for i in ok],
            "text": [r.text for r in res], "finish_reason": [r.finish_reason for r in res],
            "input_tokens": [r.input_tokens for r in res], "output_tokens": [r.output_tokens for r in res],
            "seed": [c["seed"][i] for i in ok], "output_ids": [r.token_ids for r in res],
            "logprobs": [None if r.logprobs is None else json.dumps(r.logprobs, separators=(",", ":")) for r in res],
        }, schema=GENERATION_SCHEMA)
        tokens = {"input": sum(r.input_tokens for r in res), "output": sum(r.output_tokens for r in res),
                  "real": stats.real_positions, "padded": stats.computed_positions}
        deferred = [i for i in valid if i not in out.results and i not in out.failures]
        return RunOutput(table, out.failures, tokens, deferred)

    def summarize(self, tables: Any) -> dict[str, Any]:
        """How many answers ended on a stop condition and how many ran into max_tokens."""
        counts: dict[str, int] = {}
        for t in tables:
            for reason in t.column("finish_reason").to_pylist():
                counts[reason] = counts.get(reason, 0) + 1
        return {"finish_reasons": dict(sorted(counts.items()))}

    def detects(self, config: dict[str, Any], src: Path) -> bool:
        from batchinf.runtime.families import is_decoder, is_decoder_embedding

        return is_decoder(config) and not is_decoder_embedding(config, src)

    def build_meta(self, src: Path, files: list[str], *, max_length: int | None, dtype: str) -> dict[str, Any]:
        from batchinf.runtime import bundle as rb

        return rb._build_generate_meta(src, files, max_length=max_length, dtype=dtype)

    def open_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        from batchinf.runtime.generation.runtime import GenerateRuntime

        return GenerateRuntime(root, meta, device=device)

    def vllm_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        from batchinf.engines.vllm import VllmGenerateRuntime

        return VllmGenerateRuntime(root, meta, device=device)

    def verify_model(self, runtime: Any) -> None:
        from batchinf.runtime import bundle as rb

        rb.verify_generate_fixtures(runtime)
