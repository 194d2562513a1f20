"""`--metrics-port` on a real controller and a real Celery worker (prefork children share their
counters through prometheus_client's multiprocess mode)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.cluster import Cluster, job, wait
from tests.helpers.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= lab)


def test_controller_and_worker_serve_their_metrics(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    from batchinf.ledger.jobs import get as job_row

    job_id, good = job(tmp_path, s3_bucket, n=100, max_records=50)
    cport, wport = free_port(), free_port()
    cluster.start("controller", "controller", "--tick", "0.2", "--max-in-flight", "4", "--metrics-port", str(cport))
    cluster.start("worker", "worker", "--concurrency", "1", "--threads", "1", "--device", "cpu",
                  "--metrics-port", str(wport))
    final = wait(job_id, cluster)
    assert final["status"] == "succeeded", final
    digest = job_row(job_id).bundle_digest.removeprefix("sha256:")[:12]    # the bundle_id label
    w = _scrape(wport)
    assert _value(w, "batchinf_worker_records_total", bundle_id=digest, outcome="succeeded") == len(good) == 100
    assert _value(w, "batchinf_worker_records_total", bundle_id=digest, outcome="failed") == 6
    assert _value(w, "batchinf_worker_shard_duration_seconds_count", bundle_id=digest) == final["shards"]["total"]
    assert 0 < _value(w, "batchinf_worker_real_tokens_total") <= _value(w, "batchinf_worker_padded_tokens_total")
    c = _scrape(cport)
    assert _value(c, "batchinf_controller_shards_sent_total", kind="fresh") == final["shards"]["total"]
    assert _value(c, "batchinf_controller_leases_expired_total") == 0
