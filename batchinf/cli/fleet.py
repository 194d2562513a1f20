"""Distributed-mode processes: `worker` (Celery) and `controller`."""

from __future__ import annotations

import click

from batchinf.cli.common import friendly, metrics_port_option
from batchinf.errors import BatchinfError


def refuse_embedded(what: str) -> None:
    """A Celery controller or worker needs a shared ledger and broker; on SQLite nothing would run."""
    from batchinf.config import settings

    if settings().embedded:
        raise BatchinfError(f"`batchinf {what}` is for distributed mode, and the ledger is the embedded SQLite "
                            f"database ({settings().database_url}). Run `batchinf serve` (it runs the jobs on "
                            "this machine) or `batchinf run MANIFEST`; for a cluster set "
                            "BATCHINF_DATABASE_URL=postgresql://... and BATCHINF_BROKER_URL")


@click.command("worker", context_settings={"ignore_unknown_options": True})
@click.option("--concurrency", default=1, show_default=True, help="Worker processes.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="The device this worker runs shards on (auto: cuda when this host has it): it reads the queues "
              "of jobs that need it or any, and claims only their shards.")
@click.option("--threads", type=int, default=None, help="Torch threads per process (default: cores / concurrency).")
@click.option("--engine", "engines", multiple=True, type=click.Choice(["native", "vllm", "openai-http", "onnxruntime"]),
              help="An engine this worker has (repeat for several; default native, and onnxruntime where "
              "installed): it reads their queues and claims only their jobs' shards. Refused when the engine's "
              "package is missing.")
@click.option("--hostname", "-n", default="batchinf@%h", show_default=True,
              help="The Celery node name, stable across restarts (%h: this host). Several workers on one host "
              "need one name each, e.g. batchinf-2@%h.")
@metrics_port_option
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
@friendly
def worker(concurrency: int, device: str, threads: int | None, engines: tuple[str, ...], hostname: str,
           metrics_port: int | None, celery_args: tuple[str, ...]) -> None:
    """A Celery worker (distributed mode). Its processes keep loaded bundles cached by digest.
    Options after `--` go to `celery worker` as they are, e.g. `batchinf worker -- --autoscale=4,1
    --max-tasks-per-child=50`."""
    import os

    from batchinf.bundles import require_device
    from batchinf.config import settings

    require_device(device)      # a worker without CUDA never starts as a cuda worker
    from batchinf.engines import require

    engines = require(engines)  # a worker without vllm never starts as a vllm worker
    refuse_embedded("worker")

    if metrics_port:
        import tempfile

        # before prometheus_client is first imported, so that forked children share the counters
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="batchinf-metrics-")
        settings.cache_clear()      # `batchinf` (the group) loaded the settings before this variable was set
        from batchinf import metrics

        metrics.serve(metrics_port)
    from batchinf.dispatch import pick_device       # after the metrics' setup: it imports prometheus_client

    device = pick_device(device)  # resolved now: it names the queues this worker reads
    os.environ["BATCHINF_DEVICE"] = device
    os.environ["BATCHINF_ENGINES"] = ",".join(engines)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads or max(1, (os.cpu_count() or 1) // concurrency)))
    from batchinf.config import settings

    settings.cache_clear()            # the variables just set reach this process's settings too
    from batchinf.workers.celery_app import app, engine_queues, plan_queue

    queues = ",".join([*engine_queues(engines, device), plan_queue()])
    app.worker_main(["worker", "--concurrency", str(concurrency), "--pool", "prefork", "-Q", queues,
                     "--loglevel", settings().log_level or "INFO", "--without-gossip", "--without-mingle",
                     "-n", hostname, *celery_args])


@click.command("controller")
@click.option("--max-in-flight", default=16, show_default=True,
              help="Shards queued or running across all jobs, at most the queue's worker processes plus "
              "BATCHINF_DISPATCH_AHEAD; free slots go by priority, deadline, then round-robin.")
@click.option("--requeue-seconds", default=30.0, show_default=True,
              help="Send a queued shard's message again after this long (lost messages).")
@click.option("--tick", default=1.0, show_default=True, help="Seconds between passes over the ledger.")
@metrics_port_option
@friendly
def controller(max_in_flight: int, requeue_seconds: float, tick: float, metrics_port: int | None) -> None:
    """Plan, dispatch, recover and publish every job in the ledger (distributed mode). Restartable;
    several may run at once."""
    import signal
    import threading

    from batchinf.controller import Controller

    refuse_embedded("controller")

    if metrics_port:
        from batchinf import metrics

        metrics.serve(metrics_port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    from batchinf.workers.celery_app import CeleryDispatcher

    Controller(CeleryDispatcher(requeue_seconds), max_in_flight=max_in_flight, tick_seconds=tick).run_forever(stop)


COMMANDS = [worker, controller]
