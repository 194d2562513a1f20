"""Prometheus metrics.

Two kinds:
- process metrics (counters and histograms of this process), fed by one-line hooks in execute.py,
  dispatch.py and controller.py and served by `--metrics-port` on workers and controllers; a
  Celery worker's forked children share them through prometheus_client's multiprocess mode;
- ledger metrics, computed from the ledger at scrape time by `LedgerCollector` (the API's
  `/metrics`): the same numbers whichever process serves them, per job and per bundle.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
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

from batchinf.config import settings
from batchinf.ledger.states import SHARD_WAITING, AttemptStatus, ShardStatus, values

WAITING = values(SHARD_WAITING)
disable_created_metrics()   # *_created samples only add noise to every counter

__all__ = ["CONTENT_TYPE_LATEST", "LedgerCollector", "exposition"]

SHARD_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

RECORDS = Counter("batchinf_worker_records", "Records in shards this process committed",
                  ["bundle", "outcome"])
TOKENS = Counter("batchinf_worker_tokens", "Token positions this process computed "
                 "(real: record tokens, padded: including padding)", ["bundle", "kind"])
SHARD_SECONDS = Histogram("batchinf_worker_shard_duration_seconds", "Wall time of committed shards",
                          ["bundle"], buckets=SHARD_BUCKETS)
ATTEMPTS_ENDED = Counter("batchinf_worker_attempts_ended", "Shard attempts that ended without "
                         "committing", ["reason"])
LEASES_EXPIRED = Counter("batchinf_controller_leases_expired", "Shard leases this controller expired")
SHARDS_SENT = Counter("batchinf_controller_shards_sent", "Shard messages sent to workers "
                      "(fresh: newly queued, resend: message possibly lost)", ["kind"])
SCHEDULED = Counter("batchinf_scheduler_jobs_submitted", "Jobs this scheduler created", ["schedule"])
HTTP_REQUESTS = Counter("batchinf_api_requests", "API requests", ["method", "route", "status"])
HTTP_SECONDS = Histogram("batchinf_api_request_duration_seconds", "API request latency",
                         ["method", "route"])


# --- hooks: each called from one line elsewhere --------------------------------------------------


def shard_committed(bundle: str, result: Any) -> None:
    """execute.py, after a fenced commit succeeded (`result` is an ops.ShardResult)."""
    RECORDS.labels(bundle, "succeeded").inc(result.output_rows)
    RECORDS.labels(bundle, "failed").inc(result.error_rows)
    TOKENS.labels(bundle, "real").inc(result.tokens_real)
    TOKENS.labels(bundle, "padded").inc(result.tokens_padded)
    SHARD_SECONDS.labels(bundle).observe(result.execute_seconds)


def attempt_ended(reason: str) -> None:
    """dispatch.py: an attempt raised (`error`), lost its lease (`stale`) or met a bad `bundle`."""
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
    """Ledger-derived metrics at scrape time. Per-job series cover active jobs and jobs finished
    within BATCHINF_METRICS_JOB_WINDOW seconds (default one day), so their number stays bounded;
    per-bundle and global series are totals over the whole ledger (monotonic: counters)."""

    def collect(self) -> Iterator[Metric]:
        from batchinf.ledger.status import metrics_snapshot

        snap = metrics_snapshot(_window())
        by_status, job_rows, per_job, per_bundle = (snap["by_status"], snap["jobs"], snap["per_job"],
                                                     snap["per_bundle"])
        attempt_rows, retries, quarantined = snap["attempts"], snap["retries"][0], snap["quarantined"][0]
        err_rows, runs = snap["errors"], snap["schedule_runs"]

        g = GaugeMetricFamily("batchinf_jobs", "Jobs in the ledger by tenant and status",
                              labels=["tenant", "status"])
        for tenant, st, n in by_status:
            g.add_metric([tenant, st], n)
        yield g

        yield from self._per_job(job_rows, per_job)
        yield from self._per_bundle(per_bundle)

        att = CounterMetricFamily("batchinf_attempts", "Shard attempts by outcome", labels=["status"])
        for st, n in sorted(attempt_rows):
            att.add_metric([st], n)
        lost = sum(n for st, n in attempt_rows if st in (AttemptStatus.LOST, AttemptStatus.SWEPT))
        yield att
        yield CounterMetricFamily("batchinf_leases_expired", "Attempts whose lease expired or whose "
                                  "worker died", value=lost)
        yield CounterMetricFamily("batchinf_retries", "Attempts after a shard's first", value=retries)
        yield CounterMetricFamily("batchinf_quarantined_shards", "Shards quarantined because their "
                                  "records killed every attempt's worker", value=quarantined)
        errs = CounterMetricFamily("batchinf_record_errors", "Error rows by code (poison: records "
                                   "quarantined for killing workers)", labels=["code"])
        for code, n in err_rows:
            errs.add_metric([code], n)
        yield errs
        poison = sum(n for code, n in err_rows if code == "poison")
        yield CounterMetricFamily("batchinf_quarantined_records", "Records isolated as poison",
                                  value=poison)
        sched = CounterMetricFamily("batchinf_schedule_runs", "Jobs created by each schedule",
                                    labels=["schedule"])
        for name, n in runs:
            sched.add_metric([name], n)
        yield sched

    @staticmethod
    def _per_job(job_rows: list[Any], per_job: list[Any]) -> Iterator[Metric]:
        labels = ["job", "tenant", "name", "bundle"]
        info = {r.id: [r.id, r.tenant, r.name, r.bundle_digest] for r in job_rows}
        shards_g = GaugeMetricFamily("batchinf_job_shards", "Shards of recent jobs by status",
                                     labels=labels + ["status"])
        queue = GaugeMetricFamily("batchinf_job_queue_depth", "Shards of a job waiting for a worker "
                                  "(pending, queued or retrying)", labels=labels)
        records = GaugeMetricFamily("batchinf_job_records", "Records of recent jobs (total: planned; "
                                    "succeeded/failed: in committed shards)", labels=labels + ["outcome"])
        tokens = GaugeMetricFamily("batchinf_job_tokens", "Tokens of a job's committed shards",
                                   labels=labels + ["kind"])
        eff = GaugeMetricFamily("batchinf_job_padding_efficiency", "real / padded tokens of a job's "
                                "committed shards", labels=labels)
        seconds = GaugeMetricFamily("batchinf_job_shard_seconds", "Execute seconds of a job's committed "
                                    "shards", labels=labels)
        depth: dict[str, int] = {}
        done: dict[str, list[float]] = {}
        for r in per_job:
            n, _recs, ok, failed, tin, real, padded, secs = r[2:]
            shards_g.add_metric(info[r.job_id] + [r.status], n)
            if r.status in WAITING:
                depth[r.job_id] = depth.get(r.job_id, 0) + n
            if r.status == ShardStatus.COMMITTED:
                done[r.job_id] = [ok, failed, tin, real, padded, secs]
        for r in job_rows:
            lab = info[r.id]
            queue.add_metric(lab, depth.get(r.id, 0))
            ok, failed, tin, real, padded, secs = done.get(r.id, [0, 0, 0, 0, 0, 0.0])
            if r.records_total is not None:
                records.add_metric(lab + ["total"], r.records_total)
            records.add_metric(lab + ["succeeded"], ok)
            records.add_metric(lab + ["failed"], failed)
            for kind, v in (("input", tin), ("real", real), ("padded", padded)):
                tokens.add_metric(lab + [kind], v)
            if padded:
                eff.add_metric(lab, real / padded)
            seconds.add_metric(lab, secs)
        total_depth = GaugeMetricFamily("batchinf_queue_depth", "Shards waiting for a worker, all jobs",
                                        value=sum(depth.values()))
        return iter([shards_g, queue, total_depth, records, tokens, eff, seconds])

    @staticmethod
    def _per_bundle(rows: list[Any]) -> Iterator[Metric]:
        records = CounterMetricFamily("batchinf_bundle_records", "Records processed per bundle",
                                      labels=["bundle", "outcome"])
        tokens = CounterMetricFamily("batchinf_bundle_tokens", "Token positions computed per bundle",
                                     labels=["bundle", "kind"])
        eff = GaugeMetricFamily("batchinf_bundle_padding_efficiency", "real / padded tokens per bundle",
                                labels=["bundle"])
        dur = SummaryMetricFamily("batchinf_bundle_shard_seconds", "Execute seconds of committed shards "
                                  "per bundle", labels=["bundle"])
        for r in rows:
            digest, n, _recs, ok, failed, _tin, real, padded, secs = r
            records.add_metric([digest, "succeeded"], ok)
            records.add_metric([digest, "failed"], failed)
            tokens.add_metric([digest, "real"], real)
            tokens.add_metric([digest, "padded"], padded)
            if padded:
                eff.add_metric([digest], real / padded)
            dur.add_metric([digest], count_value=n, sum_value=float(secs))
        return iter([records, tokens, eff, dur])


_ledger_registry: CollectorRegistry | None = None


def exposition() -> bytes:
    """The API's /metrics body: this process's metrics, then the ledger's."""
    global _ledger_registry
    if _ledger_registry is None:
        _ledger_registry = CollectorRegistry(auto_describe=False)
        _ledger_registry.register(LedgerCollector())
    return generate_latest(REGISTRY) + generate_latest(_ledger_registry)
