"""The plain ONNX Runtime script batchinf is measured against (issue #32): JSONL in, Parquet out.

    python ort_embed_script.py export MODEL_DIR OUT.onnx [--int8]   # once, untimed (as a pre-exported model)
    python ort_embed_script.py run OUT.onnx MODEL_DIR IN.jsonl OUT.parquet

`export`: the model through torch.onnx.export (transformers, eager attention), ORT's BERT graph
optimizer, and with --int8 ORT's dynamic quantizer. `run`: 2 intra-op threads, records sorted by
token length, batches of 64, mean pooling and L2 normalisation, max length 256."""
import json
import sys

import numpy as np


def export(model_dir: str, out: str, int8: bool) -> None:
    import torch
    from onnxruntime.transformers import optimizer
    from transformers import AutoModel

    bert = AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.ones(2, 8, dtype=torch.long)
    axes = {"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"}, "hidden": {0: "b", 1: "s"}}
    torch.onnx.export(Hidden(), (ids, ids), out + ".raw", input_names=["input_ids", "attention_mask"],
                      output_names=["hidden"], dynamic_axes=axes, opset_version=17, dynamo=False)
    cfg = bert.config
    optimizer.optimize_model(out + ".raw", model_type="bert", num_heads=cfg.num_attention_heads,
                             hidden_size=cfg.hidden_size).save_model_to_file(out)
    if int8:
        from onnx import TensorProto
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(out, out, weight_type=QuantType.QInt8, per_channel=True,
                         extra_options={"DefaultTensorType": TensorProto.FLOAT})


def run(onnx: str, model_dir: str, src: str, dst: str) -> None:
    import onnxruntime as ort
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    session = ort.InferenceSession(onnx, opts, providers=["CPUExecutionProvider"])
    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    tok.enable_truncation(256)
    tok.no_padding()
    rows = [json.loads(line) for line in open(src)]
    enc = tok.encode_batch([r["text"] for r in rows])
    order = sorted(range(len(rows)), key=lambda i: len(enc[i].ids))
    out = None
    for k in range(0, len(order), 64):
        batch = order[k:k + 64]
        width = max(len(enc[i].ids) for i in batch)
        ids = np.zeros((len(batch), width), np.int64)
        mask = np.zeros_like(ids)
        for j, i in enumerate(batch):
            ids[j, :len(enc[i].ids)], mask[j, :len(enc[i].ids)] = enc[i].ids, 1
        hidden = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        pooled = (hidden * mask[..., None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1e-9)
        out = np.zeros((len(rows), pooled.shape[1]), np.float32) if out is None else out
        out[batch] = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(out.reshape(-1)), out.shape[1])
    pq.write_table(pa.table({"id": [r["id"] for r in rows], "embedding": vectors}), dst)


if __name__ == "__main__":
    if sys.argv[1] == "export":
        export(sys.argv[2], sys.argv[3], "--int8" in sys.argv)
    else:
        run(*sys.argv[2:6])
