"""The generation scheduler and KV manager as plain data, no model: which requests a step admits
for a given budget, which are prefilled or copy a shared prefix, which rows the decode step
computes, how freed slots are refilled and compacted, and what stop_admitting withdraws. Admission
reserves prompt + max_tokens, so nothing running is ever preempted: a request that does not fit
waits. The same loop on a real model is tests/unit/test_llama.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchinf.runtime.generation.kv import PREFIX_MIN_TOKENS, KVManager
from batchinf.runtime.generation.sampling import SamplingParams
from batchinf.runtime.generation.scheduler import Scheduler, StepPlan, prefill_groups
from batchinf.runtime.generation.seq import GenRequest, Seq
from benchmarks.static_batching import StaticScheduler


def req(key: int, prompt: int | list[int], max_tokens: int) -> GenRequest:
    ids = list(range(100 * key, 100 * key + prompt)) if isinstance(prompt, int) else prompt
    return GenRequest(key, ids, SamplingParams(max_tokens=max_tokens))


def run_step(plan: StepPlan, finish: set[int] = frozenset()) -> None:
    """What the engine does to the sequences: each computed one gets a token; keys in `finish` stop."""
    for s in [*(s for g in plan.prefill for s in g), *(s for s in plan.decode if s is not None and not s.done)]:
        s.out.append(0)
        s.done = s.done or s.req.key in finish or len(s.out) >= s.req.params.max_tokens


def keys(seqs: list[Seq | None]) -> list[int | None]:
    return [None if s is None else s.req.key for s in seqs]


def test_admits_longest_max_tokens_first_within_the_token_budget() -> None:
    reqs = [req(0, 4, 2), req(1, 4, 10), req(2, 4, 6), req(3, 4, 10)]
    kv = KVManager(n_slots=4, capacity=14, max_batch_tokens=30)
    sched = Scheduler(reqs, kv)
    plan = sched.schedule()
    # 14 + 14 reserved; request 2 (10 positions) would pass 30: it and everything after it wait
    assert keys(plan.admitted) == [1, 3] and [s.slot for s in plan.admitted] == [0, 1]
    assert kv.reserved == 28 and [r.key for r in sched.waiting] == [2, 0]
    assert [keys(g) for g in plan.prefill] == [[1, 3]] and plan.copies == [] and plan.fills == []
    assert keys(plan.decode) == [1, 3] and plan.moves == [] and plan.withdrawn == []


def test_a_request_that_does_not_fit_waits_for_reservations_to_free_and_nothing_is_preempted() -> None:
    kv = KVManager(n_slots=3, capacity=24, max_batch_tokens=33)
    sched = Scheduler([req(0, 4, 20), req(1, 4, 5), req(2, 4, 3)], kv)
    plan = sched.schedule()
    assert keys(plan.admitted) == [0, 1]          # 24 + 9; request 2 (7) would make 40 > 33
    for _ in range(3):
        run_step(plan)
        assert sched.update() == []
        plan = sched.schedule()
        assert plan.admitted == [] and keys(kv.slots) == [0, 1, None]     # nobody is evicted for it
    run_step(plan)                                 # request 1 reaches its 5 tokens
    assert keys(sched.update()) == [1] and kv.reserved == 24
    plan = sched.schedule()
    assert keys(plan.admitted) == [2] and plan.admitted[0].slot == 1     # the freed slot, refilled
    assert keys(plan.decode) == [0, 2]


def test_finished_sequences_are_released_and_slots_compacted_once_nothing_waits() -> None:
    kv = KVManager(n_slots=3, capacity=10, max_batch_tokens=100)
    sched = Scheduler([req(0, 4, 9), req(1, 4, 8), req(2, 4, 7)], kv)
    plan = sched.schedule()
    assert keys(kv.slots) == [0, 1, 2]
    run_step(plan, finish={0})                     # slot 0 frees while slot 2 still runs
    assert keys(sched.update()) == [0]
    seq2 = kv.slots[2]
    plan = sched.schedule()
    assert seq2 is not None and plan.moves == [(2, 0, seq2.pos + 1)]     # the highest row moves down
    assert seq2.slot == 0 and keys(kv.slots) == [2, 1, None] and keys(plan.decode) == [2, 1]
    run_step(plan, finish={2})
    assert keys(sched.update()) == [2]
    plan = sched.schedule()
    assert [m[:2] for m in plan.moves] == [(1, 0)] and keys(plan.decode) == [1]


def test_compaction_fills_holes_from_the_top() -> None:
    kv = KVManager(n_slots=4, capacity=10, max_batch_tokens=100)
    seqs = [kv.fit(req(i, 3, 5)) for i in range(4)]
    assert all(s is not None for s in seqs)
    kv.free(seqs[0])
    kv.free(seqs[2])
    assert [m[:2] for m in kv.compact()] == [(3, 0)]
    assert keys(kv.slots) == [3, 1, None, None] and kv.rows() == kv.slots[:2]
    assert kv.compact() == []


def test_shared_prefixes_are_copied_and_the_rest_of_the_prompt_fills_along_the_decode_step() -> None:
    system = list(range(1000, 1000 + PREFIX_MIN_TOKENS + 4))
    reqs = [req(0, system + [1, 2, 3], 5), req(1, system + [7, 8], 5), req(2, system[:PREFIX_MIN_TOKENS - 1] + [9], 5),
            req(3, system + [1, 5], 5)]
    plan = Scheduler(reqs, KVManager(n_slots=4, capacity=30, max_batch_tokens=1000)).schedule()
    # In prompt order (2, 0, 3, 1), the first of a shared prefix is prefilled, the others copy from
    # it; request 2 shares too few tokens; request 3 copies all but its last token, which it feeds
    # as its decode token (nothing left to fill).
    by_key = {s.req.key: s for s in plan.admitted}
    assert sorted(keys([s for g in plan.prefill for s in g])) == [0, 2]
    assert sorted((s.req.key, d.req.key, s.start) for s, d in plan.copies) == [(1, 0, len(system)),
                                                                               (3, 0, len(system) + 1)]
    assert [keys(g) for g in plan.fills] == [[1]] and by_key[1].start == len(system)
    off = Scheduler(reqs, KVManager(n_slots=4, capacity=30, max_batch_tokens=1000, share_prefixes=False)).schedule()
    assert off.copies == [] and sorted(keys([s for g in off.prefill for s in g])) == [0, 1, 2, 3]


def test_a_running_slot_donates_its_prefix_to_a_later_admission() -> None:
    system = list(range(500, 500 + 2 * PREFIX_MIN_TOKENS))
    kv = KVManager(n_slots=1 + 1, capacity=60, max_batch_tokens=1000)
    sched = Scheduler([req(0, system + [1], 9), req(1, system + [2], 3), req(2, system + [3, 4, 5], 2)], kv)
    plan = sched.schedule()
    assert keys(plan.admitted) == [0, 1] and [(s.req.key, d.req.key) for s, d in plan.copies] == [(1, 0)]
    run_step(plan)
    run_step(sched.schedule())
    run_step(sched.schedule())                     # request 1 has its 3 tokens
    assert keys(sched.update()) == [1]
    plan = sched.schedule()
    assert [(s.req.key, d.req.key, s.start) for s, d in plan.copies] == [(2, 0, len(system))]
    assert plan.prefill == [] and [keys(g) for g in plan.fills] == [[2]]


def test_prefill_groups_bound_padding() -> None:
    seqs = [Seq(req(i, n, 1), i) for i, n in enumerate([10, 11, 12, 40, 41])]
    groups = prefill_groups(seqs, lambda s: len(s.req.prompt_ids))
    assert [keys(g) for g in groups] == [[0, 1, 2], [3, 4]]


def test_stop_admitting_withdraws_what_still_waits_once_freed_slots_are_refilled() -> None:
    asked: list[int] = []

    def stop() -> bool:
        asked.append(len(sched.waiting))
        return True

    kv = KVManager(n_slots=2, capacity=10, max_batch_tokens=100)
    sched = Scheduler([req(i, 3, 4 + i) for i in range(5)], kv, stop_admitting=stop)
    plan = sched.schedule()
    assert keys(plan.admitted) == [4, 3] and asked == []    # never asked before the first admissions
    run_step(plan)
    assert sched.update() == []
    while True:
        plan = sched.schedule()
        assert plan.withdrawn == [] and asked == []        # no free slot: not asked
        run_step(plan)
        if done := sched.update():
            break
    assert keys(done) == [3]
    plan = sched.schedule()         # the freed slot takes the next request; the two left are withdrawn
    assert keys(plan.admitted) == [2] and asked == [2] and [r.key for r in plan.withdrawn] == [1, 0]
    assert sched.busy and not sched.waiting
    while sched.busy:
        run_step(sched.schedule())
        sched.update()
    assert asked == [2]


def test_a_few_requests_left_waiting_are_kept_for_the_batch_to_refill() -> None:
    """Under WITHDRAW_SHARE of the slots still waiting after a refill: not asked, never withdrawn
    (the batch takes them within a few steps; a split would decode them in a batch of their own)."""
    asked: list[int] = []
    kv = KVManager(n_slots=8, capacity=10, max_batch_tokens=1000)
    sched = Scheduler([req(i, 3, 2 + (i % 3)) for i in range(9)], kv, stop_admitting=lambda: asked.append(1) or True)
    while sched.busy:
        plan = sched.schedule()
        assert plan.withdrawn == []
        run_step(plan)
        sched.update()
    assert asked == []


def test_static_batching_admits_only_an_empty_batch_and_releases_it_whole() -> None:
    kv = KVManager(n_slots=2, capacity=10, max_batch_tokens=100)
    sched = StaticScheduler([req(0, 3, 2), req(1, 3, 4), req(2, 3, 2)], kv)
    plan = sched.schedule()
    assert keys(plan.admitted) == [0, 1]           # the given order, not longest first
    run_step(plan)
    run_step(sched.schedule())
    assert kv.slots[0] is not None and kv.slots[0].done and sched.update() == []   # held until all finish
    plan = sched.schedule()
    assert plan.admitted == [] and plan.moves == [] and keys(plan.decode) == [0, 1]   # finished row computed
    run_step(plan)
    run_step(sched.schedule())
    assert keys(sched.update()) == [0, 1]
    assert keys(sched.schedule().admitted) == [2]


def test_fit_is_none_when_no_slot_is_free_or_the_budget_is_reached() -> None:
    kv = KVManager(n_slots=2, capacity=20, max_batch_tokens=30)
    a = kv.fit(req(0, 5, 10))
    assert a is not None and a.slot == 0 and kv.reserved == 15
    assert kv.fit(req(1, 6, 10)) is None and kv.reserved == 15     # 31 > 30: nothing changes
    b = kv.fit(req(2, 5, 10))
    assert b is not None and b.slot == 1 and kv.reserved == 30
    assert kv.fit(req(3, 1, 1)) is None                             # no free slot
    kv.free(a)
    c = kv.fit(req(4, 5, 10))
    assert c is not None and c.slot == 0 and not kv.has_free_slot


def test_slots_are_sized_to_the_byte_budget_and_an_oversized_request_is_refused() -> None:
    reqs = [req(i, 10, 10) for i in range(8)]          # 20 positions each
    kv = KVManager.sized(reqs, bytes_per_token=100, budget=100 * 20 * 3, max_batch_tokens=1000, max_slots=64)
    assert len(kv.slots) == 3 and kv.capacity == 20
    assert len(KVManager.sized(reqs, bytes_per_token=1, budget=1 << 30, max_batch_tokens=50, max_slots=64).slots) == 2
    assert len(KVManager.sized(reqs, bytes_per_token=1, budget=1 << 30, max_batch_tokens=1000, max_slots=5).slots) == 5
    with pytest.raises(ValueError, match="request 0: prompt \\+ max_tokens = 20 tokens need 2000 bytes"):
        KVManager.sized(reqs, bytes_per_token=100, budget=1999, max_batch_tokens=1000, max_slots=64)


def test_the_scheduler_and_kv_manager_import_no_torch() -> None:
    code = ("import sys; import batchinf.runtime.generation.scheduler, batchinf.runtime.generation.stops; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_resolving_a_records_sampling_params_imports_no_torch() -> None:
    """Planning resolves every record's params and seed (tasks/generate.py record_params): a planner
    that imported torch for that paid seconds of its plan and the memory of a torch process."""
    code = ("import sys; from batchinf.tasks.generate import GenerateOptions, record_params; "
            "p = record_params(GenerateOptions(temperature=0.5), 'r1', {'max_tokens': 3}); "
            "import batchinf.runtime.generation.sampling, batchinf.runtime.generation.runtime; "
            "sys.exit(2 if p['max_tokens'] != 3 else 'torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
