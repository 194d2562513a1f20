"""A generation request, its sequence's state while it runs, its result, and a call's counters.
Plain Python: the scheduler and the KV manager see sequences without importing torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from batchinf.runtime.generation.sampling import SamplingParams


@dataclass
class GenRequest:
    key: int                        # caller's handle, returned unchanged in GenResult
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class GenResult:
    key: int
    token_ids: list[int]            # generated ids, without prompt and without the stop token
    text: str
    finish_reason: str              # "stop" | "length"
    input_tokens: int
    output_tokens: int              # tokens generated, the stop token included
    logprobs: list[dict] | None = None  # OpenAI's logprobs.content entries, when asked for


@dataclass
class GenStats:                     # accumulated per runtime call; used for tokens.real/padded
    prompt_tokens: int = 0          # prompt tokens of the admitted requests (cached ones included)
    cached_prompt_tokens: int = 0   # of which K/V were copied from a slot with the same prefix
    prefill_positions: int = 0      # positions computed in prefill incl. padding, cached ones excluded
    decode_tokens: int = 0          # decode rows that produced a token
    decode_slot_steps: int = 0      # slots x steps computed in decode (incl. idle/finished slots)
    joined: int = 0                 # of decode_tokens: rows that fed a prompt's last token (joining)

    @property
    def real_positions(self) -> int:        # positions computed for real tokens
        return self.prompt_tokens - self.cached_prompt_tokens - self.joined + self.decode_tokens

    @property
    def computed_positions(self) -> int:    # positions computed, padding and idle rows included
        return self.prefill_positions + self.decode_slot_steps


@dataclass(eq=False)                # identity: a sequence is one object, wherever its slot moves
class Seq:
    req: GenRequest
    slot: int
    stops: frozenset[int] = frozenset()     # set by the engine when it starts the sequence
    gen: torch.Generator | None = None      # its own sampling generator (temperature > 0)
    guide: Any = None                       # structured.Guide of a response_format
    out: list[int] = field(default_factory=list)
    start: int = 0              # prompt positions whose K/V were copied from another slot
    done: bool = False
    finish: str = "length"
    text: str | None = None     # set when a stop string cut it
    logprobs: list[dict] = field(default_factory=list)

    @property
    def pos(self) -> int:       # cache position of the last token fed (prompt + generated so far)
        return len(self.req.prompt_ids) + len(self.out) - 1

    @property
    def need(self) -> int:      # cache positions it may take: prompt + max_tokens
        return len(self.req.prompt_ids) + self.req.params.max_tokens

    def result(self, decode: Callable[[list[int]], str]) -> GenResult:
        ids = self.out[:-1] if self.out and self.out[-1] in self.stops and self.finish == "stop" \
            and self.text is None else self.out
        text = self.text if self.text is not None else decode(ids)
        return GenResult(key=self.req.key, token_ids=list(ids), text=text, finish_reason=self.finish,
                         input_tokens=len(self.req.prompt_ids), output_tokens=len(self.out),
                         logprobs=self.logprobs[:len(ids)] if self.req.params.logprobs is not None else None)
