"""Layering of batchinf, read from the source with `ast`: the module import graph (function-local
imports included) has no cycle, the input formats and the OpenAI output renderer stay apart, and
the rest of the layering is in test_architecture.py."""

from __future__ import annotations

from tests.helpers.imports import ROOT, cycles, import_graph
# The input-format and part-file layer: no import cycle may pass through any of these modules.
LAYER = ("batchinf.formats", "batchinf.openai.output", "batchinf.parts", "batchinf.digests",
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
    assert "batchinf.formats.record" in graph["batchinf.openai.lines"]
    assert "batchinf.runtime.tokenizer" in graph["batchinf.tasks.embed"]   # imported inside a function


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
        assert not _in_any(_reachable(graph, m), ("batchinf.openai.output", "batchinf.parts")), m
    assert not _in_any(_reachable(graph, "batchinf.openai.output"), ("batchinf.formats",))
    assert graph["batchinf.digests"] == set()


def test_the_whole_package_has_no_import_cycle() -> None:
    found = cycles(import_graph(ROOT))
    assert not found, "import cycles in batchinf:\n" + "\n".join(" <-> ".join(c) for c in found)
