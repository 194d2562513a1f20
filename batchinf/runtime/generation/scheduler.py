"""Continuous batching as plain data: each step, the scheduler turns the waiting requests and the
running sequences into a `StepPlan` for the engine (no tensors; torch is never imported here).

Invariant of a step: the scheduler first admits waiting requests (longest `max_tokens` first, ties
in their given order) into free slots while the KV-token budget allows (then a split may withdraw
those still waiting: `stop_admitting`); those are prefilled, which
yields their first token, or copy a shared prefix and join the decode step (kv.py); then one
decode step runs over the occupied slot range. A slot freed by a finished sequence (`update`) is
refilled at the next step; once nothing waits, the occupied slots are compacted to the lowest rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from batchinf.runtime.generation.kv import KVManager
from batchinf.runtime.generation.seq import GenRequest, Seq

PREFILL_CHUNK_TOKENS = 4096     # padded positions per prefill forward pass
PREFILL_PAD_SLACK = 1.25        # a prefill group's padded positions stay within this × its real tokens
WITHDRAW_SHARE = 0.25           # stop_admitting is asked only while this share of the slots' count still waits


@dataclass
class StepPlan:
    """One step, in the order the engine runs it."""

    moves: list[tuple[int, int, int]] = field(default_factory=list)  # (src slot, dst slot, positions) to compact
    admitted: list[Seq] = field(default_factory=list)    # new this step, in admission order
    prefill: list[list[Seq]] = field(default_factory=list)   # one prefill forward pass per group
    copies: list[tuple[Seq, Seq]] = field(default_factory=list)  # (sequence, donor): shared prefix copied
    fills: list[list[Seq]] = field(default_factory=list)     # copying sequences' remaining prompt, a pass
    #   per group; the last group rides along the decode step
    decode: list[Seq | None] = field(default_factory=list)   # the decode step's rows (slots 0..hi-1);
    #   None and finished rows are computed idle; rows finished by this step's prefill are skipped
    withdrawn: list[GenRequest] = field(default_factory=list)  # never admitted: stop_admitting said so


class Scheduler:
    """Continuous batching over a KVManager's slots. `update` after each step releases the finished
    sequences. A subclass changes the policy (benchmarks/static_batching.py)."""

    compacts = True             # move occupied slots down once nothing waits

    def __init__(self, requests: Iterable[GenRequest], kv: KVManager, *,
                 stop_admitting: Callable[[], bool] | None = None) -> None:
        reqs = list(requests)
        self.kv, self.stop_admitting, self.total = kv, stop_admitting, len(reqs)
        self.waiting: deque[GenRequest] = deque(self.order(reqs))

    @staticmethod
    def order(requests: list[GenRequest]) -> list[GenRequest]:
        # Longest max_tokens first: long answers start early, so the tail once the queue is empty
        # (few live rows, each step paying for all the weights) is made of short ones.
        return sorted(requests, key=lambda r: -r.params.max_tokens)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.kv.occupied

    def admitting(self) -> bool:
        """Whether this step may admit waiting requests."""
        return True

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        if self.compacts and not self.waiting:
            plan.moves = self.kv.compact()
        if self.admitting():
            refill = len(self.waiting) < self.total and self.kv.has_free_slot
            while self.waiting and (seq := self.kv.fit(self.waiting[0])) is not None:
                self.waiting.popleft()
                plan.admitted.append(seq)
            # Once asked (only as freed slots are refilled, after the first admissions, and while
            # at least WITHDRAW_SHARE of a batch would still wait), stop_admitting withdraws what
            # still waits: fewer are taken by this batch's next refills within a few steps, where
            # the shard split off would decode them in a batch of their own, a whole decode's steps
            # for a few rows.
            if (refill and self.stop_admitting and len(self.waiting) >= WITHDRAW_SHARE * len(self.kv.slots)
                    and self.stop_admitting()):
                plan.withdrawn = list(self.waiting)
                self.waiting.clear()
        if plan.admitted:
            leaders, plan.copies = self.kv.share(plan.admitted)
            plan.prefill = prefill_groups(leaders, lambda s: len(s.req.prompt_ids))
        plan.decode = self.kv.rows()
        copying = set(id(s) for s, _ in plan.copies)
        middle = [s for s in plan.decode if s is not None and id(s) in copying
                  and s.start < len(s.req.prompt_ids) - 1]
        plan.fills = prefill_groups(middle, lambda s: len(s.req.prompt_ids) - 1 - s.start)
        return plan

    def update(self) -> list[Seq]:
        """The sequences that finished, in slot order, their slots freed."""
        done = [s for s in self.kv.slots if s is not None and s.done]
        for s in done:
            self.kv.free(s)
        return done


def prefill_groups(seqs: list[Seq], length: Callable[[Seq], int]) -> list[list[Seq]]:
    """Groups sorted by `length` whose padding stays small and whose padded size fits one chunk."""
    groups: list[list[Seq]] = []
    cur: list[Seq] = []
    real = 0
    for s in sorted(seqs, key=length):
        n = length(s)
        padded = n * (len(cur) + 1)     # sorted ascending: n is the group's max
        if cur and (padded > PREFILL_CHUNK_TOKENS or padded > PREFILL_PAD_SLACK * (real + n)):
            groups.append(cur)
            cur, real = [], 0
        cur.append(s)
        real += n
    if cur:
        groups.append(cur)
    return groups
