"""The vllm engine for the pooling tasks: embed (a sentence-transformers encoder) and score / classify
(a sequence classifier: cross-encoders included), run by an in-process `vllm.LLM` with its pooling
runner over the bundle's own pinned files, kept warm across shards.

The contract is native's: records arrive as the token ids planning staged (the bundle's tokenizer,
truncated at the job's max length), and each is one vLLM prompt of those ids (with its token type
ids, for a BERT pair). Embed pools as the bundle says (its sentence-transformers Pooling module:
CLS, mean or last token) and normalises when the bundle does, both set explicitly on vLLM's pooler
instead of left to its guesses; score and classify take vLLM's raw logits (no activation), and the
task applies the bundle's activation as on native. The bundle's fixtures (embedding values, logits)
are replayed through vLLM at load, and a disagreement is refused naming the fixture.

What vLLM's pooler cannot do as the bundle says (max or weighted-mean pooling, several modes
concatenated, Dense layers after pooling, int8 weights) is refused when the job is created (the
task's `vllm_problem`: `embed_problem`, `classifier_problem`); an architecture vLLM lacks, when the
engine loads the bundle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from batchinf.errors import BundleError
from batchinf.runtime.classifier import ClassifierRuntime
from batchinf.runtime.embed import EmbedRuntime
from batchinf.runtime.fixture_checks import check_embeddings, check_logits

POOLING = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}   # the bundle's mode -> vLLM's
EMBED_MIN_COSINE = 0.9999          # as native's float32 fixtures (runtime/bundle.verify_model_fixtures)
LOGITS_TOLERANCE = 1e-4            # as native's float32 fixtures (runtime/classifier.compare_logits)


def classifier_problem(meta: dict[str, Any]) -> str | None:
    """Why vLLM's pooling runner cannot run this score or classify bundle as native does, or None."""
    if meta.get("precision") == "int8":
        return "it is an int8 bundle (batchinf's own quantisation, which vLLM does not read)"
    return None


def embed_problem(meta: dict[str, Any]) -> str | None:
    """Why vLLM's pooling runner cannot run this embed bundle as native does (its pooling, its
    Dense layers), or None."""
    if (why := classifier_problem(meta)) is not None:
        return why
    pooling = meta.get("pooling")
    if not isinstance(pooling, str) or pooling not in POOLING:
        return (f"it pools by {pooling!r} and vLLM's pooler pools by {', '.join(POOLING)} only "
                "(one mode, as the bundle's sentence-transformers Pooling module)")
    if meta.get("dense"):
        return "it has Dense layers after pooling, which vLLM's embedding pooler would not apply as the bundle does"
    return None


def _llm(root: Path, meta: dict[str, Any], device: str, pooler: dict[str, Any]) -> Any:
    """An in-process vLLM pooling engine over the bundle's files; BundleError when vLLM cannot load it."""
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")       # GiB: a pooling model keeps no KV across steps
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine in this process
    from vllm import LLM
    from vllm.config import PoolerConfig

    try:
        return LLM(model=str(root), tokenizer=str(root), runner="pooling", pooler_config=PoolerConfig(**pooler),
                   dtype="float32" if device == "cpu" else meta.get("dtype", "bfloat16"),
                   max_model_len=int(meta["max_length"]), enforce_eager=device == "cpu", seed=0,
                   trust_remote_code=False, load_format="safetensors", disable_log_stats=True)
    except Exception as exc:  # noqa: BLE001 -- vLLM raises ValueError, RuntimeError, ... for a model it lacks
        raise BundleError(f"vLLM's pooling runner cannot load bundle {root}: {type(exc).__name__}: "
                          f"{str(exc)[:400]}; run it on engine native") from exc


def _prompt(ids: list[int]) -> dict[str, Any]:
    return {"prompt_token_ids": list(ids)}


def _pair_params(types: list[int]) -> Any:
    """Raw logits, with a BERT pair's token types: vLLM reads them only as where the second segment
    starts (`compressed_token_type_ids`, as its own score path sends them), so they must be zeros,
    then ones (what a pair's tokenizer gives)."""
    from vllm import PoolingParams

    second = next((i for i, t in enumerate(types) if t), len(types))
    if any(t != (i >= second) for i, t in enumerate(types)):
        raise BundleError(f"token type ids {types[:8]}...: vLLM takes a pair's types as zeros, then ones; "
                          "run this bundle on engine native")
    extra = {"compressed_token_type_ids": second} if second < len(types) else None
    return PoolingParams(use_activation=False, extra_kwargs=extra)


class VllmEmbedRuntime(EmbedRuntime):
    """An embed bundle executed by vLLM's pooling runner: the tokenizer, pooling, normalisation and
    fixtures are the bundle's, the forward passes vLLM's."""

    engine = "vllm"

    def load_model(self) -> None:
        if self.model is not None:
            return
        self.model = _llm(self.root, self.meta, self.device,
                          {"task": "embed", "seq_pooling_type": POOLING[self.meta["pooling"]],
                           "use_activation": bool(self.meta["normalize"])})

    def embed(self, batch: list[list[int]]) -> tuple[np.ndarray, int]:
        """batch of token-id lists -> (float32 [B, D], token positions computed: vLLM pads none)."""
        from vllm import PoolingParams

        if self.model is None:
            self.load_model()
        outs = self.model.embed([_prompt(ids) for ids in batch], use_tqdm=False,
                                pooling_params=PoolingParams(use_activation=bool(self.meta["normalize"])))
        return np.asarray([o.outputs.embedding for o in outs], dtype=np.float32), sum(map(len, batch))

    def verify_fixtures(self) -> None:
        """Each fixture's embedding through vLLM within cosine EMBED_MIN_COSINE of the recorded one."""
        fixtures = self.meta["fixtures"]
        got, _ = self.embed([fx["token_ids"] for fx in fixtures])
        check_embeddings(got, fixtures, EMBED_MIN_COSINE, self.root, engine="vllm", whose="vLLM's",
                         why="vLLM does not compute what the bundle pinned (weights changed, or another pooling)",
                         fix="restore the bundle, or run it on native")


class VllmClassifierRuntime(ClassifierRuntime):
    """A score or classify bundle executed by vLLM's pooling runner: raw logits (the task applies the
    bundle's activation, as on native); the tokenizer and fixtures are the bundle's."""

    engine = "vllm"

    def load_model(self) -> None:
        if self.model is not None:
            return
        self.model = _llm(self.root, self.meta, self.device,
                          {"task": "classify", "seq_pooling_type": "CLS", "use_activation": False})

    def logits(self, ids: list[list[int]], types: list[list[int]]) -> tuple[np.ndarray, int]:
        if self.model is None:
            self.load_model()
        outs = self.model.classify([_prompt(i) for i in ids], use_tqdm=False,
                                   pooling_params=[_pair_params(t) for t in types])
        return np.asarray([o.outputs.probs for o in outs], dtype=np.float32), sum(map(len, ids))

    def verify_fixtures(self) -> None:
        """Each fixture's logits through vLLM within LOGITS_TOLERANCE (relative to its largest) of the recorded."""
        fixtures = self.meta["fixtures"]
        got, _ = self.logits([f["input_ids"] for f in fixtures], [f["type_ids"] for f in fixtures])
        check_logits(got, fixtures, LOGITS_TOLERANCE, self.root, engine="vllm", whose="vLLM's",
                     why="vLLM does not compute what the bundle pinned (weights changed)",
                     fix="restore the bundle, or run it on native")
