"""`batchinf` command line: a thin wrapper over the library. Every command that prints a result
has --json.

`main` is the console-script entry point (`batchinf.cli:main`). Each command module defines its
commands on its own and lists them in `COMMANDS`; they are added to `main` here, so no module
imports this one back. Library modules never import `batchinf.cli`.

| module | commands |
|---|---|
| `jobs.py` | run, submit, status, cancel, jobs, verify |
| `bundles.py` | bundle import, import-gguf, list, verify, alias |
| `db.py` | db upgrade |
| `service.py` | serve, token create, list, revoke |
| `schedules.py` | schedule add, list, pause, resume, backfill; scheduler |
| `fleet.py` | worker, controller |
| `batches.py` | files upload, list, show, download, delete; batches create, list, show, cancel |
| `common.py` | console, emit, friendly, shared options, progress bars, print_status |
"""

from __future__ import annotations

import click

from batchinf.cli import batches, bundles, db, fleet, jobs, schedules, service


@click.group()
@click.version_option(package_name="batchinf")
def main() -> None:
    """Durable batch inference over object storage."""


for _module in (jobs, bundles, db, service, schedules, fleet, batches):
    for _command in _module.COMMANDS:
        main.add_command(_command)

__all__ = ["main"]
