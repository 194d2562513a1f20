"""Distributed-mode processes: `worker` (Celery) and `controller`."""

from __future__ import annotations

import click

from batchinf.cli.common import friendly, metrics_port_option


@click.command("worker")
@click.option("--concurrency", default=1, show_default=True, help="Worker processes.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--threads", type=int, default=None, help="Torch threads per process (default: cores / concurrency).")
@metrics_port_option
@friendly
def worker(concurrency: int, device: str, threads: int | None, metrics_port: int | None) -> None:
    """A Celery worker (distributed mode). Its processes keep loaded bundles cached by digest."""
    import os

    from batchinf.bundles import require_device

    require_device(device)      # a worker without CUDA never starts as a cuda worker
    if metrics_port:
        import tempfile

        # before prometheus_client is first imported, so that forked children share the counters
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="batchinf-metrics-")
        from batchinf import metrics

        metrics.serve(metrics_port)
    os.environ["BATCHINF_DEVICE"] = device
    os.environ.setdefault("OMP_NUM_THREADS", str(threads or max(1, (os.cpu_count() or 1) // concurrency)))
    from workers.celery_app import QUEUE, app

    app.worker_main(["worker", "--concurrency", str(concurrency), "--pool", "prefork", "-Q", QUEUE,
                     "--loglevel", "INFO", "--without-gossip", "--without-mingle",
                     "-n", f"batchinf-{os.getpid()}@%h"])


@click.command("controller")
@click.option("--max-in-flight", default=16, show_default=True,
              help="Shards queued or running across all jobs; free slots go by priority, deadline, then round-robin.")
@click.option("--requeue-seconds", default=30.0, show_default=True,
              help="Send a queued shard's message again after this long (lost messages).")
@click.option("--tick", default=1.0, show_default=True, help="Seconds between passes over the ledger.")
@metrics_port_option
@friendly
def controller(max_in_flight: int, requeue_seconds: float, tick: float, metrics_port: int | None) -> None:
    """Plan, dispatch, recover and publish every job in the ledger (distributed mode). Restartable;
    several may run at once."""
    import logging
    import signal
    import threading

    from batchinf.controller import Controller

    if metrics_port:
        from batchinf import metrics

        metrics.serve(metrics_port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    from workers.celery_app import CeleryDispatcher

    Controller(CeleryDispatcher(requeue_seconds), max_in_flight=max_in_flight, tick_seconds=tick).run_forever(stop)


COMMANDS = [worker, controller]
