"""Text generation over a Llama-family decoder: prompt encoding (plain or chat template), continuous
batching over a preallocated slot KV cache, sampling, stop conditions.

Invariant of `GenerateRuntime.generate`: every loop iteration first admits queued requests (longest
`max_tokens` first, ties in their given order) into free slots while the KV-token budget allows
(prefilling them, which yields their first token, or copying a shared prefix, see below), then runs
one decode step over the occupied slot range. A slot freed by a finished sequence is refilled at
the next iteration. Results are yielded as sequences finish.

Prefix sharing: batch prompts mostly start alike (a chat template's system prompt, few-shot examples).
K/V at a position depend only on the tokens up to it, so a new sequence whose prompt shares at least
PREFIX_MIN_TOKENS leading tokens with an occupied slot's prompt copies those positions' K/V from that
slot and joins the next decode step directly: its last prompt token is its decode token, and the
prompt tokens between the copied prefix and that one ride along in the same forward pass (a `Fill`).

The KV cache is preallocated per call: [slots, kv_heads, capacity, head_dim] per layer, capacity being
the call's longest prompt + max_tokens and slots = min(max_slots, max_batch_tokens // capacity), so
the budget bounds memory too. Writing one position per step is an index_put (about 1% of a decode
step for SmolLM2 at 16 rows), where a cache grown by concatenation (transformers' DynamicCache)
spent about 11% of its step in `cat` in the same profile.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from batchinf.config import settings
from batchinf.runtime.sampling import SamplingParams, sample
from batchinf.runtime.structured import vocab_of
from batchinf.runtime.template_sandbox import ThreadSandboxes, chat_results

PREFILL_CHUNK_TOKENS = 4096     # padded positions per prefill forward pass
PREFILL_PAD_SLACK = 1.25        # a prefill group's padded positions stay within this × its real tokens
PREFIX_MIN_TOKENS = 16          # a request sharing fewer leading tokens with any slot is prefilled in full


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


# --- the runtime ---------------------------------------------------------------------------------


@dataclass
class _Seq:
    req: GenRequest
    slot: int
    stops: frozenset[int]
    gen: torch.Generator | None
    out: list[int] = field(default_factory=list)
    start: int = 0              # prompt positions whose K/V were copied from another slot
    done: bool = False
    finish: str = "length"
    text: str | None = None     # set when a stop string cut it
    guide: Any = None           # structured.Guide of a response_format
    logprobs: list[dict] = field(default_factory=list)

    @property
    def pos(self) -> int:       # cache position of the last token fed (prompt + generated so far)
        return len(self.req.prompt_ids) + len(self.out) - 1

    @property
    def need(self) -> int:
        return len(self.req.prompt_ids) + self.req.params.max_tokens


class GenerateRuntime:
    """A loaded generate bundle: tokenizer, chat template and (unless with_model=False) the model."""

    def __init__(self, root: Path, meta: dict[str, Any], *, device: str = "cpu",
                 dtype_override: str | None = None) -> None:
        self.root, self.meta, self.device = Path(root), meta, device
        self.context_length: int = int(meta["context_length"])
        self.eos_ids: tuple[int, ...] = tuple(meta.get("special_tokens", {}).get("eos_ids", ()))
        self.tokenizer = Tokenizer.from_file(str(self.root / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        cfg = json.loads((self.root / "tokenizer_config.json").read_text()) \
            if (self.root / "tokenizer_config.json").is_file() else {}
        self._sandboxes = ThreadSandboxes(cfg)     # the chat template's, one per rendering thread
        self._dtype = dtype_override or meta.get("dtype", "float32")
        self.model: Any = None
        self.share_prefixes = True      # off only to measure what prefix sharing saves

    template_sandbox = property(lambda self: self._sandboxes.get(), doc="this thread's chat-template sandbox")

    # -- prompts --

    def encode_prompt(self, prompt: str) -> list[int]:
        """A plain completion prompt, with the special tokens the tokenizer adds (e.g. Llama's BOS)."""
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids

    def render_batches(self, batches: Iterable[list[list[dict]]]) -> Iterator[list[str | Exception]]:
        """Each batch of conversations rendered with the chat template (add_generation_prompt) by its
        sandbox process, or each one's error (template_sandbox.chat_results: the next batch is
        rendered while the caller works on this one's)."""
        return chat_results(self.template_sandbox, batches, self.root / "tokenizer_config.json")

    def render_chats(self, conversations: list[list[dict]]) -> list[str | Exception]:
        return next(self.render_batches([conversations]))

    def render_chat(self, messages: list[dict]) -> str:
        (result,) = self.render_chats([messages])
        if isinstance(result, Exception):
            raise result
        return result

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Messages rendered with the chat template (add_generation_prompt) and tokenized the way
        transformers' apply_chat_template does: the template writes the special tokens itself."""
        return self.encode_rendered(self.render_chat(messages))

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat (render_chats) tokenized as encode_chat does."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    encode_fixture = encode_prompt

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- model --

    def load_model(self) -> None:
        from batchinf.runtime.llama import load_llama

        dtype = "float32" if self.device == "cpu" else self._dtype   # CPUs here lack fast bf16
        if (self.meta.get("implementation") or {}).get("name") == "transformers":
            from batchinf.runtime.hf_decoder import load_transformers_decoder

            self.model = load_transformers_decoder(self.root, device=self.device, dtype=getattr(torch, dtype))
            self.share_prefixes = False     # its slots are transformers caches, not copyable K/V rows
            return
        self.model = load_llama(self.root, device=self.device, dtype=getattr(torch, dtype))

    def teacher_forced_rank(self, prompt_ids: list[int], continuation: list[int]) -> int:
        """The worst rank (0 = top) of each continuation token given everything before it."""
        if self.model is None:
            self.load_model()
        if not continuation:
            return 0
        ids = prompt_ids + continuation
        dev = self.model.device
        cache = self.model.new_cache(1, len(ids))
        with torch.inference_mode():
            logits = self.model.prefill(torch.tensor([ids], device=dev), torch.tensor([len(ids)], device=dev),
                                        torch.tensor([0], device=dev), cache, all_logits=True)[0]
        P = len(prompt_ids)
        rows = logits[P - 1:len(ids) - 1]                                   # [C, V]
        want = torch.tensor(continuation, device=dev)
        chosen = rows.gather(1, want[:, None])                              # [C, 1]
        return int((rows > chosen).sum(1).max())

    def check(self, requests: list[GenRequest], max_batch_tokens: int) -> None:
        for r in requests:
            p = r.params
            if not r.prompt_ids:
                raise ValueError(f"request {r.key}: the prompt is empty; it needs at least one token")
            if p.max_tokens < 1:
                raise ValueError(f"request {r.key}: max_tokens must be >= 1, got {p.max_tokens}")
            if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0:
                raise ValueError(f"request {r.key}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0")
            need = len(r.prompt_ids) + p.max_tokens
            if need > self.context_length:
                raise ValueError(f"request {r.key}: prompt ({len(r.prompt_ids)} tokens) + max_tokens "
                                 f"({p.max_tokens}) = {need} exceeds the model's context length "
                                 f"{self.context_length}; shorten the prompt or lower max_tokens")
            if need > max_batch_tokens:
                raise ValueError(f"request {r.key}: prompt + max_tokens = {need} exceeds max_batch_tokens "
                                 f"{max_batch_tokens}; raise the budget or lower max_tokens")

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token position takes in the cache, across every layer."""
        cfg = self.model.config
        return (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
                * self.model.lm_head.weight.dtype.itemsize)

    def generate(self, requests: Iterable[GenRequest], *, max_batch_tokens: int = 16384,
                 max_slots: int = 64, stats: GenStats | None = None, static: bool = False,
                 kv_budget: int | None = None, stop_admitting: Callable[[], bool] | None = None) -> Iterator[GenResult]:
        """Continuous batching (see the module docstring). static=True refills only when every
        sequence of the current batch has finished, with finished rows still computed (the
        classic static batch, kept for benchmarks). The KV cache never exceeds `kv_budget` bytes
        (default: this worker's BATCHINF_MAX_KV_CACHE_BYTES): slots are cut to fit, and a request
        that alone would not fit is refused (ValueError) before anything is allocated. Once
        `stop_admitting` (asked before refilling free slots) says True, the sequences in flight
        finish and those never admitted get no result (a split shard hands them on)."""
        reqs = list(requests)
        self.check(reqs, max_batch_tokens)
        if not reqs:
            return
        if self.model is None:
            self.load_model()
        stats = stats if stats is not None else GenStats()
        model = self.model
        # The cache is n_slots x capacity positions, so the budget bounds memory as well as admission.
        capacity = max(len(r.prompt_ids) + r.params.max_tokens for r in reqs)
        per_token = self.kv_bytes_per_token()
        budget = settings().max_kv_cache_bytes if kv_budget is None else kv_budget
        for r in reqs:
            need = len(r.prompt_ids) + r.params.max_tokens
            if need * per_token > budget:
                raise ValueError(f"request {r.key}: prompt + max_tokens = {need} tokens need {need * per_token} "
                                 f"bytes of KV cache, over this worker's budget of {budget} bytes "
                                 "(BATCHINF_MAX_KV_CACHE_BYTES); lower max_tokens or shorten the prompt")
        n_slots = max(1, min(max_slots, len(reqs), max_batch_tokens // capacity, budget // (capacity * per_token)))
        cache = model.new_cache(n_slots, capacity)
        # Longest max_tokens first: long answers start early, so the tail once the queue is empty
        # (few live rows, each step paying for all the weights) is made of short ones.
        order = reqs if static else sorted(reqs, key=lambda r: -r.params.max_tokens)
        queue: deque[GenRequest] = deque(order)
        slots: list[_Seq | None] = [None] * n_slots
        reserved = 0
        with torch.inference_mode():
            while queue or any(slots):
                if not static or not any(slots):
                    if queue and stop_admitting and len(queue) < len(reqs) and None in slots and stop_admitting():
                        queue.clear()
                    new: list[_Seq] = []
                    while queue and None in slots:
                        need = len(queue[0].prompt_ids) + queue[0].params.max_tokens
                        if reserved + need > max_batch_tokens:
                            break
                        seq = self._start(queue.popleft(), slots.index(None))
                        slots[seq.slot] = seq
                        reserved += need
                        new.append(seq)
                    if new:
                        self._prefill(new, slots, cache, stats)
                live = [s for s in slots if s is not None and not s.done]
                if live:
                    self._decode(slots, cache, stats)
                for i, s in enumerate(slots):
                    if s is not None and s.done and (not static or all(x is None or x.done for x in slots)):
                        slots[i] = None
                        reserved -= s.need
                        yield self._result(s)
                if not static and not queue:
                    _compact(slots, cache)

    def _start(self, req: GenRequest, slot: int) -> _Seq:
        p = req.params
        gen = None
        if p.temperature > 0:
            gen = torch.Generator(device=self.model.device)
            gen.manual_seed(p.seed)
        guide = vocab_of(self).guide(p.response_format, req.key) if p.response_format is not None else None
        return _Seq(req, slot, frozenset(self.eos_ids) | frozenset(p.stop_token_ids), gen, guide=guide)

    def _prefill(self, new: list[_Seq], slots: list[_Seq | None], cache: Any, stats: GenStats) -> None:
        """Start newly admitted sequences: a sequence sharing a prefix with an occupied slot copies
        its K/V and waits for the decode step (see the module docstring); the others are prefilled,
        which yields their first token. Of new sequences sharing a prefix nobody holds yet, the
        first is prefilled, the others then copy from it."""
        dev = self.model.device
        fresh = set(id(s) for s in new)
        donors = [s for s in slots if s is not None and id(s) not in fresh]
        leaders: list[_Seq] = []
        followers: list[tuple[_Seq, _Seq]] = []             # (sequence, donor)
        for s in sorted(new, key=lambda s: s.req.prompt_ids):
            donor, n = _longest_shared(s.req.prompt_ids, donors + leaders) if self.share_prefixes else (None, 0)
            if donor is not None and n >= PREFIX_MIN_TOKENS:
                s.start = n
                followers.append((s, donor))
            else:
                leaders.append(s)
        for group in _prefill_groups(leaders, lambda s: len(s.req.prompt_ids)):
            tokens, lengths = _right_padded([s.req.prompt_ids for s in group], dev)
            logits = self.model.prefill(tokens, lengths, torch.tensor([s.slot for s in group], device=dev), cache)
            stats.prefill_positions += tokens.numel()
            self._advance(group, logits)
        if followers:
            shared = torch.tensor([s.start for s, _ in followers], device=dev)
            dst = torch.tensor([s.slot for s, _ in followers], device=dev)
            src = torch.tensor([d.slot for _, d in followers], device=dev)
            for layer in cache.layers:
                layer.copy_prefix(dst, src, shared)
            stats.cached_prompt_tokens += int(shared.sum())
        stats.prompt_tokens += sum(len(s.req.prompt_ids) for s in new)

    def _decode(self, slots: list[_Seq | None], cache: Any, stats: GenStats) -> None:
        from batchinf.runtime.llama import Fill

        hi = max(i for i, s in enumerate(slots) if s is not None) + 1
        rows = slots[:hi]
        dev = self.model.device
        # Idle and finished rows recompute their own last position: harmless, and counted as waste.
        # A joining row (no output yet) feeds its last prompt token.
        tokens = [(s.out[-1] if s.out else s.req.prompt_ids[-1]) if s is not None else 0 for s in rows]
        pos = [s.pos if s is not None else 0 for s in rows]
        joining = [s for s in rows if s is not None and not s.out]
        fills = []
        middle = [s for s in joining if s.start < len(s.req.prompt_ids) - 1]
        for group in _prefill_groups(middle, lambda s: len(s.req.prompt_ids) - 1 - s.start):
            tokens_g, lengths = _right_padded([s.req.prompt_ids[s.start:-1] for s in group], dev)
            fills.append(Fill(tokens_g, torch.tensor([s.start for s in group], device=dev),
                              torch.tensor([s.slot for s in group], device=dev), lengths))
            stats.prefill_positions += tokens_g.numel()
        for fill in fills[:-1]:             # only the last group rides along the decode step
            self.model.fill(fill, cache)
        logits = self.model.decode_step(torch.tensor(tokens, device=dev), torch.tensor(pos, device=dev), cache,
                                        fills[-1] if fills else None)
        live = [s for s in rows if s is not None and not s.done]
        stats.decode_slot_steps += hi
        stats.decode_tokens += len(live)
        stats.joined += len(joining)
        self._advance(live, logits[[s.slot for s in live]] if len(live) < hi else logits)

    def _advance(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        """Pick each sequence's next token from its logits row [len(seqs), V] and check stops."""
        picked = logits.argmax(-1).tolist()
        for i, s in enumerate(seqs):
            row = s.guide.masked(logits[i]) if s.guide is not None else logits[i]
            if s.gen is not None:
                picked[i] = sample(row, s.req.params, s.gen)
            elif s.guide is not None:
                picked[i] = int(row.argmax())
            if s.req.params.logprobs is not None:
                s.logprobs.append(vocab_of(self).logprobs(logits[i], picked[i], s.req.params.logprobs))
        for s, t in zip(seqs, picked):
            p = s.req.params
            if s.guide is not None and s.guide.consume(t) and t not in s.stops:
                s.done, s.finish = True, "stop"     # the grammar is complete: nothing may follow
                s.out.append(t)
                continue
            if t in s.stops:
                s.done, s.finish = True, "stop"
                s.out.append(t)
                continue
            s.out.append(t)
            # A new match ends in the newest token's text: look at a short tail first, so a long
            # answer is not decoded in full at every step.
            if p.stop and any(x in self.decode(s.out[-(max(map(len, p.stop)) + 8):]) for x in p.stop):
                text = self.decode(s.out)
                cut = min((i for i in (text.find(x) for x in p.stop) if i >= 0), default=-1)
                if cut >= 0:
                    s.done, s.finish, s.text = True, "stop", text[:cut]
                    continue
            if len(s.out) >= p.max_tokens:
                s.done, s.finish = True, "length"

    def _result(self, s: _Seq) -> GenResult:
        ids = s.out[:-1] if s.out and s.out[-1] in s.stops and s.finish == "stop" and s.text is None else s.out
        text = s.text if s.text is not None else self.decode(ids)
        return GenResult(key=s.req.key, token_ids=list(ids), text=text, finish_reason=s.finish,
                         input_tokens=len(s.req.prompt_ids), output_tokens=len(s.out),
                         logprobs=s.logprobs[:len(ids)] if s.req.params.logprobs is not None else None)


def _compact(slots: list[_Seq | None], cache: Any) -> None:
    """Move the highest occupied slots into the free slots below them, so a decode step computes
    only occupied rows. Only called when the queue cannot refill those free slots at the next step."""
    while True:
        hi = max((i for i, s in enumerate(slots) if s is not None), default=-1)
        lo = slots.index(None) if None in slots else len(slots)
        if lo >= hi:
            return
        seq = slots[hi]
        assert seq is not None
        cache.move(hi, lo, seq.pos + 1)          # positions written so far (and the next one)
        seq.slot, slots[lo], slots[hi] = lo, seq, None


def _prefill_groups(seqs: list[_Seq], length: Callable[[_Seq], int]) -> list[list[_Seq]]:
    """Groups sorted by `length` whose padding stays small and whose padded size fits one chunk."""
    groups: list[list[_Seq]] = []
    cur: list[_Seq] = []
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


def _right_padded(rows: list[list[int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (tokens [B, S] right-padded with 0, lengths [B])."""
    S = max(map(len, rows))
    return (torch.tensor([r + [0] * (S - len(r)) for r in rows], device=dev),
            torch.tensor([len(r) for r in rows], device=dev))


def _longest_shared(prompt: list[int], donors: list[_Seq]) -> tuple[_Seq | None, int]:
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
