"""The project's import graph, read from the source with `ast` (function-local imports included)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("batchinf", "workers")


def modules() -> Iterator[tuple[str, Path]]:
    """(dotted name, path) of every module of the library and of workers/."""
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: resolve against this module's package
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            for a in node.names:   # `from pkg import module` names the module itself
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return out


def import_graph(*, external: bool = False) -> dict[str, set[str]]:
    """module -> the modules it imports: the project's own, or with `external` every import."""
    mods = dict(modules())
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        targets = _imported(name, path, known) - {name}
        graph[name] = targets if external else {t for t in targets if t in known}
    return graph
