"""The KV cache's slots and budget, in plain Python (the engine holds the tensors).

The cache is preallocated per call: [slots, kv_heads, capacity, head_dim] per layer, capacity being
the call's longest prompt + max_tokens and slots = min(max_slots, max_batch_tokens // capacity,
budget // (capacity x bytes per token)), so the budget bounds memory as well as admission. An
admitted sequence reserves its whole prompt + max_tokens (`fit`), so a running sequence never runs
out of cache: nothing is ever preempted. Writing one position per step is an index_put (about 1% of
a decode step for SmolLM2 at 16 rows), where a cache grown by concatenation (transformers'
DynamicCache) spent about 11% of its step in `cat` in the same profile.

Prefix sharing: batch prompts mostly start alike (a chat template's system prompt, few-shot
examples). K/V at a position depend only on the tokens up to it, so a new sequence whose prompt
shares at least PREFIX_MIN_TOKENS leading tokens with an occupied slot's prompt copies those
positions' K/V from that slot and joins the next decode step directly: its last prompt token is its
decode token, and the prompt tokens between the copied prefix and that one ride along in the same
forward pass (a `Fill`).
"""

from __future__ import annotations

from collections.abc import Sequence

from batchinf.runtime.generation.seq import GenRequest, Seq

PREFIX_MIN_TOKENS = 16          # a request sharing fewer leading tokens with any slot is prefilled in full


class KVManager:
    """Which sequence holds which slot, and the prompt + max_tokens positions they reserve."""

    def __init__(self, n_slots: int, capacity: int, max_batch_tokens: int, *, share_prefixes: bool = True) -> None:
        self.slots: list[Seq | None] = [None] * n_slots
        self.capacity, self.max_batch_tokens, self.share_prefixes = capacity, max_batch_tokens, share_prefixes
        self.reserved = 0               # positions reserved by the occupied slots

    @classmethod
    def sized(cls, requests: Sequence[GenRequest], *, bytes_per_token: int, budget: int, max_batch_tokens: int,
              max_slots: int, share_prefixes: bool = True) -> KVManager:
        """Slots for these requests within `budget` bytes of cache; ValueError, before anything is
        allocated, for a request that alone would not fit."""
        for r in requests:
            need = len(r.prompt_ids) + r.params.max_tokens
            if need * bytes_per_token > budget:
                raise ValueError(f"request {r.key}: prompt + max_tokens = {need} tokens need {need * bytes_per_token} "
                                 f"bytes of KV cache, over this worker's budget of {budget} bytes "
                                 "(BATCHINF_MAX_KV_CACHE_BYTES); lower max_tokens or shorten the prompt")
        capacity = max(len(r.prompt_ids) + r.params.max_tokens for r in requests)
        n_slots = max(1, min(max_slots, len(requests), max_batch_tokens // capacity,
                             budget // (capacity * bytes_per_token)))
        return cls(n_slots, capacity, max_batch_tokens, share_prefixes=share_prefixes)

    @property
    def occupied(self) -> bool:
        return any(s is not None for s in self.slots)

    @property
    def has_free_slot(self) -> bool:
        return None in self.slots

    def fit(self, req: GenRequest) -> Seq | None:
        """`req` as a sequence in the lowest free slot, its prompt + max_tokens reserved; None when
        no slot is free or the reservation would exceed max_batch_tokens."""
        need = len(req.prompt_ids) + req.params.max_tokens
        if None not in self.slots or self.reserved + need > self.max_batch_tokens:
            return None
        seq = Seq(req, self.slots.index(None))
        self.slots[seq.slot] = seq
        self.reserved += need
        return seq

    def free(self, seq: Seq) -> None:
        self.slots[seq.slot] = None
        self.reserved -= seq.need

    def rows(self) -> list[Seq | None]:
        """Slots 0 up to the highest occupied one: the rows a decode step computes."""
        hi = max((i for i, s in enumerate(self.slots) if s is not None), default=-1) + 1
        return self.slots[:hi]

    def share(self, new: list[Seq]) -> tuple[list[Seq], list[tuple[Seq, Seq]]]:
        """Newly fitted sequences split into those to prefill and (sequence, donor) pairs whose
        shared prefix is copied from the donor's slot (`start` set to its length). Of new sequences
        sharing a prefix nobody holds yet, the first in prompt order is prefilled, the others then
        copy from it."""
        fresh = set(map(id, new))
        donors = [s for s in self.slots if s is not None and id(s) not in fresh]
        prefill: list[Seq] = []
        copies: list[tuple[Seq, Seq]] = []
        for s in sorted(new, key=lambda s: s.req.prompt_ids):
            donor, n = longest_shared(s.req.prompt_ids, donors + prefill) if self.share_prefixes else (None, 0)
            if donor is not None and n >= PREFIX_MIN_TOKENS:
                s.start = n
                copies.append((s, donor))
            else:
                prefill.append(s)
        return prefill, copies

    def compact(self) -> list[tuple[int, int, int]]:
        """Move the highest occupied slots into the free slots below them, so a decode step computes
        only occupied rows: the (source slot, destination slot, positions) moves, in the order the
        cache must apply them. Worth it only when no waiting request could refill those slots."""
        moves = []
        while True:
            hi = max((i for i, s in enumerate(self.slots) if s is not None), default=-1)
            lo = self.slots.index(None) if None in self.slots else len(self.slots)
            if lo >= hi:
                return moves
            seq = self.slots[hi]
            assert seq is not None
            moves.append((hi, lo, seq.pos + 1))     # positions written so far (and the next one)
            seq.slot, self.slots[lo], self.slots[hi] = lo, seq, None


def longest_shared(prompt: list[int], donors: list[Seq]) -> tuple[Seq | None, int]:
    """The donor whose prompt shares the most leading tokens with `prompt`, and how many; at most
    len(prompt) - 1, as the last prompt token must be computed to give the first output token."""
    best, most = None, 0
    for d in donors:
        n = common_prefix(prompt, d.req.prompt_ids, len(prompt) - 1)
        if n > most:
            best, most = d, n
    return best, most


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit` (binary search on slices)."""
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
