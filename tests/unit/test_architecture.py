"""The structure drawn from the imports: who may import whom. Only `ledger/` touches SQL; status
literals live in `ledger/states.py`; layers only import downwards; `workers/` and the CLI sit on
top and nothing in the library imports them. (No import cycle: test_formats_layering.py.)"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

from batchinf.ledger.states import AttemptStatus, JobStatus, ShardStatus
from tests.helpers.docs_site import rendered
from tests.helpers.imports import ROOT, import_graph, module_files, raw_imports


def modules() -> list[tuple[str, Path]]:
    return sorted(module_files(ROOT, "batchinf").items())


def external_imports() -> dict[str, set[str]]:
    """module -> every name it imports (other packages' included)."""
    return {m: raw_imports(p, m) for m, p in modules()}

# Lowest first; a module may import its own layer or lower ones. The first matching prefix wins.
LAYERS: list[tuple[str, ...]] = [
    ("batchinf.errors", "batchinf.config", "batchinf.checks", "batchinf.failpoints", "batchinf.digests",
     "batchinf.cron", "batchinf.documents", "batchinf.version", "batchinf.logs", "batchinf.phases",
     "batchinf.openai"),   # the package itself imports nothing
    ("batchinf.store", "batchinf.planning.shard_names", "batchinf.manifest", "batchinf.manifest_rules",
     "batchinf.formats", "batchinf.runtime", "batchinf.retry_policy", "batchinf.openai.lines", "batchinf.tasks",
     "batchinf.engines"),
    ("batchinf.parts", "batchinf.openai.output"),
    ("batchinf.ledger",),
    ("batchinf.bundles", "batchinf.tenants", "batchinf.scopes", "batchinf.limits", "batchinf.submit", "batchinf.planning.pin",
     "batchinf.metrics", "batchinf.openai.batches", "batchinf.rerun", "batchinf.heartbeat", "batchinf.lanes"),
    ("batchinf.planning.summary", "batchinf.planning.ranges", "batchinf.planning.bucketing", "batchinf.planning.sizing",
     "batchinf.planning.context"),
    ("batchinf.assembly",),
    ("batchinf.planning.stage", "batchinf.planning.finish", "batchinf.planning", "batchinf.execute",
     "batchinf.verify", "batchinf.schedules"),
    ("batchinf.quarantine", "batchinf.dispatch"),
    ("batchinf.lifecycle",),
    ("batchinf.controller", "batchinf.dryrun", "batchinf.dev_cluster"),
    ("batchinf.api", "batchinf.openai.routes", "batchinf.openai.schemas"),
    ("batchinf.cli", "batchinf.__main__", "batchinf.workers"),
]


def layer(module: str) -> int:
    if module == "batchinf":          # the package itself: on top
        return len(LAYERS) - 1
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def test_layers_only_import_downwards() -> None:
    graph = import_graph(ROOT)
    upward = sorted(f"{a} ({layer(a)}) imports {b} ({layer(b)})"
                    for a, targets in graph.items() for b in targets if layer(b) > layer(a))
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_only_the_ledger_runs_sql() -> None:
    """Outside ledger/ nothing imports the tables or SQLAlchemy (its exception classes aside) or
    opens a ledger transaction: the ledger's repositories are the only way in."""
    offenders = sorted(f"{a} imports {b}" for a, targets in external_imports().items()
                       if not a.startswith("batchinf.ledger")
                       for b in targets
                       if b.startswith(("batchinf.ledger.tables", "sqlalchemy")) and not b.startswith("sqlalchemy.exc"))
    offenders += sorted(f"{m}:{node.lineno} opens a ledger transaction" for m, path in modules()
                        if not m.startswith("batchinf.ledger") for node in ast.walk(ast.parse(path.read_text()))
                        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "tx")
    assert not offenders, "SQL outside ledger/:\n" + "\n".join(offenders)


def test_library_never_imports_workers_cli_or_tests() -> None:
    graph = external_imports()
    bad = sorted(f"{a} imports {b}" for a, targets in graph.items()
                 if a.startswith("batchinf") and not a.startswith(("batchinf.cli", "batchinf.__main__"))
                 for b in targets if b.split(".")[0] in ("workers", "migrations", "tests")
                 or b.startswith(("batchinf.cli", "batchinf.workers")))
    assert not bad, "\n".join(bad)


STATUS_WORDS = {s.value for enum in (JobStatus, ShardStatus, AttemptStatus) for s in enum}


def test_status_literals_live_in_states() -> None:
    """No module outside ledger/states.py compares a status against a string literal."""
    found = []
    for module, path in modules():
        if module == "batchinf.ledger.states":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                consts = [c for c in [node.left, *node.comparators] if isinstance(c, (ast.Tuple, ast.List, ast.Set))]
                values = [e for c in consts for e in c.elts] + [node.left, *node.comparators]
                hits = {v.value for v in values if isinstance(v, ast.Constant) and v.value in STATUS_WORDS}
                if hits:
                    found.append(f"{module}:{node.lineno} compares with {sorted(hits)}")
    assert not found, "\n".join(found)


def test_no_module_is_too_long() -> None:
    """A module does one thing its name says; length is only a hint: past ~600 lines a warning asks
    whether it does two, past 900 it surely does."""
    sizes = {m: len(p.read_text().splitlines()) for m, p in modules()}
    for m, n in sorted(sizes.items()):
        if n > 600:
            warnings.warn(f"{m} is {n} lines: does it do two things?", stacklevel=1)
    too_long = [f"{m}: {n} lines" for m, n in sizes.items() if n > 900]
    assert not too_long, "\n".join(too_long)


def test_nothing_refers_to_documents_outside_the_repository() -> None:
    refs = [str(p.relative_to(ROOT)) for p in (*ROOT.glob("batchinf/**/*.py"), *ROOT.glob("workers/*.py"),
                                                *ROOT.glob("manifests/**/*"))
            if p.is_file() and "DESIGN.md" in p.read_text(errors="replace")]
    assert not refs, f"these cite DESIGN.md, which is not in the repository: {refs}"


def test_the_architecture_page_names_every_module() -> None:
    """docs/architecture.md as the docs build renders it (its module map is generated)."""
    section = rendered("architecture.md")
    missing = [m for m, p in modules() if m.startswith("batchinf.") and m.count(".") == 1
               and Path(p).name not in ("__init__.py", "__main__.py") and f"`{m.split('.')[1]}" not in section]
    assert not missing, f"the architecture page does not mention: {missing}"


# --- choke points: every job is created by `submit.submit` for a stated caller; every read of a
# tenant-named object passes a grant-scoped `scopes.Storage` -------------------------------------

def _calls(path: Path, name: str) -> list[int]:
    """Lines of `path` that call `name` (a bare or attribute name)."""
    tree = ast.parse(path.read_text())
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
            and ((isinstance(n.func, ast.Name) and n.func.id == name)
                 or (isinstance(n.func, ast.Attribute) and n.func.attr == name))]


def test_jobs_are_created_only_by_submit() -> None:
    creators = sorted(m for m, p in modules() if m != "batchinf.ledger.jobs"
                      and any(isinstance(n, ast.Attribute) and n.attr == "create" and isinstance(n.value, ast.Name)
                              and n.value.id in ("job_repo", "jobs") for n in ast.walk(ast.parse(p.read_text()))))
    assert creators == ["batchinf.submit"], creators


def test_submit_has_no_default_caller_and_the_api_is_never_the_operator() -> None:
    import inspect

    from batchinf.scopes import Caller
    from batchinf.submit import submit

    param = inspect.signature(submit).parameters["caller"]
    assert param.default is inspect.Parameter.empty and param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert Caller("t").confined     # a tenant's request is confined with or without grants (no ledger read)
    for m, p in modules():
        if m.startswith(("batchinf.api", "batchinf.openai.batches")):
            assert "operator=True" not in p.read_text(), f"{m} creates a job as the operator"


# Modules that open storage themselves, and why that reads nothing a tenant names unchecked. A new
# one belongs here only with a reason; tenant-named objects are read through `scopes.Storage`.
STORE_USERS = {
    "batchinf.scopes": "Storage itself",
    "batchinf.submit": "the output prefix's _SUCCESS, after the grant check",
    "batchinf.planning.stage": "pinned objects (checked when pinned) and the job's work files",
    "batchinf.planning.finish": "the job's work files",
    "batchinf.planning.ranges": "pinned objects, checked when pinned",
    "batchinf.planning.summary": "the job's work files",
    "batchinf.execute": "pinned objects and the job's work files",
    "batchinf.verify": "the job's work files and output",
    "batchinf.lifecycle": "the job's work files",
    "batchinf.parts": "the job's work files and output",
    "batchinf.openai.output": "the job's output",
    "batchinf.rerun": "the old job's output (its lineage files)",
    "batchinf.openai.batches": "the tenant's own space in the files store",
    "batchinf.bundles": "the operator's bundle store",
    "batchinf.limits": "the operator's bundle store",
    "batchinf.tasks.objects": "image and audio URIs a record names, each passed to the job's Storage check first",
    "batchinf.store": "the stores",
}


def test_only_known_modules_open_storage() -> None:
    users = {m for m, p in modules() if _calls(p, "get_store")}
    assert users <= set(STORE_USERS), f"open storage through scopes.Storage, or add a reason: {sorted(users - set(STORE_USERS))}"
