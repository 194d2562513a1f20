"""A speech bundle opened: its feature spec and tokenizer for planning; its engine (CTranslate2
Whisper, runtime/speech/whisper.py) once `load_model` runs on a worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchinf.runtime.speech.features import FeatureSpec


class SpeechRuntime:
    def __init__(self, root: Path, meta: dict[str, Any], device: str = "cpu") -> None:
        import tokenizers

        self.root, self.meta, self.device = root, meta, device
        f = meta["features"]
        self.spec = FeatureSpec(f["sample_rate"], f["n_mels"], f["hop"], f["n_fft"], f["chunk_seconds"])
        self.tokenizer = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        self.engine: Any = None
        self.progress_done = 0.0     # audio seconds decoded by this process (Task.progress_unit)

    def load_model(self, threads: int | None = None) -> None:
        """Load the engine with `threads` intra-op threads (default: the worker's, cores / workers)."""
        from batchinf.runtime.speech.whisper import WhisperEngine
        from batchinf.runtime.threads import worker_threads

        self.engine = WhisperEngine(self.root, self.meta, self.device, threads or worker_threads())
