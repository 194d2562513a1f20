"""The Prometheus exposition as Prometheus sees it: a real job in a real ledger, the exposition the
API serves (`metrics.exposition()`), parsed with prometheus_client's own parser and checked against
The docs' metric table (docs/reference/metrics.md: names, types, labels), plus the conventions: no `job` label (Prometheus
owns it), counters end in `_total`, current states are gauges with every state present (0
included), ratios end in `_ratio`, digests only in `_info` families."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchinf import metrics
from batchinf.controller import drive
from batchinf.ledger.states import AttemptStatus, JobStatus, ShardStatus
from batchinf.manifest import parse_manifest
from batchinf.submit import submit
from batchinf.scopes import Caller
from tests.helpers.corpus import BAD_LINES, manifest, write_jsonl

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
Family = tuple[str, frozenset[str]]   # type, label names


def docs_table() -> dict[str, Family]:
    """The metric table of docs/reference/metrics.md: metric family -> (type, label names)."""
    section = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    out: dict[str, Family] = {}
    for line in section.splitlines():
        m = re.match(r"\| `(batchinf_\w+)` \| (\w+) \| ([^|]*) \|", line)
        if m:
            labels = frozenset() if m[3].strip() == "none" else frozenset(x.strip() for x in m[3].split(","))
            out[m[1]] = (m[2], labels)
    return out


def scrape(text: str) -> dict[str, tuple[str, frozenset[str], list]]:
    """metric name as queried (a counter's family with `_total`, an info family with `_info`) ->
    (type, label names over its samples, samples)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        names = frozenset(k for s in fam.samples for k in s.labels if k not in ("le", "quantile"))
        name = fam.name + {"counter": "_total", "info": "_info"}.get(fam.type, "")
        out[name] = (fam.type, names, fam.samples)
    return out


def render(fams: dict) -> str:
    """Table rows for a scrape (how the table was generated)."""
    return "\n".join(f"| `{n}` | {t} | {', '.join(sorted(lab)) or 'none'} | |" for n, (t, lab, _) in sorted(fams.items())
                     if n.startswith("batchinf_"))


def _value(fams: dict, family: str, **labels: str) -> float:
    hits = [s.value for s in fams[family][2] if labels.items() <= s.labels.items()
            and not s.name.endswith(("_created", "_bucket"))]
    assert len(hits) == 1, (family, labels, hits)
    return hits[0]


def test_exposition_matches_readme_and_conventions(tmp_path: Path, tiny_bundle: str) -> None:
    write_jsonl(tmp_path / "in" / "a.jsonl", 300, seed=3)
    done_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in" / "a.jsonl"), str(tmp_path / "out"),
                                                shards={"max_records": 100})), Caller("acme", operator=True))
    assert drive(done_id, workers=1, threads=1) == JobStatus.SUCCEEDED
    waiting_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in" / "a.jsonl"), str(tmp_path / "out2"),
                                                   name="waiting")), Caller("acme", operator=True))

    text = metrics.exposition().decode()
    fams = scrape(text)
    table = docs_table()
    assert table, "docs/reference/metrics.md has no metric table"

    ours = {name for name in fams if name.startswith("batchinf_")}
    assert ours == set(table), render(fams) + f"\nscraped but not in the docs: {sorted(ours - set(table))}; " \
                               f"in the docs but not scraped: {sorted(set(table) - ours)}"
    for name in sorted(ours):
        typ, labels, samples = fams[name]
        assert typ == table[name][0], f"{name}: the docs say {table[name][0]}, exposition says {typ}"
        if samples:   # a labelled process metric nothing has touched yet has no samples to show labels
            assert labels == table[name][1], f"{name}: the docs' labels {sorted(table[name][1])}, scraped {sorted(labels)}"

    # Prometheus conventions
    for name, (typ, labels, samples) in fams.items():
        if not name.startswith("batchinf_"):
            continue
        assert "job" not in labels, f"{name} has a `job` label: Prometheus would rename it exported_job"
        if typ == "counter":
            assert all(s.name.endswith("_total") for s in samples), name
        if "efficiency" in name or name.endswith(("_ratio", "_fraction", "_percent")):
            assert name.endswith("_ratio") and typ == "gauge", name
        digests = [s for s in samples if any(str(v).startswith("sha256:") for v in s.labels.values())]
        assert not digests or name.endswith("_info"), f"{name} carries a digest label outside an _info family"
        for s in samples:
            assert all(len(str(v)) <= 64 for k, v in s.labels.items() if k not in ("bundle_digest", "digest")), s

    # the real job's numbers
    assert _value(fams, "batchinf_job_records", job_id=done_id, outcome="succeeded") == 300
    assert _value(fams, "batchinf_job_records", job_id=done_id, outcome="failed") == len(BAD_LINES)
    assert _value(fams, "batchinf_job_records_planned", job_id=done_id) == 300 + len(BAD_LINES)
    assert _value(fams, "batchinf_job_info", job_id=done_id, tenant="acme", bundle_digest=tiny_bundle) == 1
    real = _value(fams, "batchinf_job_real_tokens", job_id=done_id)
    padded = _value(fams, "batchinf_job_padded_tokens", job_id=done_id)
    assert 0 < real <= padded
    assert _value(fams, "batchinf_job_padding_efficiency_ratio", job_id=done_id) == pytest.approx(real / padded)
    committed = _value(fams, "batchinf_job_shards", job_id=done_id, status="committed")
    assert committed >= 3
    assert _value(fams, "batchinf_attempts_total", outcome=AttemptStatus.COMMITTED.value) == committed
    assert _value(fams, "batchinf_attempts_total", outcome=AttemptStatus.LOST.value) == 0
    assert _value(fams, "batchinf_leases_expired_total") == 0
    assert _value(fams, "batchinf_attempts_running") == 0
    assert _value(fams, "batchinf_bundle_info", digest=tiny_bundle, name="tiny") == 1
    assert _value(fams, "batchinf_bundle_records_total", bundle_id=metrics.bundle_id(tiny_bundle),
                  outcome="succeeded") == 300
    assert _value(fams, "batchinf_build_info", version=metrics.__version__) == 1

    # zeros included: every job status for the tenant, every shard status for every recent job
    assert {s.labels["status"]: s.value for s in fams["batchinf_jobs"][2] if s.labels["tenant"] == "acme"} == \
        {st.value: (1 if st in (JobStatus.SUCCEEDED, JobStatus.SUBMITTED) else 0) for st in JobStatus}
    assert {s.labels["status"]: s.value for s in fams["batchinf_job_shards"][2]
            if s.labels["job_id"] == waiting_id} == {st.value: 0 for st in ShardStatus}
    assert _value(fams, "batchinf_job_records", job_id=waiting_id, outcome="succeeded") == 0
