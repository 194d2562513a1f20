"""The CLI's surface, through click's CliRunner and `main` only: every command exists under its
name, every command that prints a result has --json, help works everywhere, deliberate errors are
one line with exit 2, and the CLI stays a layer on top (light to import, never imported by the
library). No services, no models: the error cases use an embedded SQLite ledger at most."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from batchinf.cli import main
from batchinf.version import __version__

ROOT = Path(__file__).resolve().parents[2]

TREE: dict[str, set[str]] = {
    "": {"run", "submit", "plan", "start", "retry", "status", "cancel", "jobs", "verify", "bundle", "db", "serve",
         "token", "schedule",
         "scheduler", "worker", "controller", "tenant", "info", "files", "batches", "dev"},
    "dev": {"cluster", "down"},
    "files": {"upload", "list", "show", "download", "delete"},
    "batches": {"create", "list", "show", "cancel"},
    "bundle": {"import", "import-gguf", "list", "verify", "alias"},
    "db": {"upgrade", "current", "history", "downgrade", "check"},
    "token": {"create", "list", "revoke"},
    "schedule": {"add", "list", "pause", "resume", "backfill"},
    "tenant": {"grant", "revoke", "show", "limit"},
}
# long-running processes: they print logs, not a result
NO_RESULT = {"serve", "worker", "controller"}


def _commands(group: click.Group = main, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    out: list[tuple[tuple[str, ...], click.Command]] = [(path, group)]
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            out += _commands(cmd, path + (name,))
        else:
            out.append((path + (name,), cmd))
    return out


ALL = _commands()
GROUPS = [p for p, c in ALL if isinstance(c, click.Group)]
LEAVES = [p for p, c in ALL if not isinstance(c, click.Group)]


def test_command_tree() -> None:
    groups = {" ".join(p): set(c.commands) for p, c in ALL if isinstance(c, click.Group)}
    assert groups == TREE
    for path, cmd in ALL[1:]:
        assert cmd.name == path[-1]


@pytest.mark.parametrize("path", LEAVES, ids=" ".join)
def test_result_commands_have_json(path: tuple[str, ...]) -> None:
    cmd = dict(ALL)[path]
    opts = {o: p for p in cmd.params for o in p.opts}
    if " ".join(path) in NO_RESULT:
        assert "--json" not in opts
        return
    assert "--json" in opts, f"{' '.join(path)} prints a result but has no --json"
    flag = opts["--json"]
    assert isinstance(flag, click.Option) and flag.is_flag and flag.name == "as_json"
    assert flag.help and flag.help.strip()


@pytest.mark.parametrize("path", [p for p, _ in ALL], ids=lambda p: " ".join(p) or "batchinf")
def test_help_exits_0(path: tuple[str, ...]) -> None:
    r = CliRunner().invoke(main, [*path, "--help"])
    assert r.exit_code == 0, r.output
    assert "Usage:" in r.stdout


@pytest.mark.parametrize("module", ["batchinf", "batchinf.cli"])
def test_python_dash_m(module: str) -> None:
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"python -m {module}" in r.stdout and "schedule" in r.stdout


def _assert_one_error_line(r: Result, expect: str) -> None:
    assert r.exit_code == 2, r.output
    assert isinstance(r.exception, SystemExit)
    assert r.stdout == ""
    assert "Traceback" not in r.output
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and expect in err


def test_batchinf_error_is_one_line_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.errors import LedgerError
    from batchinf.ledger import db

    def boom(*_: object, **__: object) -> str:
        raise LedgerError("the ledger said no; run `batchinf db upgrade` elsewhere")

    monkeypatch.setattr(db, "upgrade", boom)
    _assert_one_error_line(CliRunner().invoke(main, ["db", "upgrade", "--json"]), "the ledger said no")


@pytest.mark.parametrize("args, expect", [
    (["status", "job-nope", "--json"], "no job 'job-nope'"),
    (["cancel", "job-nope"], "no job 'job-nope'"),
    (["schedule", "pause", "nope"], "no schedule 'nope'"),
    (["schedule", "backfill", "nope", "--from", "2026-01-01", "--to", "2026-01-02"], "no schedule 'nope'"),
    (["token", "revoke", "tok-nope", "--json"], "no token 'tok-nope'"),
])
def test_real_errors_are_one_line_exit_2(bi_home: Path, args: list[str], expect: str) -> None:
    _assert_one_error_line(CliRunner().invoke(main, args), expect)


def test_json_result_on_stdout(bi_home: Path) -> None:
    r = CliRunner().invoke(main, ["schedule", "list", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == []


def test_import_stays_light() -> None:
    """`batchinf --help` must not pay for torch, pyarrow, SQLAlchemy, FastAPI or Celery."""
    heavy = ["torch", "pyarrow", "numpy", "sqlalchemy", "fastapi", "celery", "uvicorn", "batchinf.workers"]
    code = ("import sys, batchinf.cli; "
            f"print(','.join(m for m in {heavy!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""


def _imported_modules(tree: ast.AST, package: list[str]) -> list[str]:
    """Every module an import statement names, relative imports resolved against `package`."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + [f"{module}.{a.name}" for a in node.names]
    return names


def test_library_never_imports_cli() -> None:
    offenders = []
    for path in sorted((ROOT / "batchinf").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("batchinf", "cli") or rel.as_posix() == "batchinf/__main__.py":
            continue
        package = list(rel.parent.parts)
        offenders += [f"{rel}: {n}" for n in _imported_modules(ast.parse(path.read_text()), package)
                      if n == "batchinf.cli" or n.startswith("batchinf.cli.")]
    assert offenders == []


@pytest.mark.parametrize("ref", ["minilm@prod", "sha256:" + "ab" * 32])
def test_status_names_the_bundle_and_its_digest_once(ref: str, capsys: pytest.CaptureFixture[str]) -> None:
    from batchinf.cli.common import print_status

    digest = "sha256:" + "ab" * 32
    print_status({"job_id": "job-1", "name": "n", "status": "running", "bundle": ref, "bundle_digest": digest,
                  "output_uri": "file:///o/", "counts": {"records_succeeded": 1, "records_failed": 0,
                                                         "records_total": 2},
                  "shards": {"committed": 1, "total": 2, "running": 1, "pending": 0}})
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("bundle"))
    assert line.count(digest) == 1 and ref in line


def test_status_prints_a_transcribe_jobs_audio_in_hours(capsys: pytest.CaptureFixture[str]) -> None:
    from batchinf.cli.common import print_status

    print_status({"job_id": "job-1", "name": "n", "status": "running", "bundle": "w", "bundle_digest": "w",
                  "output_uri": "file:///o/", "counts": {"records_succeeded": 1, "records_failed": 0,
                                                         "records_total": 2},
                  "shards": {"committed": 1, "total": 2, "running": 1, "pending": 0},
                  "progress": {"audio_seconds_done": 1800, "audio_seconds_planned": 7200,
                               "audio_seconds_per_second": 42.0, "steps_planned": None}})
    out = capsys.readouterr().out
    assert "audio    0.50 of 2.00 hours, 42.0 audio-seconds/s" in out and "steps" not in out


@pytest.mark.parametrize("argv, code", [(["--version"], 0), (["no-such-command"], 2)])
def test_the_console_entry_runs_exit_handlers_flushes_and_keeps_the_exit_code(argv: list[str], code: int,
                                                                                tmp_path: Path) -> None:
    """`entry` (the console script, `python -m batchinf`) leaves without the interpreter's teardown:
    the exit handlers still run, what was printed is all there, and the exit code is the command's."""
    program = ("import atexit, sys\n"
               "atexit.register(lambda: print('handlers ran', file=sys.stderr))\n"
               f"sys.argv = ['batchinf', *{argv!r}]\n"
               "print('x' * 200000, end='')\n"
               "from batchinf.cli import entry\n"
               "entry()\n")
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "BATCHINF_HOME": str(tmp_path)}, timeout=120)
    assert r.returncode == code, r.stderr
    assert r.stdout.startswith("x" * 200000)
    assert r.stderr.rstrip().endswith("handlers ran")
    if code == 0:
        assert r.stdout[200000:].strip().endswith(__version__)
    else:
        assert "No such command" in r.stderr
