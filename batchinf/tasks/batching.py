"""Batching and fault isolation shared by the tasks' `run`: token-budget batches over records
sorted by length, and isolation that re-runs a failing batch in halves until only the records
that fail fail, each as its own error row."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import numpy as np

from batchinf import failpoints
from batchinf.errors import BundleError, JobStopped, RecordsFailed, StaleAttemptError

T = TypeVar("T")


def token_budget_batches(lengths: list[int], max_batch_tokens: int, min_fill: float = 0.95) -> list[list[int]]:
    """Group positions of records sorted ascending by length into batches whose padded size
    (len(batch) * longest) stays within max_batch_tokens and whose fill (real / padded tokens)
    stays at or above min_fill. A record longer than the budget runs alone."""
    batches: list[list[int]] = []
    cur: list[int] = []
    real = longest = 0
    for i, n in enumerate(lengths):
        top = max(longest, n)
        if cur and ((len(cur) + 1) * top > max_batch_tokens or (real + n) < min_fill * (len(cur) + 1) * top):
            batches.append(cur)
            cur, real, top = [], 0, n
        cur.append(i)
        real += n
        longest = top
    if cur:
        batches.append(cur)
    return batches


def isolate(run: Callable[[list[T]], None], items: list[T], *, done: Callable[[T], bool],
            failed: Callable[[T, str], None]) -> None:
    """Run `items`; if it raises, the items not yet done are run again in halves, recursively,
    until only the records that fail fail, each alone (`failed(item, error)`)."""
    try:
        run(items)
    except (BundleError, StaleAttemptError, JobStopped):
        raise
    except Exception as exc:  # noqa: BLE001 -- any model/runtime fault on a record is isolated
        rest = [i for i in items if not done(i)]
        if len(rest) == 1:
            failed(rest[0], f"{type(exc).__name__}: {exc}")
            return
        mid = len(rest) // 2
        for half in (rest[:mid], rest[mid:]):
            if half:
                isolate(run, half, done=done, failed=failed)


def hit_record_failpoints(record_ids: list[str]) -> None:
    if failpoints.active():
        for rid in record_ids:
            failpoints.hit(f"execute.record[{rid}]")


@dataclass
class EmbedOutcome:
    vectors: dict[int, np.ndarray] = field(default_factory=dict)   # position -> embedding
    failures: dict[int, str] = field(default_factory=dict)        # position -> exception text
    padded: int = 0


def embed_isolating(embed: Callable[[list[list[int]]], tuple[np.ndarray, int]], ids: list[list[int]],
                    positions: list[int], record_ids: list[str], out: EmbedOutcome) -> None:
    """Embed a batch; if it raises, split it in halves until only the failing records fail."""
    def run(batch: list[int]) -> None:
        hit_record_failpoints([record_ids[p] for p in batch])
        vecs, padded = embed([ids[p] for p in batch])
        out.padded += padded
        out.vectors.update(zip(batch, vecs))

    isolate(run, positions, done=out.vectors.__contains__, failed=out.failures.__setitem__)


@dataclass
class GenOutcome:
    results: dict[int, Any] = field(default_factory=dict)      # position -> GenResult
    failures: dict[int, str] = field(default_factory=dict)     # position -> exception text


def generate_isolating(generate: Callable[[list[Any]], Any], requests: list[Any], record_ids: list[str],
                       out: GenOutcome, check: Callable[[], None] = lambda: None) -> None:
    """Generate for `requests` (continuous batching over all of them); if it raises, the results
    already finished are kept and the unfinished requests are split in halves until only the
    failing records fail. `check` runs after every finished sequence (lease still held?)."""
    def run(reqs: list[Any]) -> None:
        hit_record_failpoints([record_ids[r.key] for r in reqs])
        try:
            for res in generate(reqs):
                out.results[res.key] = res
                check()
        except RecordsFailed as exc:      # an engine that accounts per record (openai-http): no halving
            out.failures.update(exc.failures)

    isolate(run, requests, done=lambda r: r.key in out.results,
            failed=lambda r, error: out.failures.__setitem__(r.key, error))


def run_units(forward: Callable[[list[int]], tuple[np.ndarray, int]], lengths: list[int], units: list[int],
              unit_records: list[str], max_batch_tokens: int, min_fill: float = 0.95) -> EmbedOutcome:
    """Run units of work (tokenized sequences, pairs, images) sorted by `lengths` in token-budget
    batches through `forward(unit positions) -> (one output row per unit, padded positions)`,
    isolating failures. Returns outputs and failures by unit position."""
    out = EmbedOutcome()
    order = sorted(units, key=lambda u: lengths[u])
    index = [[u] for u in range(len(lengths))]

    def fwd(batch_ids: list[list[int]]) -> tuple[np.ndarray, int]:
        return forward([b[0] for b in batch_ids])

    for batch in token_budget_batches([lengths[u] for u in order], max_batch_tokens, min_fill):
        embed_isolating(fwd, index, [order[j] for j in batch], unit_records, out)
    return out
