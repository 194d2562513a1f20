"""Layering of batchinf, read from the source with `ast`: the module import graph (function-local
imports included) has no cycle, the input formats and the OpenAI output renderer stay apart, and
nothing in the package imports the workers or the tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.imports import cycles, import_graph, module_files, raw_imports

ROOT = Path(__file__).resolve().parents[2]
# The input-format and part-file layer: no import cycle may pass through any of these modules.
LAYER = ("batchinf.formats", "batchinf.openai_output", "batchinf.parts", "batchinf.digests",
         "batchinf.store", "batchinf.checks")


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _in_any(modules: set[str], prefixes: tuple[str, ...]) -> bool:
    return any(_in(m, prefixes) for m in modules)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_local_imports() -> None:
    graph = import_graph(ROOT)
    assert "batchinf.formats.jsonl" in graph["batchinf.formats"]
    assert "batchinf.formats.record" in graph["batchinf.formats.openai_batch"]
    assert "batchinf.runtime.tokenizer" in graph["batchinf.plan"]        # imported inside a function


def test_no_import_cycle_passes_through_the_formats_layer() -> None:
    graph = import_graph(ROOT)
    assert any(_in(m, LAYER) for m in graph)
    bad = [c for c in cycles(graph) if any(_in(m, LAYER) for m in c)]
    assert not bad, "import cycles through the formats layer:\n" + "\n".join(" <-> ".join(c) for c in bad)


def test_formats_and_openai_output_stay_apart() -> None:
    """Reading input never needs the output renderer, and rendering output never needs a reader."""
    graph = import_graph(ROOT)
    formats = [m for m in graph if _in(m, ("batchinf.formats",))]
    for m in formats:
        assert not _in_any(_reachable(graph, m), ("batchinf.openai_output", "batchinf.parts")), m
    assert not _in_any(_reachable(graph, "batchinf.openai_output"), ("batchinf.formats",))
    assert graph["batchinf.digests"] == set()


def test_the_whole_package_has_no_import_cycle() -> None:
    found = cycles(import_graph(ROOT))
    assert not found, "import cycles in batchinf:\n" + "\n".join(" <-> ".join(c) for c in found)


# Present when this test was written, outside the formats layer: the Celery app is started from
# inside the package (function-local imports), while workers/celery_app.py imports batchinf.
KNOWN_WORKERS_IMPORTS = {"batchinf.cli imports workers.celery_app", "batchinf.controller imports workers.celery_app"}


def _workers_or_tests_imports() -> list[str]:
    """'<module> imports <name>' for each module of workers or tests imported under batchinf/
    (the most specific one: `from workers import celery_app` is workers.celery_app)."""
    found = set()
    for module, path in module_files(ROOT, "batchinf").items():
        mods = {n for n in raw_imports(path, module) if n.split(".")[0] in ("workers", "tests") and _is_module(n)}
        found.update(f"{module} imports {n}" for n in mods if not any(o.startswith(n + ".") for o in mods))
    return sorted(found)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_no_new_imports_of_workers_or_tests_in_batchinf() -> None:
    """A ratchet: nothing beyond the known imports, and none at all in the formats layer."""
    found = _workers_or_tests_imports()
    new = [f for f in found if f not in KNOWN_WORKERS_IMPORTS]
    assert not new, "batchinf must not import workers or tests:\n" + "\n".join(new)
    assert not [f for f in found if _in(f.split()[0], LAYER)]


@pytest.mark.xfail(strict=False, reason="pre-existing, outside the formats refactor: " +
                   "; ".join(sorted(KNOWN_WORKERS_IMPORTS)) + " (function-local, to start Celery)")
def test_nothing_in_batchinf_imports_workers_or_tests() -> None:
    found = _workers_or_tests_imports()
    assert not found, "batchinf must not import workers or tests:\n" + "\n".join(found)
