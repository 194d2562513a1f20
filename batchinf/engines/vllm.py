"""The vllm engine: a generate bundle's own pinned files (a transformers directory: GGUF bundles are
converted to one at import) run by an in-process `vllm.LLM`, kept warm across shards.

The tokenizer and chat template stay the bundle's: records arrive as the token ids planning staged,
and each becomes one vLLM request with every sampling field of its record (its own seed, so a retry
or a split reproduces it; stop strings and ids; max_tokens; logprobs; a response_format through
vLLM's structured outputs). A shard's requests are all added at once, so vLLM's scheduler sees the
full queue; results come back as they finish (the heartbeat counts them), a split stops requests not
yet started, and a lost lease aborts every request in flight.

vLLM on CPU needs `enforce_eager=True` (its compiled warm-up runs for many minutes there) and a KV
cache size (VLLM_CPU_KVCACHE_SPACE, GiB; set here from BATCHINF_MAX_KV_CACHE_BYTES when unset).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from batchinf.config import settings
from batchinf.errors import BundleError
from batchinf.runtime.generation.runtime import GenerateRuntime
from batchinf.runtime.generation.seq import GenRequest, GenResult, GenStats


def sampling_params(p: Any, eos_ids: tuple[int, ...]) -> Any:
    """vLLM's SamplingParams for one record's batchinf params, every field mapped."""
    from vllm import SamplingParams

    kw: dict[str, Any] = {"n": 1, "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
                          "top_k": p.top_k if p.top_k > 0 else -1, "seed": p.seed, "stop": list(p.stop) or None,
                          "stop_token_ids": sorted(set(p.stop_token_ids) | set(eos_ids)) or None,
                          "include_stop_str_in_output": False, "skip_special_tokens": True,
                          "logprobs": None if p.logprobs is None else max(1, p.logprobs)}
    if p.response_format is not None:
        from vllm.sampling_params import StructuredOutputsParams

        fmt = json.loads(p.response_format)
        kw["structured_outputs"] = (StructuredOutputsParams(json=fmt["json_schema"]["schema"])
                                    if fmt["type"] == "json_schema" else StructuredOutputsParams(json_object=True))
    return SamplingParams(**kw)


class VllmGenerateRuntime(GenerateRuntime):
    """A generate bundle executed by vLLM: the tokenizer, chat template and fixtures are the
    bundle's, the forward passes and the scheduling vLLM's."""

    engine = "vllm"

    def __init__(self, root: Path, meta: dict[str, Any], *, device: str = "cpu") -> None:
        super().__init__(root, meta, device=device)
        self.llm: Any = None
        self._ids = 0

    def load_model(self) -> None:
        if self.llm is not None:
            return
        if self.device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, settings().max_kv_cache_bytes >> 30)))
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")     # the engine in this process
        from vllm import LLM

        self.llm = LLM(model=str(self.root), tokenizer=str(self.root), skip_tokenizer_init=False,
                       dtype="float32" if self.device == "cpu" else self.meta.get("dtype", "bfloat16"),
                       max_model_len=self.context_length, enforce_eager=self.device == "cpu", seed=0,
                       trust_remote_code=False, load_format="safetensors", disable_log_stats=True)

    def verify_fixtures(self) -> None:
        """The bundle's greedy fixtures through vLLM: token for token, or refused naming the fixture."""
        from batchinf.runtime.bundle import GREEDY_FIXTURE_TOKENS
        from batchinf.runtime.generation.sampling import SamplingParams

        pinned = [(i, fx) for i, fx in enumerate(self.meta["fixtures"]) if "continuation" in fx]
        got = {r.key: (r.token_ids, r.finish_reason) for r in self.generate(
            [GenRequest(i, fx["token_ids"], SamplingParams(max_tokens=GREEDY_FIXTURE_TOKENS)) for i, fx in pinned])}
        for i, fx in pinned:
            if got[i] != (fx["continuation"], fx["finish_reason"]):
                raise BundleError(f"vllm fixture {i} of bundle {self.root}: vLLM's greedy continuation {got[i][0]} "
                                  f"({got[i][1]}) differs from the recorded {fx['continuation']} ({fx['finish_reason']}): "
                                  "this vLLM build does not compute what the bundle pinned; run it on native")

    def generate(self, requests: Iterable[GenRequest], *, max_batch_tokens: int = 16384, max_slots: int = 64,
                 stats: GenStats | None = None, stop_admitting: Callable[[], bool] | None = None,
                 **_: Any) -> Iterator[GenResult]:
        reqs = list(requests)
        self.check(reqs, max_batch_tokens)
        if not reqs:
            return
        self.load_model()
        engine = self.llm.llm_engine
        by_id: dict[str, GenRequest] = {}
        for r in reqs:
            self._ids += 1
            rid = f"b{self._ids}"
            by_id[rid] = r
            engine.add_request(rid, {"prompt_token_ids": list(r.prompt_ids)}, sampling_params(r.params, self.eos_ids))
        started: set[str] = set()
        try:
            while by_id and engine.has_unfinished_requests():
                if stop_admitting is not None and stop_admitting():
                    unstarted = [rid for rid in by_id if rid not in started]
                    if unstarted:            # a split: those not started yet go to the shard's children
                        engine.abort_request(unstarted)
                        for rid in unstarted:
                            del by_id[rid]
                for out in engine.step():
                    started.add(out.request_id)
                    if out.finished and out.request_id in by_id:
                        yield self._result(by_id.pop(out.request_id), out, stats)
        finally:
            if by_id:                        # a lost lease or an error: abort what is in flight
                engine.abort_request(list(by_id))
                while engine.has_unfinished_requests():
                    engine.step()

    def _result(self, r: GenRequest, out: Any, stats: GenStats | None) -> GenResult:
        c = out.outputs[0]
        ids = list(c.token_ids)
        finish = "length" if c.finish_reason == "length" else "stop"
        produced = len(ids)
        if finish == "stop" and ids and ids[-1] in set(self.eos_ids) | set(r.params.stop_token_ids):
            ids = ids[:-1]                   # as native: without the stop token, which output_tokens counts
        if stats is not None:
            stats.prompt_tokens += len(r.prompt_ids)
            stats.prefill_positions += len(r.prompt_ids)
            stats.decode_tokens += produced
            stats.decode_slot_steps += produced
        logprobs = None
        if r.params.logprobs is not None and c.logprobs:
            logprobs = [_entry(ids_at, pos_lp, r.params.logprobs, self.decode) for ids_at, pos_lp in zip(ids, c.logprobs)]
        return GenResult(key=r.key, token_ids=ids, text=c.text, finish_reason=finish,
                         input_tokens=len(r.prompt_ids), output_tokens=produced, logprobs=logprobs)


def _entry(token_id: int, lps: dict[int, Any], n: int, decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """One position's vLLM logprobs as an OpenAI logprobs.content entry."""
    def tok(i: int) -> str:
        return decode([i])

    chosen = lps.get(token_id)
    top = sorted(lps.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)[:n]
    return {"token": tok(token_id), "logprob": None if chosen is None else float(chosen.logprob),
            "bytes": list(tok(token_id).encode()),
            "top_logprobs": [{"token": tok(i), "logprob": float(lp.logprob), "bytes": list(tok(i).encode())}
                             for i, lp in top]}
