"""Prometheus metrics.

Two kinds:
- process metrics (counters and histograms of this process), fed by one-line hooks in execute.py,
  dispatch.py and controller.py and served by `--metrics-port` on workers and controllers; a
  Celery worker's forked children share them through prometheus_client's multiprocess mode;
- ledger metrics, computed from the ledger at scrape time by `LedgerCollector` (the API's
  `/metrics`): the same numbers whichever process serves them, per job and per bundle.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from batchinf.version import __version__
from batchinf.config import settings
from batchinf.ledger.states import SHARD_WAITING, JobStatus, ShardStatus, values

WAITING = values(SHARD_WAITING)
disable_created_metrics()   # *_created samples only add noise to every counter

__all__ = ["CONTENT_TYPE_LATEST", "LedgerCollector", "exposition"]

SHARD_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

RECORDS = Counter("batchinf_worker_records", "Records in shards this process committed",
                  ["bundle_id", "outcome"])
REAL_TOKENS = Counter("batchinf_worker_real_tokens", "Record token positions this process computed", ["bundle_id"])
PADDED_TOKENS = Counter("batchinf_worker_padded_tokens", "Token positions this process computed, padding "
                        "included (real tokens are part of them)", ["bundle_id"])
STEPS = Counter("batchinf_worker_denoising_steps", "Denoising steps x images of the records in shards this "
                "process committed (generate_image)", ["bundle_id"])
AUDIO_SECONDS = Counter("batchinf_worker_audio_seconds", "Seconds of audio in shards this process committed "
                        "(transcribe; each file or piece in whole seconds)", ["bundle_id"])
# a task's progress unit (Task.progress_unit) -> the counter of it
PROGRESS = {"steps": STEPS, "audio_seconds": AUDIO_SECONDS}
SHARD_SECONDS = Histogram("batchinf_worker_shard_duration_seconds", "Wall time of committed shards",
                          ["bundle_id"], buckets=SHARD_BUCKETS)
ATTEMPTS_ENDED = Counter("batchinf_worker_attempts_ended", "Shard attempts that ended without "
                         "committing", ["reason"])
LEASES_EXPIRED = Counter("batchinf_controller_leases_expired", "Shard leases this controller expired")
SHARDS_SENT = Counter("batchinf_controller_shards_sent", "Shard messages sent to workers "
                      "(fresh: newly queued, resend: message possibly lost)", ["kind"])
SCHEDULED = Counter("batchinf_scheduler_jobs_submitted", "Jobs this scheduler created", ["schedule"])
HTTP_REQUESTS = Counter("batchinf_api_requests", "API requests", ["method", "route", "status"])
HTTP_SECONDS = Histogram("batchinf_api_request_duration_seconds", "API request latency",
                         ["method", "route"])
BUILD = Info("batchinf_build", "The running batchinf's version (value 1)")
BUILD.info({"version": __version__, "python": platform.python_version()})


def bundle_id(digest: str) -> str:
    """The short label for a bundle digest: its first 12 hex digits (the digest itself appears only
    in batchinf_bundle_info and batchinf_job_info)."""
    return digest.removeprefix("sha256:")[:12]


# --- hooks: each called from one line elsewhere --------------------------------------------------


def shard_committed(bundle: str, result: Any, progress_unit: str | None = None) -> None:
    """execute.py, after a fenced commit succeeded (`result` is an ops.ShardResult; `progress_unit`
    the task's, that `result.progress` counts)."""
    b = bundle_id(bundle)
    RECORDS.labels(b, "succeeded").inc(result.output_rows)
    RECORDS.labels(b, "failed").inc(result.error_rows)
    REAL_TOKENS.labels(b).inc(result.tokens_real)
    PADDED_TOKENS.labels(b).inc(result.tokens_padded)
    if progress_unit and result.progress:
        PROGRESS[progress_unit].labels(b).inc(result.progress)
    SHARD_SECONDS.labels(b).observe(result.execute_seconds)


def attempt_ended(reason: str) -> None:
    """dispatch.py: an attempt raised (`error`), lost its lease (`stale`), met a bad `bundle` or gave
    its lease back because its job stopped (`released`)."""
    ATTEMPTS_ENDED.labels(reason).inc()


def leases_expired(n: int) -> int:
    """controller.py: wraps ops.expire_leases and passes its count through."""
    LEASES_EXPIRED.inc(n)
    return n


def shards_sent(fresh: int, resend: int) -> None:
    SHARDS_SENT.labels("fresh").inc(fresh)
    SHARDS_SENT.labels("resend").inc(resend)


def job_scheduled(schedule: str) -> None:
    SCHEDULED.labels(schedule).inc()


def observe_request(method: str, route: str, status: int, seconds: float) -> None:
    HTTP_REQUESTS.labels(method, route, str(status)).inc()
    HTTP_SECONDS.labels(method, route).observe(seconds)


# --- serving process metrics ---------------------------------------------------------------------


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Expose this process's metrics (all forked children's too in multiprocess mode)."""
    if settings().prometheus_multiproc_dir:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        start_http_server(port, addr=addr, registry=registry)
    else:
        start_http_server(port, addr=addr)


# --- ledger metrics ------------------------------------------------------------------------------


def _window() -> float:
    return settings().metrics_job_window


class LedgerCollector:
    """Ledger-derived metrics at scrape time. Per-job series (label `job_id` only; its tenant, name
    and bundle are in batchinf_job_info) cover active jobs and jobs finished within
    BATCHINF_METRICS_JOB_WINDOW seconds (default one day), so their number stays bounded. Current
    states are gauges with every state present (0 included); counts that only grow are counters;
    a total and its parts never share a family."""

    def collect(self) -> Iterator[Metric]:
        from batchinf.ledger.status import metrics_snapshot

        snap = metrics_snapshot(_window())
        counts = {(tenant, st): n for tenant, st, n in snap["by_status"]}
        g = GaugeMetricFamily("batchinf_jobs", "Jobs in the ledger by tenant and current status",
                              labels=["tenant", "status"])
        for tenant in sorted(snap["tenants"]):
            for st in JobStatus:
                g.add_metric([tenant, st.value], counts.get((tenant, st.value), 0))
        yield g

        yield from self._per_job(snap["jobs"], snap["per_job"])
        yield from self._per_bundle(snap["per_bundle"], snap["bundles"])

        att = CounterMetricFamily("batchinf_attempts", "Shard attempts that ended, by outcome (committed: "
                                  "the winners; failed: raised; lost: lease or worker lost, or the job "
                                  "stopped; superseded: a twin won)", labels=["outcome"])
        for outcome, n in snap["attempt_outcomes"]:
            att.add_metric([outcome], n)
        yield att
        yield GaugeMetricFamily("batchinf_attempts_running", "Shard attempts running now",
                                value=snap["attempts_running"])
        yield CounterMetricFamily("batchinf_leases_expired", "Attempts lost because their lease expired "
                                  "or their worker died", value=snap["leases_expired"])
        yield CounterMetricFamily("batchinf_retries", "Attempts after a shard's first", value=snap["retries"])
        yield CounterMetricFamily("batchinf_quarantined_shards", "Shards quarantined because their "
                                  "records killed every attempt's worker", value=snap["quarantined"])
        errs = CounterMetricFamily("batchinf_record_errors", "Error rows by code (poison: records "
                                   "quarantined for killing workers)", labels=["code"])
        for code, n in snap["errors"]:
            errs.add_metric([code], n)
        yield errs
        sched = CounterMetricFamily("batchinf_schedule_runs", "Jobs created by each schedule",
                                    labels=["schedule"])
        for name, n in snap["schedule_runs"]:
            sched.add_metric([name], n)
        yield sched

    @staticmethod
    def _per_job(job_rows: list[Any], per_job: list[Any]) -> Iterator[Metric]:
        info = GaugeMetricFamily("batchinf_job_info", "Recent jobs (value 1): tenant, name and bundle",
                                 labels=["job_id", "tenant", "name", "bundle_id", "bundle_digest"])
        shards_g = GaugeMetricFamily("batchinf_job_shards", "Shards of recent jobs by current status",
                                     labels=["job_id", "status"])
        queue = GaugeMetricFamily("batchinf_job_queue_depth", "Shards of a job waiting for a worker "
                                  "(pending, queued or retrying)", labels=["job_id"])
        planned = GaugeMetricFamily("batchinf_job_records_planned", "Records a job planned (its input "
                                    "records)", labels=["job_id"])
        records = GaugeMetricFamily("batchinf_job_records", "Records of a job's committed shards by "
                                    "outcome", labels=["job_id", "outcome"])
        running = GaugeMetricFamily("batchinf_job_records_in_progress", "Records finished inside a job's "
                                    "running shards (heartbeats), not yet committed", labels=["job_id"])
        tin = GaugeMetricFamily("batchinf_job_input_tokens", "Input tokens of a job's committed shards",
                                labels=["job_id"])
        real = GaugeMetricFamily("batchinf_job_real_tokens", "Record token positions computed for a "
                                 "job's committed shards", labels=["job_id"])
        padded = GaugeMetricFamily("batchinf_job_padded_tokens", "Token positions computed for a job's "
                                   "committed shards, padding included", labels=["job_id"])
        eff = GaugeMetricFamily("batchinf_job_padding_efficiency_ratio", "real / padded tokens of a job's "
                                "committed shards", labels=["job_id"])
        seconds = GaugeMetricFamily("batchinf_job_execute_seconds", "Execute seconds of a job's committed "
                                    "shards", labels=["job_id"])
        by_shard: dict[str, dict[str, Any]] = {}
        for r in per_job:
            by_shard.setdefault(r.job_id, {})[r.status] = r
        depth_total = 0
        for j in job_rows:
            rows = by_shard.get(j.id, {})
            info.add_metric([j.id, j.tenant, j.name or "", bundle_id(j.bundle_digest), j.bundle_digest], 1)
            for st in ShardStatus:
                shards_g.add_metric([j.id, st.value], rows[st.value][2] if st.value in rows else 0)
            depth = sum(rows[st][2] for st in WAITING if st in rows)
            depth_total += depth
            queue.add_metric([j.id], depth)
            if j.records_total is not None:
                planned.add_metric([j.id], j.records_total)
            c = rows.get(ShardStatus.COMMITTED.value)
            _n, _recs, ok, failed, t_in, t_real, t_pad, secs = c[2:10] if c else (0,) * 7 + (0.0,)
            records.add_metric([j.id, "succeeded"], ok)
            records.add_metric([j.id, "failed"], failed)
            r = rows.get(ShardStatus.RUNNING.value)
            running.add_metric([j.id], r[10] if r else 0)
            tin.add_metric([j.id], t_in)
            real.add_metric([j.id], t_real)
            padded.add_metric([j.id], t_pad)
            if t_pad:
                eff.add_metric([j.id], t_real / t_pad)
            seconds.add_metric([j.id], float(secs))
        total_depth = GaugeMetricFamily("batchinf_queue_depth", "Shards waiting for a worker, all recent jobs",
                                        value=depth_total)
        return iter([info, shards_g, queue, total_depth, planned, records, running, tin, real, padded, eff,
                     seconds])

    @staticmethod
    def _per_bundle(rows: list[Any], bundles: list[Any]) -> Iterator[Metric]:
        info = GaugeMetricFamily("batchinf_bundle_info", "Imported bundles (value 1)",
                                 labels=["bundle_id", "name", "task", "digest"])
        for digest, name, task in sorted(bundles):
            info.add_metric([bundle_id(digest), name, task, digest], 1)
        records = CounterMetricFamily("batchinf_bundle_records", "Records of committed shards per bundle "
                                      "by outcome", labels=["bundle_id", "outcome"])
        real = CounterMetricFamily("batchinf_bundle_real_tokens", "Record token positions computed per bundle",
                                   labels=["bundle_id"])
        padded = CounterMetricFamily("batchinf_bundle_padded_tokens", "Token positions computed per bundle, "
                                     "padding included", labels=["bundle_id"])
        eff = GaugeMetricFamily("batchinf_bundle_padding_efficiency_ratio", "real / padded tokens per bundle",
                                labels=["bundle_id"])
        dur = SummaryMetricFamily("batchinf_bundle_shard_seconds", "Execute seconds of committed shards "
                                  "per bundle", labels=["bundle_id"])
        for r in rows:
            digest, n, _recs, ok, failed, _tin, t_real, t_pad, secs = r
            b = bundle_id(digest)
            records.add_metric([b, "succeeded"], ok)
            records.add_metric([b, "failed"], failed)
            real.add_metric([b], t_real)
            padded.add_metric([b], t_pad)
            if t_pad:
                eff.add_metric([b], t_real / t_pad)
            dur.add_metric([b], count_value=n, sum_value=float(secs))
        return iter([info, records, real, padded, eff, dur])


_ledger_registry: CollectorRegistry | None = None


def exposition() -> bytes:
    """The API's /metrics body: this process's metrics, then the ledger's."""
    global _ledger_registry
    if _ledger_registry is None:
        _ledger_registry = CollectorRegistry(auto_describe=False)
        _ledger_registry.register(LedgerCollector())
    return generate_latest(REGISTRY) + generate_latest(_ledger_registry)
