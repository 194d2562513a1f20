"""A speech bundle opened: its feature spec for planning, its tokenizer when first used (the input
check, the engine); its engine (CTranslate2 Whisper, runtime/speech/whisper.py) once `load_model`
runs on a worker."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from batchinf.runtime.speech.features import FeatureSpec


class SpeechRuntime:
    def __init__(self, root: Path, meta: dict[str, Any], device: str = "cpu") -> None:
        import tokenizers  # noqa: F401 -- loaded now, so a remembered input check's key has its version

        from batchinf.runtime.speech import need

        need("av")      # the decoder planning runs: likewise
        self.root, self.meta, self.device = root, meta, device
        f = meta["features"]
        self.spec = FeatureSpec(f["sample_rate"], f["n_mels"], f["hop"], f["n_fft"], f["chunk_seconds"])
        self.engine: Any = None
        self.progress_done = 0.0     # audio seconds decoded by this process (Task.progress_unit)

    @cached_property
    def tokenizer(self) -> Any:
        """The bundle's tokenizer.json (0.2 s to load Whisper's: a planning driver whose input check
        is remembered never does)."""
        import tokenizers

        return tokenizers.Tokenizer.from_file(str(self.root / "tokenizer.json"))

    def load_model(self, threads: int | None = None) -> None:
        """Load the engine with `threads` intra-op threads (default: the worker's, cores / workers)."""
        from batchinf.runtime.speech.whisper import WhisperEngine
        from batchinf.runtime.threads import worker_threads

        self.engine = WhisperEngine(self.root, self.meta, self.tokenizer, self.device, threads or worker_threads())
