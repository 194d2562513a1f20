"""The module import graph of a package, read from source with `ast` (nothing is imported).

Every import statement counts, at module level or inside a function (a function-local import
still ties the two modules together; it only hides the cycle until the call). A package's
`__init__.py` is a node of its own, named after the package. An edge goes to the module an
import names, not to the packages above it: `from batchinf.formats.jsonl import x` is an edge to
batchinf.formats.jsonl only (counting the parents would make every package that re-exports from
its submodules a cycle). `from pkg import name` is an edge to pkg.name when that is a module of
the package, else to pkg.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Module name -> source file for every .py file of `package` under `root`."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _statements(path: Path, module: str) -> list[tuple[str, list[str]]]:
    """Every import in the file, anywhere in it, as (absolute base, names): `import a.b` is
    ("a.b", []); `from a import b, c` is ("a", ["b", "c"]). Relative imports are resolved
    against `module`."""
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - (node.level - 1)] + ([node.module] if node.module else []))
            out.append((base, [alias.name for alias in node.names if alias.name != "*"]))
    return out


def raw_imports(path: Path, module: str) -> set[str]:
    """Absolute names of everything `path` imports: `import a.b` gives a.b; `from a import b`
    gives a and a.b (b may be a module or an attribute)."""
    return {name for base, names in _statements(path, module) for name in [base, *(f"{base}.{n}" for n in names)]}


def import_graph(root: Path, package: str = "batchinf") -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (see the module docstring for the rules)."""
    files = module_files(root, package)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets: set[str] = set()
        for base, names in _statements(path, module):
            if not names:
                targets.update({base} & files.keys())
            for name in names:
                target = f"{base}.{name}" if f"{base}.{name}" in files else base
                targets.update({target} & files.keys())
        graph[module] = targets - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: each strongly connected component of more than one module, sorted
    (Tarjan's algorithm, iterative so deep graphs do not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)
