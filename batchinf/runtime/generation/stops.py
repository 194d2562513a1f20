"""When a sequence stops: a stop token (the bundle's EOS ids and the request's own), a stop string
(the text is cut before its first match), a completed grammar (structured output), or max_tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchinf.runtime.generation.sampling import SamplingParams
    from batchinf.runtime.generation.seq import Seq


def stop_ids(eos_ids: Iterable[int], params: SamplingParams) -> frozenset[int]:
    return frozenset(eos_ids) | frozenset(params.stop_token_ids)


def follow(seq: Seq, token: int, decode: Callable[[list[int]], str]) -> None:
    """Append `token` to the sequence's output and mark it done when it stops there."""
    p = seq.req.params
    if seq.guide is not None and seq.guide.consume(token) and token not in seq.stops:
        seq.done, seq.finish = True, "stop"     # the grammar is complete: nothing may follow
        seq.out.append(token)
        return
    if token in seq.stops:
        seq.done, seq.finish = True, "stop"
        seq.out.append(token)
        return
    seq.out.append(token)
    # A new match ends in the newest token's text: look at a short tail first, so a long answer is
    # not decoded in full at every step.
    if p.stop and any(x in decode(seq.out[-(max(map(len, p.stop)) + 8):]) for x in p.stop):
        text = decode(seq.out)
        cut = min((i for i in (text.find(x) for x in p.stop) if i >= 0), default=-1)
        if cut >= 0:
            seq.done, seq.finish, seq.text = True, "stop", text[:cut]
            return
    if len(seq.out) >= p.max_tokens:
        seq.done, seq.finish = True, "length"
