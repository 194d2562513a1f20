"""The test suite's own rules, read from its source with `ast`:

* shared code lives in tests/helpers: no module imports a test module (tests.<dir>.test_*) or a
  conftest, so nothing private of a conftest (`_free_port`, `_unavailable`...) is imported either;
* conftest.py files only define fixtures and pytest hooks (which delegate to helpers);
* one definition of free_port, unavailable and the process-state reset;
* each directory's marker is set by every module in it (integration, chaos, parity);
* no module imports a service client or reference implementation at top level, and the unit
  session's imports contain none.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.helpers.isolation import FORBIDDEN_MODULES, forbidden_imported, session_imports

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SOURCES = sorted(TESTS.rglob("*.py"))
DIRECTORY_MARKERS = {"integration": "integration", "chaos": "chaos", "parity": "parity"}


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, names) of every import in `path`, relative ones resolved."""
    package = _module_name(path).rsplit(".", 1)[0]
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            out.append((node.lineno, module, [alias.name for alias in node.names]))
    return out


def _is_test_module(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "tests" and (parts[-1].startswith("test_") or parts[-1] == "conftest")


def test_no_module_imports_a_test_module_or_a_conftest() -> None:
    bad = []
    for path in SOURCES:
        for line, module, names in _imports(path):
            targets = [module] + [f"{module}.{n}" for n in names]
            if any(_is_test_module(t) for t in targets) or module == "conftest":
                bad.append(f"{path.relative_to(REPO)}:{line} imports from {module} {names or ''}")
    assert not bad, "move what is shared to tests/helpers:\n" + "\n".join(bad)


def test_conftests_define_only_fixtures_and_hooks() -> None:
    bad = []
    for path in TESTS.rglob("conftest.py"):
        for node in _tree(path).body:
            if isinstance(node, ast.ClassDef):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} class {node.name}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
                if not fixture and not node.name.startswith("pytest_"):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno} def {node.name}")
    assert not bad, "a conftest defines fixtures and hooks only; helpers go to tests/helpers:\n" + "\n".join(bad)


@pytest.mark.parametrize("names, home", [
    ({"free_port", "_free_port"}, "tests/helpers/services.py"),
    ({"unavailable", "_unavailable"}, "tests/helpers/services.py"),
    ({"reset_process_state", "_reset_process_state"}, "tests/helpers/env.py"),
], ids=["free_port", "unavailable", "reset_process_state"])
def test_shared_helpers_are_defined_once(names: set[str], home: str) -> None:
    found = [f"{path.relative_to(REPO)}:{node.lineno}" for path in SOURCES
             for node in ast.walk(_tree(path))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names]
    assert len(found) == 1 and found[0].startswith(home + ":"), found


@pytest.mark.parametrize("directory", sorted(DIRECTORY_MARKERS))
def test_every_module_carries_its_directory_marker(directory: str) -> None:
    marker = DIRECTORY_MARKERS[directory]
    modules = sorted((TESTS / directory).glob("test_*.py"))
    assert modules, f"tests/{directory} has no test module"
    missing = []
    for path in modules:
        marks = [ast.unparse(node.value) for node in _tree(path).body
                 if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)]
        if not any(f"pytest.mark.{marker}" in m for m in marks):
            missing.append(str(path.relative_to(REPO)))
    assert not missing, f"these modules lack `pytestmark = pytest.mark.{marker}`: {missing}"


def test_no_module_imports_a_reference_or_service_client_at_top_level() -> None:
    """Test modules import transformers, gguf, psycopg... inside the tests that need them, so that
    collecting any part of the suite stays light and the unit session's imports stay clean."""
    bad = []
    for path in SOURCES:
        for node in _tree(path).body:       # module level only: imports inside tests run later
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad += [f"{path.relative_to(REPO)}:{node.lineno} {m}" for m in mods
                        if m.partition(".")[0] in FORBIDDEN_MODULES]
    assert not bad, bad


def test_the_unit_session_imports_no_transformers(pytestconfig: pytest.Config) -> None:
    """After the session's imports (conftests, helpers and every collected test module: with
    `pytest tests/unit`, all of the unit suite), neither transformers nor any other service client
    or reference implementation is in sys.modules. Importing one from a unit module already fails
    its collection (tests/unit/conftest.py); this is the check at the end."""
    imported = session_imports(pytestconfig)
    assert "transformers" not in imported
    assert forbidden_imported(imported) == []
