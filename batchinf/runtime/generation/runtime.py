"""A loaded generate bundle: tokenizer and chat template (prompts.py), the model, the bundle's
fixture checks, request checks, and `generate`, the loop of scheduler (plans a step) and engine
(runs it). torch is imported where the model is: a planner (`with_model=False`) tokenises without
it, so a job's driver neither waits for torch nor holds its memory."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from batchinf.config import settings
from batchinf.runtime.generation.kv import KVManager
from batchinf.runtime.generation.prompts import Prompts
from batchinf.runtime.generation.scheduler import Scheduler
from batchinf.runtime.generation.seq import GenRequest, GenResult, GenStats


class GenerateRuntime(Prompts):
    """A loaded generate bundle: tokenizer, chat template and (unless with_model=False) the model."""

    def __init__(self, root: Path, meta: dict[str, Any], *, device: str = "cpu",
                 dtype_override: str | None = None) -> None:
        super().__init__(root)
        self.meta, self.device = meta, device
        self.context_length: int = int(meta["context_length"])
        self.eos_ids: tuple[int, ...] = tuple(meta.get("special_tokens", {}).get("eos_ids", ()))
        self._dtype = dtype_override or meta.get("dtype", "float32")
        self.model: Any = None
        self.share_prefixes = True      # off only to measure what prefix sharing saves

    def load_model(self) -> None:
        import torch

        from batchinf.runtime.llama import load_llama

        dtype = "float32" if self.device == "cpu" else self._dtype   # CPUs here lack fast bf16
        if (self.meta.get("implementation") or {}).get("name") == "transformers":
            from batchinf.runtime.hf_decoder import load_transformers_decoder

            self.model = load_transformers_decoder(self.root, device=self.device, dtype=getattr(torch, dtype))
            self.share_prefixes = False     # its slots are transformers caches, not copyable K/V rows
            return
        self.model = load_llama(self.root, device=self.device, dtype=getattr(torch, dtype))

    def teacher_forced_rank(self, prompt_ids: list[int], continuation: list[int]) -> int:
        """The worst rank (0 = top) of each continuation token given everything before it (the
        bundle's fixtures)."""
        import torch

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
                * self.model.dtype.itemsize)

    def generate(self, requests: Iterable[GenRequest], *, max_batch_tokens: int = 16384,
                 max_slots: int = 64, stats: GenStats | None = None, kv_budget: int | None = None,
                 stop_admitting: Callable[[], bool] | None = None, abort: Callable[[], bool] | None = None,
                 scheduler: type[Scheduler] = Scheduler) -> Iterator[GenResult]:
        """Continuous batching (scheduler.py), results yielded as sequences finish. The KV cache
        never exceeds `kv_budget` bytes (default: this worker's BATCHINF_MAX_KV_CACHE_BYTES): slots
        are cut to fit, and a request that alone would not fit is refused (ValueError) before
        anything is allocated. Once `stop_admitting` (asked before refilling free slots) says True,
        the sequences in flight finish and those never admitted get no result (a split shard hands
        them on). Once `abort` (asked before each step) says True, decoding stops there: the
        sequences not finished get no result. `scheduler` swaps the policy (benchmarks/static_batching.py)."""
        import torch

        from batchinf.runtime.generation.engine import Engine
        from batchinf.runtime.generation.structured import vocab_of

        reqs = list(requests)
        self.check(reqs, max_batch_tokens)
        if not reqs:
            return
        if self.model is None:
            self.load_model()
        kv = KVManager.sized(reqs, bytes_per_token=self.kv_bytes_per_token(),
                             budget=settings().max_kv_cache_bytes if kv_budget is None else kv_budget,
                             max_batch_tokens=max_batch_tokens, max_slots=max_slots,
                             share_prefixes=self.share_prefixes)
        sched = scheduler(reqs, kv, stop_admitting=stop_admitting)
        engine = Engine(self.model, self.model.new_cache(len(kv.slots), kv.capacity),
                        stats if stats is not None else GenStats(), eos_ids=self.eos_ids,
                        decode=self.decode, vocab=lambda: vocab_of(self))
        with torch.inference_mode():
            while sched.busy and not (abort is not None and abort()):
                engine.run(sched.schedule())
                for seq in sched.update():
                    engine.release(seq)
                    yield seq.result(self.decode)
