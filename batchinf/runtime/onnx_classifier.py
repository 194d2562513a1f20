"""Score and classify bundles (sequence classifiers, cross-encoders included) executed by ONNX
Runtime on CPU: the onnxruntime engine's counterpart of runtime/classifier.py (see
runtime/onnx_encoder.py for the session and the fixtures' check)."""

from __future__ import annotations

import numpy as np

from batchinf.runtime.classifier import ClassifierRuntime
from batchinf.runtime.fixture_checks import check_logits
from batchinf.runtime.onnx_encoder import FIX, WHY, graph_path, padded, session
from batchinf.runtime.threads import worker_threads

LOGITS_TOLERANCE = 1e-4            # as native's float32 fixtures (runtime/classifier.compare_logits)


class OrtClassifierRuntime(ClassifierRuntime):
    """A score or classify bundle executed by ONNX Runtime: raw logits (the task applies the
    bundle's activation, as on native); the tokenizer and fixtures are the bundle's."""

    engine = "onnxruntime"

    def load_model(self) -> None:
        if self.model is None:
            self.model = session(graph_path(self.root, self.meta), worker_threads())

    def logits(self, ids: list[list[int]], types: list[list[int]]) -> tuple[np.ndarray, int]:
        if self.model is None:
            self.load_model()
        x, mask = padded(ids, self.pad_id)
        t = np.zeros_like(x)
        for i, row in enumerate(types):
            t[i, :len(row)] = row
        out = self.model.run(None, {"input_ids": x, "attention_mask": mask, "token_type_ids": t})[0]
        return np.asarray(out, dtype=np.float32), x.size

    def verify_fixtures(self) -> None:
        """Each fixture's logits within LOGITS_TOLERANCE (relative to its largest) of the recorded ones."""
        fixtures = self.meta["fixtures"]
        got, _ = self.logits([f["input_ids"] for f in fixtures], [f["type_ids"] for f in fixtures])
        check_logits(got, fixtures, LOGITS_TOLERANCE, self.root, engine="onnxruntime", whose="the ONNX graph's",
                     why=WHY, fix=FIX)
