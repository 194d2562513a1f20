"""Settings: the one place environment variables are read; typed, read at use time, clear errors."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchinf.config import settings
from batchinf.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
WRITES = {"setdefault", "update", "pop", "popitem", "clear"}   # os.environ.X(...) that set variables


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def env_reads(source: str) -> Iterator[int]:
    """Lines reading environment variables: os.environ[...], .get, `in`, os.getenv, iteration.
    Writes (os.environ[K] = V, del, setdefault, update, pop) and passing the whole environment
    on to a child (os.environ.copy(), dict(os.environ, ...)) are not reads."""
    tree = ast.parse(source)
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        name = _dotted(node)
        if isinstance(node, ast.Call) and _dotted(node.func) in ("os.getenv", "getenv", "os.getenvb"):
            yield node.lineno
        if name not in ("os.environ", "environ", "os.environb"):
            continue
        up = parent.get(node)
        if isinstance(up, ast.Subscript) and isinstance(up.ctx, (ast.Store, ast.Del)):
            continue
        if isinstance(up, ast.Attribute) and isinstance(parent.get(up), ast.Call) and up.attr in WRITES | {"copy"}:
            continue
        if isinstance(up, ast.Call) and _dotted(up.func) == "dict" and up.args and up.args[0] is node:
            continue
        yield node.lineno


def test_the_reader_tells_reads_from_writes() -> None:
    src = """
import os
os.environ["A"] = "1"
os.environ.setdefault("B", "2")
del os.environ["A"]
env = dict(os.environ, C="3")
a = os.environ["A"]
b = os.environ.get("B")
c = os.getenv("C")
d = "D" in os.environ
"""
    assert list(sorted(env_reads(src))) == [7, 8, 9, 10]


def test_only_config_reads_the_environment() -> None:
    offenders = []
    for top in ("batchinf", "workers"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == ROOT / "batchinf" / "config.py":
                continue
            offenders += [f"{path.relative_to(ROOT)}:{n}" for n in env_reads(path.read_text())]
    assert not offenders, ("environment variables are read outside batchinf/config.py; add a Settings field "
                           f"and read settings() at use time: {offenders}")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Set variables with it; settings are read afresh, before the test and after it."""
    settings.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    settings.cache_clear()


def test_defaults_and_types(env: pytest.MonkeyPatch) -> None:
    for name in ("BATCHINF_QUEUE", "BATCHINF_VISIBILITY_TIMEOUT", "BATCHINF_DEVICE", "BATCHINF_S3_ENDPOINT_URL",
                 "AWS_DEFAULT_REGION", "AWS_REGION", "BATCHINF_S3_REGION", "BATCHINF_METRICS_TOKEN",
                 "BATCHINF_METRICS_JOB_WINDOW",
                 "PROMETHEUS_MULTIPROC_DIR", "BATCHINF_PACK_WEIGHTS", "BATCHINF_MALLOC_KEEP_BYTES",
                 "BATCHINF_FAILPOINTS", "BATCHINF_FAILPOINTS_SEED"):
        env.delenv(name, raising=False)
    env.setenv("BATCHINF_DEVICE", "")                 # empty counts as unset
    s = settings()
    assert (s.queue, s.visibility_timeout, s.device, s.s3_endpoint_url, s.s3_region) == \
        ("batchinf", 6 * 3600, "auto", None, None)        # the region: boto3's chain, see test_s3_conventions
    assert (s.metrics_token, s.metrics_job_window, s.prometheus_multiproc_dir) == (None, 86400.0, None)
    assert (s.pack_weights, s.malloc_keep_bytes, s.failpoints, s.failpoints_seed) == (True, 1 << 30, "", None)


def test_values_are_read_when_settings_are_loaded(env: pytest.MonkeyPatch) -> None:
    before = settings()
    env.setenv("BATCHINF_QUEUE", "q-test")
    env.setenv("BATCHINF_VISIBILITY_TIMEOUT", "60")
    env.setenv("BATCHINF_METRICS_JOB_WINDOW", "1.5")
    env.setenv("BATCHINF_PACK_WEIGHTS", "0")
    assert settings() is before                       # loaded once per process ...
    settings.cache_clear()                            # ... until a test says otherwise
    s = settings()
    assert (s.queue, s.visibility_timeout, s.metrics_job_window, s.pack_weights) == ("q-test", 60, 1.5, False)

    from batchinf.workers.celery_app import QUEUE
    assert QUEUE == "q-test"


_TIMEOUTS = ("BATCHINF_S3_CONNECT_TIMEOUT", "BATCHINF_S3_READ_TIMEOUT", "BATCHINF_S3_MAX_ATTEMPTS",
             "BATCHINF_STORE_WARN_SECONDS", "BATCHINF_BROKER_TIMEOUT", "BATCHINF_DISPATCH_AHEAD")


def test_every_storage_and_broker_call_is_bounded(env: pytest.MonkeyPatch) -> None:
    """The S3 client and the Celery app take their timeouts from the settings."""
    for name in _TIMEOUTS:
        env.delenv(name, raising=False)
    s = settings()
    assert (s.s3_connect_timeout, s.s3_read_timeout, s.s3_max_attempts, s.store_warn_seconds) == (5.0, 30.0, 4, 10.0)
    assert (s.broker_timeout, s.dispatch_ahead) == (10.0, 2)
    env.setenv("BATCHINF_S3_READ_TIMEOUT", "2.5")
    env.setenv("BATCHINF_S3_MAX_ATTEMPTS", "3")
    env.setenv("BATCHINF_BROKER_TIMEOUT", "4")
    env.setenv("BATCHINF_QUEUE", "q-test")
    env.setenv("BATCHINF_S3_REGION", "us-east-1")
    env.setenv("AWS_EC2_METADATA_DISABLED", "true")      # making a client asks for nothing on the network
    settings.cache_clear()
    from batchinf.store.s3 import client

    config = client().meta.config
    assert (config.connect_timeout, config.read_timeout, config.retries["total_max_attempts"]) == (5.0, 2.5, 3)
    from batchinf.workers.celery_app import _from_settings, plan_queue

    conf = _from_settings()
    assert conf["broker_transport_options"]["socket_timeout"] == 4.0 == conf["broker_connection_timeout"]
    assert conf["task_publish_retry_policy"]["max_retries"] == 3
    assert plan_queue() == "q-test-plan"


@pytest.mark.parametrize("name, value, says", [
    ("BATCHINF_LEASE_SECONDS", "soon", "BATCHINF_LEASE_SECONDS='soon' is not a number"),
    ("BATCHINF_MAX_ATTEMPTS", "2.5", "BATCHINF_MAX_ATTEMPTS='2.5' is not an integer"),
    ("BATCHINF_VISIBILITY_TIMEOUT", "6h", "BATCHINF_VISIBILITY_TIMEOUT='6h' is not an integer"),
    ("BATCHINF_METRICS_JOB_WINDOW", "a day", "BATCHINF_METRICS_JOB_WINDOW='a day' is not a number"),
    ("BATCHINF_PRICE_PER_WORKER_HOUR", "$2", "BATCHINF_PRICE_PER_WORKER_HOUR='$2' is not a number"),
    ("BATCHINF_PACK_WEIGHTS", "maybe", "BATCHINF_PACK_WEIGHTS='maybe' is not a flag"),
])
def test_an_unusable_value_names_its_variable(env: pytest.MonkeyPatch, name: str, value: str, says: str) -> None:
    env.setenv(name, value)
    with pytest.raises(ConfigError, match=says.replace("$", r"\$")):
        settings()


def test_a_forked_child_loads_its_own(env: pytest.MonkeyPatch) -> None:
    """`batchinf worker` sets BATCHINF_DEVICE after its settings may be loaded; its forked
    Celery children must see it."""
    env.setenv("BATCHINF_DEVICE", "auto")
    assert settings().device == "auto"
    env.setenv("BATCHINF_DEVICE", "cpu")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                      # the child
        os.write(w, settings().device.encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    assert os.read(r, 100) == b"cpu"
    os.close(r)
    assert settings().device == "auto"                # the parent keeps what it loaded


def test_failpoints_reload_reads_the_environment(env: pytest.MonkeyPatch) -> None:
    from batchinf import failpoints

    env.setenv("BATCHINF_FAILPOINTS", "unit.test=raise")
    failpoints.reload()
    with pytest.raises(failpoints.FailpointError):
        failpoints.hit("unit.test")
    env.delenv("BATCHINF_FAILPOINTS")
    failpoints.reload()
    failpoints.hit("unit.test")
    assert not failpoints.active()
    env.setenv("BATCHINF_FAILPOINTS", "unit.test=explode")
    with pytest.raises(ConfigError, match="BATCHINF_FAILPOINTS: cannot parse"):
        failpoints.reload()
    env.delenv("BATCHINF_FAILPOINTS")
    failpoints.reload()
