"""An encoder bundle's model as an ONNX graph for the onnxruntime engine, made at bundle import.

The pinned weights are loaded by batchinf's own encoder (runtime/encoder.py, runtime/classifier.py:
no transformers), traced by torch.onnx.export (TorchScript) with the batch and sequence axes
dynamic, and optimised by `onnxruntime.transformers.optimizer` (model_type bert), which fuses what
it recognises (GELU with its bias, layer norms; `onnx.fused` in bundle.json says what). Attention
stays unfused (one QKV projection, then scaled dot-product attention): on this project's CPU the
fused Attention and EmbedLayerNormalization kernels measured no faster (docs/performance/embed_peers.md).
What follows the encoder runs
inside the same graph, written by the very functions native runs (runtime/st_modules.py `pool`
and `head`: the bundle's pooling, Dense layers and normalisation; or the classifier's own head), so
a worker on this engine computes the bundle's output with ONNX Runtime alone (no PyTorch import).

int8: runtime/onnx_int8.py rewrites the optimised float32 graph into native's int8 computation."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from batchinf.errors import BundleError

OPSET = 17
ONNX_FAMILIES = ("bert", "roberta", "xlm-roberta")
EMBED_INPUTS = ("input_ids", "attention_mask")
CLASSIFIER_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def problem(meta: dict[str, Any]) -> str | None:
    """Why this bundle's model cannot be exported for the onnxruntime engine, or None."""
    from batchinf.engines import TASKS

    if meta.get("task") not in TASKS["onnxruntime"]:
        return (f"the onnxruntime engine runs {', '.join(TASKS['onnxruntime'])} bundles, not "
                f"{meta.get('task')}")
    if meta.get("encoder") or meta.get("family") not in ONNX_FAMILIES:
        return (f"the onnxruntime engine runs {', '.join(ONNX_FAMILIES)} encoders; this bundle is family "
                f"{meta.get('family')!r}{' (' + meta['encoder'] + ')' if meta.get('encoder') else ''}")
    return None


def _unpacked(model: Any) -> Any:
    """`model` without its oneDNN-prepacked projections (runtime/encoder.pack_encoder): the plain
    F.linear path, which the exporter traces into MatMul and Add."""
    for m in model.modules():
        if hasattr(m, "packed"):
            m.packed = None
    return model


def _embed_module(src: Path, meta: dict[str, Any]) -> Any:
    import torch

    from batchinf.runtime.encoder import load_encoder
    from batchinf.runtime.st_modules import head, load_dense, pool

    encoder = _unpacked(load_encoder(src))
    dense = load_dense(src, meta, "cpu", torch.float32)

    class Embedder(torch.nn.Module):
        """input ids, attention mask [B, S] -> the bundle's vectors [B, D'] (pooled, Dense, normalised)."""

        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder
            for k, (w, b, _) in enumerate(dense):
                self.register_buffer(f"dense{k}_weight", w)
                self.register_buffer(f"dense{k}_bias", b)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.encoder(input_ids, attention_mask)  # [B, S, D]
            layers = [(getattr(self, f"dense{k}_weight"), getattr(self, f"dense{k}_bias"), act)
                      for k, (_, _, act) in enumerate(dense)]
            return head(pool(hidden, attention_mask, meta["pooling"]), layers, bool(meta["normalize"]))

    return Embedder().eval(), encoder.config


def _classifier_module(src: Path) -> Any:
    import torch

    from batchinf.runtime.classifier import load_classifier

    model = _unpacked(load_classifier(src))

    class Logits(torch.nn.Module):
        """input ids, attention mask, token type ids [B, S] -> raw logits [B, L]."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    token_type_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids, token_type_ids, attention_mask)

    return Logits().eval(), model.cfg.encoder


def export(src: Path, meta: dict[str, Any], out: Path) -> dict[str, Any]:
    """The bundle's model at `src` as an optimised float32 ONNX graph at `out`; what was done (for bundle.json)."""
    import torch
    from onnxruntime import __version__ as ort_version
    from onnxruntime.transformers import optimizer

    if (why := problem(meta)) is not None:
        raise BundleError(f"{src}: cannot add an ONNX export: {why}")
    from batchinf.tasks import get_task

    embed = get_task(meta["task"]).onnx_output == "embedding"
    module, config = _embed_module(src, meta) if embed else _classifier_module(src)
    names = EMBED_INPUTS if embed else CLASSIFIER_INPUTS
    sample = torch.ones(2, 8, dtype=torch.long)
    args = (sample, sample) if embed else (sample, sample, torch.zeros_like(sample))
    raw = out.with_suffix(".raw.onnx")
    out.parent.mkdir(parents=True, exist_ok=True)
    axes = {n: {0: "batch", 1: "sequence"} for n in names}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")     # the TorchScript exporter's deprecation notice
        torch.onnx.export(module, args, str(raw), input_names=list(names), output_names=["output"],
                          dynamic_axes={**axes, "output": {0: "batch"}}, opset_version=OPSET, dynamo=False)
    try:
        opt = optimizer.optimize_model(str(raw), model_type="bert", num_heads=config.num_attention_heads,
                                       hidden_size=config.hidden_size)
        fused = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
        opt.save_model_to_file(str(out))
    finally:
        raw.unlink(missing_ok=True)
    return {"opset": OPSET, "inputs": list(names),
            "exporter": f"torch {torch.__version__} torch.onnx.export (TorchScript) of batchinf's encoder",
            "optimizer": f"onnxruntime {ort_version} onnxruntime.transformers.optimizer (model_type bert)",
            "fused": dict(sorted(fused.items()))}
