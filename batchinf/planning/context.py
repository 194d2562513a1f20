"""What every planning task of a job shares, built once per task: `Planning(job)` opens the
bundle's runtime (its tokenizer; files and fixtures verified), checks that the bundle's task is the
job's, and holds the task's staging limits and the job's storage check. One object's task
(`ObjectTask`) is then built from that object alone (`object_task`), so a planning task costs the
same whatever the number of objects in its job.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from batchinf.bundles import open_runtime
from batchinf.errors import ManifestError
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import retry_records
from batchinf.ledger.models import InputObject, Job
from batchinf.planning import ranges
from batchinf.planning.ranges import Range
from batchinf.scopes import Storage
from batchinf.store import ObjectPin, join
from batchinf.tasks import get_task


@dataclass(frozen=True)
class ObjectTask:
    """One planning task: read and stage one pinned input object (or one part of it)."""
    idx: int
    pin: ObjectPin
    fmt: str
    id_field: str
    text_field: str         # the field read as `kind`
    digest: str
    max_length: int         # text tasks: tokens kept per record; generate: the context length
    truncate: bool
    stage_uri: str
    task: str = "embed"
    kind: str = "text"      # text | prompt | messages | record (openai-batch lines say it)
    options: Any = None     # the job's options (its task's options model)
    input: Any = None       # the manifest's input section (tasks reading whole records name their fields there)
    may_read: Callable[[str], None] | None = None   # raises for an object a record names (image URIs) that
                                                     # the job may not read (a confined job: outside its grants)
    splittable: bool = True     # False: planned whole whatever its size (a retry job plans chosen ordinals)
    part: Range | None = None    # the part of the object this task plans (planning/ranges.py); None: all of it
    output_uri: str = ""         # the job's output prefix (generate_image stages where its images go)
    shard_work: int = 0          # the manifest's shards.max_tokens when it is not the default (else 0): the most work a
                                 # shard holds (a task that stages a long record in pieces keeps each piece within it)


def stage_uri(work_uri: str, idx: int) -> str:
    """plan/obj-00003.parquet: the staged file of input object 3 planned whole."""
    return join(work_uri, "plan", f"obj-{idx:05d}.parquet")


GROUP_BYTES = 1 << 18   # small objects planned whole, together up to this many pinned bytes, are staged as one group


def group_uri(work_uri: str, first: int, last: int) -> str:
    """plan/grp-00003-00041.parquet: the staged file of the group of objects 3..41."""
    return join(work_uri, "plan", f"grp-{first:05d}-{last:05d}.parquet")


def object_groups(items: list[Any], fmt: str, splittable: bool, budget: int | None = None) -> list[list[Any]]:
    """The job's small objects in groups: runs of consecutive objects (in pinned order), each
    planned whole (not compressed: one part, planning/ranges.py), of at most `budget` pinned bytes
    together; only groups of two or more. Read from the pins alone, so every planner finds the
    same groups: the embedded planner stages a group in one file (planning/stage.py
    `stage_group`), the global step looks for it first."""
    budget = GROUP_BYTES if budget is None else budget
    out: list[list[Any]] = []
    run: list[Any] = []
    size = 0
    for t in items:         # input objects or their tasks (anything with a pin), in pinned order
        small = t.pin.size <= budget and ranges.object_parts(t.pin, fmt, splittable) is None \
            and not any(t.pin.uri.lower().endswith(suffix) for suffix in ranges.CODECS)
        if not small or size + t.pin.size > budget:
            if len(run) > 1:
                out.append(run)
            run, size = [], 0
        if small:
            run.append(t)
            size += t.pin.size
    if len(run) > 1:
        out.append(run)
    return out


def part_count(job: Job, obj: InputObject) -> int:
    """The object's planning parts (1: planned whole); reads nothing but the pin."""
    parts = ranges.object_parts(obj.pin, job.manifest.input.format, not job.retry_of)
    return 1 if parts is None else len(parts)


class Planning:
    """One job's planning, as a planning task (or the global step) needs it."""

    def __init__(self, job: Job) -> None:
        m = job.manifest
        self.job = job
        self.runtime = open_runtime(job.bundle_digest, with_model=False)   # verifies files + tokenizer
        if self.runtime.meta["task"] != m.task:
            raise ManifestError(f"bundle {m.bundle} ({job.bundle_digest[:19]}…) is a {self.runtime.meta['task']} "
                                f"model; this job's task is {m.task}: choose a {m.task} bundle")
        self.task = get_task(m.task)
        self.field, self.kind = self.task.read_as(m.input)
        self.max_length, self.truncate = self.task.limits(self.runtime, m.options)
        self.may_read = Storage(job.tenant, job.confined).checker("object")
        self.selects = retry_records.selects(job.id)

    def object_task(self, obj: InputObject) -> ObjectTask:
        """The task that stages this object whole."""
        m, job = self.job.manifest, self.job
        return ObjectTask(obj.idx, obj.pin, m.input.format, m.input.id_field, self.field, job.bundle_digest,
                          self.max_length, self.truncate, stage_uri(job.work_uri, obj.idx), task=m.task,
                          kind=self.kind, options=m.options, input=m.input, may_read=self.may_read,
                          splittable=not job.retry_of, output_uri=job.output_uri, shard_work=_set_max_tokens(m))

    def object_tasks(self) -> list[ObjectTask]:
        """Every object's task, in pinned order (the global step's: one ledger read)."""
        return [self.object_task(o) for o in job_repo.inputs(self.job.id)]

    def part_tasks(self, obj: InputObject) -> list[ObjectTask]:
        """The object's planning tasks: one per part when it is planned in parts, else one."""
        return part_tasks(self.object_task(obj))

    def kept(self, obj: InputObject) -> set[int] | None:
        """The ordinals of the object the job plans (a retry job's selection); None: every record."""
        return retry_records.kept(self.job.id, obj.pin.uri) if self.selects else None


def part_tasks(task: ObjectTask) -> list[ObjectTask]:
    """An object's planning tasks: one per part when it is planned in parts, else itself."""
    parts = ranges.object_parts(task.pin, task.fmt, task.splittable)
    if parts is None:
        return [task]
    return [replace(task, part=p, stage_uri=ranges.part_uri(task.stage_uri, p)) for p in parts]


def _set_max_tokens(m: Any) -> int:
    """The manifest's shards.max_tokens, 0 when it is the default (no bound asked for)."""
    return 0 if m.shards.max_tokens == type(m.shards).model_fields["max_tokens"].default else m.shards.max_tokens
