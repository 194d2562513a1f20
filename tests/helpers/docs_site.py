"""The documentation site's build hook (docs/hooks.py), loaded by path: what a page looks like once
its generated sections are rendered, as `mkdocs build` renders them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("batchinf_docs_hooks", DOCS / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rendered(page: str) -> str:
    """docs/<page> with its `<!-- generated: ... -->` sections rendered."""
    return hooks().render((DOCS / page).read_text())
