"""Speech runtime (task transcribe): audio decoding (`audio`), log-mel features (`features`),
windows at silence (`windows`), the CTranslate2 Whisper engine (`whisper`, its model file read
by `ct2_file`), segments stitched into transcripts (`segments`), short files sharing windows
(`packing`), a long file's windows in pieces and its transcript stitched back from them
(`pieces`) and the opened bundle (`runtime`). Only `whisper` needs CTranslate2: planning decodes
and windows audio without it."""

from __future__ import annotations

import importlib
from types import ModuleType

from batchinf.errors import BundleError


def need(module: str) -> ModuleType:
    """Import a package of the speech extra, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BundleError(f"task transcribe needs {module} ({exc}); install the speech extra: "
                          "pip install 'batchinf[speech]'") from None
