"""`batchinf` command line: a thin wrapper over the library. Every command that prints a result
has --json.

`main` is the command group; `entry` runs it as the console script (`batchinf.cli:entry`) and
`python -m batchinf`. Each command module defines its
commands on its own and lists them in `COMMANDS`; they are added to `main` here, so no module
imports this one back. Library modules never import `batchinf.cli`.

| module | commands |
|---|---|
| `jobs.py` | run, submit, plan, start, retry, status, cancel, jobs, verify |
| `bundles.py` | bundle import, import-gguf, list, verify, alias |
| `db.py` | db upgrade, current, history, downgrade, check |
| `info.py` | info (where the ledger, bundle store and caches are; versions) |
| `service.py` | serve, token create, list, revoke |
| `schedules.py` | schedule add, list, pause, resume, backfill; scheduler |
| `fleet.py` | worker, controller |
| `tenants.py`, `limits.py` | tenant grant, revoke, show, limit |
| `batches.py` | files upload, list, show, download, delete; batches create, list, show, cancel |
| `dev.py` | dev cluster, down (a local cluster on loopback) |
| `common.py` | console, emit, friendly, shared options, progress bars, print_status |
"""

from __future__ import annotations

import click

from batchinf.cli import batches, bundles, db, dev, fleet, info, jobs, schedules, service, tenants
from batchinf.version import __version__

# long-running processes log at INFO by default; other commands print results and log warnings
DAEMONS = {"serve", "worker", "controller", "scheduler"}


@click.group()
@click.version_option(__version__, package_name="batchinf")
@click.option("--log-format", type=click.Choice(["text", "json"]), default=None,
              help="Log lines as text or one JSON object per line (env BATCHINF_LOG_FORMAT; default text).")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              default=None, help="Log level (env BATCHINF_LOG_LEVEL; default INFO for serve, worker, controller "
              "and scheduler, WARNING otherwise).")
@click.pass_context
def main(ctx: click.Context, log_format: str | None, log_level: str | None) -> None:
    """Durable batch inference over object storage."""
    import os

    from batchinf import config, logs

    # through the environment, so that worker processes and Celery's children log alike
    if log_format:
        os.environ["BATCHINF_LOG_FORMAT"] = log_format
    if log_level:
        os.environ["BATCHINF_LOG_LEVEL"] = log_level.upper()
    config.settings.cache_clear()
    s = config.settings()
    logs.configure(s.log_format, s.log_level or ("INFO" if ctx.invoked_subcommand in DAEMONS else "WARNING"))


for _module in (jobs, bundles, db, service, schedules, fleet, tenants, info, batches, dev):
    for _command in _module.COMMANDS:
        main.add_command(_command)


def entry() -> None:
    """Run the command, then leave without the interpreter's teardown once its exit handlers ran
    (logging flushed, child processes reaped, temporary files removed): freeing the ~85,000 objects
    its imports made (SQLAlchemy, pydantic, pyarrow) cost 0.15-0.3 s per command, the most of
    what a small `batchinf run` spent after publishing. With a non-daemon thread still running,
    it exits as Python does, which waits for it."""
    import atexit
    import os
    import sys
    import threading

    try:
        main()
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):       # closed, or a reader that went away
            pass
    os._exit(code)


__all__ = ["entry", "main"]
