"""Hostile chat templates (they ship inside bundles and GGUF files): a template that would hang a
worker or build gigabytes fails fast with a clear error -- the bundle is refused at import, or a
record that triggers it gets its `invalid_messages` row -- and the sandbox still blocks escapes.
Templates compile and render in a sandbox process (runtime/template_sandbox.py) whose memory and
CPU limits stop what no check in Jinja sees: a single filter or method that builds gigabytes or
runs for seconds in C."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import pytest

from batchinf.errors import BundleError
from tests.helpers.env import OPERATOR
from batchinf.runtime.chat_template import TemplateLimitError, compile_template, render
from batchinf.runtime.generation.runtime import GenerateRuntime
from tests.helpers.template_bombs import BOMBS, router
from tests.helpers.tiny_llama import CHAT_TEMPLATE, make_tiny_llama

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]

HOSTILE = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
    "2 GB repetition": "{{ 'x' * 2000000000 }}",
    "huge power (folded at compile time by plain Jinja)": "{{ 10**(10**9) }}",
    "doubling with ~": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s }}",
    "doubling with +": "{% set ns = namespace(s=['a']) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "center filter": "{{ 'x'|center(1000000000) }}",
    "str method": "{{ 'x'.ljust(1000000000) }}",
    "percent width": "{{ '%0999999999d' % 1 }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "replace blow-up": "{% set s = 'a' * 1000000 %}{{ s.replace('a', s) }}",
    "big range": "{{ range(10000000)|list|length }}",
    "output flood": "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
    "recursive macro": "{% macro m(n) %}{{ m(n) }}{% endmacro %}{{ m(1) }}",
}


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_templates_fail_fast_with_a_limit_error(source: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError):
        render(compile_template(source), messages=MESSAGES)
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ messages.append({'role': 'user'}) }}",
    "{{ (messages|first).update({'x': 1}) }}",
    "{{ raise_exception.__globals__['os'] }}",
])
def test_the_sandbox_still_blocks_escapes(source: str) -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        render(compile_template(source), messages=MESSAGES)


def test_normal_templates_render_as_plain_jinja_does() -> None:
    source = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] ~ '!' }}{% if loop.last %}"
              "[{{ loop.length }}]{% endif %}{% endfor %}{{ (3 * 'ab') + 'c' }}{{ 2**10 }}{{ '%5d' % 3 }}"
              "{{ messages|map(attribute='role')|join(',') }}{{ range(3)|list }}{{ 'a b'.split()|tojson }}")
    want = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    want.filters["tojson"] = lambda x: json.dumps(x)
    assert render(compile_template(source), messages=MESSAGES) == want.from_string(source).render(messages=MESSAGES)


def _llama_with_template(tmp_path: Path, template: str) -> Path:
    d = make_tiny_llama(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("template, says", [
    (HOSTILE["nested range loops"], "loop iterations"),
    (HOSTILE["huge power (folded at compile time by plain Jinja)"], "too large"),
    ("{% for m in messages %}{{ m.content }", "does not compile"),
])
def test_a_bundle_whose_template_breaks_the_limits_is_refused_at_import(
        tmp_path: Path, bi_home: Path, template: str, says: str) -> None:
    from batchinf.bundles import import_bundle

    t0 = time.monotonic()
    with pytest.raises(BundleError, match=says) as exc:
        import_bundle(_llama_with_template(tmp_path, template), "hostile")
    assert "chat_template" in str(exc.value) and time.monotonic() - t0 < 60


def test_a_record_that_trips_a_limit_is_refused_and_the_next_one_renders(tmp_path: Path) -> None:
    # fine for normal conversations, but a record saying "boom" makes it loop for ever
    template = ("{% for m in messages %}{% if m.content == 'boom' %}{% for i in range(100000) %}"
                "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{{ m.content }}\n{% endfor %}")
    rt = GenerateRuntime(_llama_with_template(tmp_path, template), {"context_length": 256})
    with pytest.raises(ValueError, match="went past a limit.*loop iterations"):
        rt.encode_chat([{"role": "user", "content": "boom"}])
    assert rt.render_chat([{"role": "user", "content": "fine"}]) == "fine\n"


def test_an_unsafe_attribute_renders_nothing() -> None:
    assert render(compile_template("[{{ raise_exception.__globals__ }}]"), messages=MESSAGES) == "[]"


# --- the sandbox process: bombs no in-process check sees ----------------------------------------

LIMIT_BYTES = 256 << 20
SECONDS = 1.0       # a CPU-bound bomb is stopped after 2 s of CPU or SECONDS + WALL_GRACE of wall clock

# the tiny model's ChatML template, but a last message naming a bomb sets it off
ROUTER = router(CHAT_TEMPLATE)
HEALTHY = ([{"role": "user", "content": "hello world"}],
           [{"role": "system", "content": "be short"}, {"role": "user", "content": "the water? ünï ✓"},
            {"role": "assistant", "content": "light"}, {"role": "user", "content": "why\n\tso"}])


@pytest.fixture(scope="module")
def sandboxed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenerateRuntime]:
    """A runtime whose chat template is ROUTER, rendering under LIMIT_BYTES and SECONDS."""
    from batchinf.config import settings

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHINF_TEMPLATE_MEMORY_BYTES", str(LIMIT_BYTES))
        mp.setenv("BATCHINF_TEMPLATE_SECONDS", str(SECONDS))
        settings.cache_clear()
        rt = GenerateRuntime(_llama_with_template(tmp_path_factory.mktemp("router"), ROUTER), {"context_length": 4096})
    settings.cache_clear()
    yield rt
    rt.template_sandbox.close()


def _stage(rt: GenerateRuntime, conversations: list[list[dict]]) -> list[dict]:
    from types import SimpleNamespace

    from batchinf.formats.record import InputRecord
    from batchinf.tasks.generate import Generate, GenerateOptions

    obj = SimpleNamespace(pin=SimpleNamespace(uri="file:///in/chats.jsonl"), options=GenerateOptions(max_tokens=8),
                          max_length=rt.context_length)
    records = [InputRecord(i, f"r{i}", None, messages=m) for i, m in enumerate(conversations)]
    return Generate().stage(obj, rt, iter(records)).to_pylist()


def _in_process(source: str, messages: list[dict], **variables: Any) -> str:
    return render(compile_template(source), messages=messages, add_generation_prompt=True, **variables)


@pytest.mark.parametrize("bomb", BOMBS)
def test_a_bomb_record_gets_invalid_messages_and_its_batch_renders(sandboxed: GenerateRuntime, bomb: str) -> None:
    t0 = time.monotonic()
    rows = _stage(sandboxed, [HEALTHY[0], [{"role": "user", "content": bomb}], HEALTHY[1]])
    elapsed = time.monotonic() - t0
    print(f"{bomb}: {elapsed:.2f} s, peak RSS {sandboxed.template_sandbox.peak_rss() / 2**20:.0f} MiB so far")
    assert rows[1]["error"] == "invalid_messages", rows[1]
    assert rows[1]["message"].startswith("file:///in/chats.jsonl record 'r1': the bundle's chat template went past a limit")
    for row, messages in zip((rows[0], rows[2]), HEALTHY):
        assert row["error"] is None
        assert row["input_ids"] == sandboxed.encode_rendered(_in_process(ROUTER, messages))
    assert sandboxed.template_sandbox.peak_rss() <= LIMIT_BYTES
    assert elapsed < 15        # unbounded, wordwrap alone runs for a minute and the others build gigabytes


def test_which_limit_stopped_a_bomb_is_named(sandboxed: GenerateRuntime) -> None:
    out = sandboxed.render_chats([[{"role": "user", "content": b}] for b in ("format width", "wordwrap")])
    assert "memory limit of 268435456 bytes (BATCHINF_TEMPLATE_MEMORY_BYTES)" in str(out[0])
    assert "BATCHINF_TEMPLATE_SECONDS" in str(out[1]) and "its process was stopped" in str(out[1])


def test_the_kernel_stops_a_render_stuck_in_c_past_its_cpu_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.runtime import template_sandbox

    monkeypatch.setattr(template_sandbox, "WALL_GRACE", 120.0)     # so that the wall clock cannot come first
    sandbox = template_sandbox.TemplateSandbox(BOMBS["wordwrap"], {}, memory_bytes=LIMIT_BYTES, seconds=SECONDS)
    try:
        (result,) = sandbox.render([MESSAGES])
        assert isinstance(result, TemplateLimitError) and "used up its CPU time" in str(result)
        assert sandbox.pid is None and sandbox.starts == 1        # that process is gone; the next render starts one
    finally:
        sandbox.close()


def test_healthy_batches_render_as_the_in_process_renderer(sandboxed: GenerateRuntime) -> None:
    conversations = [[{"role": "user", "content": f"question {i}: {'ab ' * (i % 7)}"}] for i in range(150)]
    rows = _stage(sandboxed, conversations)      # more than RENDER_CHUNK records: several round trips
    assert [r["input_ids"] for r in rows] == [sandboxed.encode_rendered(_in_process(ROUTER, m)) for m in conversations]


def test_bombs_across_chunks_fail_only_their_records(sandboxed: GenerateRuntime) -> None:
    # chunks of RENDER_CHUNK: a trip replaces the process mid-chunk, the next chunk is sent ahead
    bombs = {5: "join separator", 63: "macro recursion", 64: "center", 140: "list growth"}
    conversations = [[{"role": "user", "content": bombs.get(i, f"question {i}")}] for i in range(150)]
    rows = _stage(sandboxed, conversations)
    assert [i for i, r in enumerate(rows) if r["error"] == "invalid_messages"] == sorted(bombs)
    assert all(rows[i]["input_ids"] == sandboxed.encode_rendered(_in_process(ROUTER, m))
               for i, m in enumerate(conversations) if i not in bombs)


def test_a_second_submit_drops_the_unread_results_of_the_first(sandboxed: GenerateRuntime) -> None:
    sandbox = sandboxed.template_sandbox
    sandbox.submit([HEALTHY[0], [{"role": "user", "content": "indent"}]])
    sandbox.submit([HEALTHY[1]])
    assert sandbox.results() == [_in_process(ROUTER, HEALTHY[1])] and sandbox.results() == []


def test_a_time_limit_raised_mid_render_leaves_the_sandbox_usable(sandboxed: GenerateRuntime) -> None:
    """Celery's soft time limit arrives as an exception from a signal handler, wherever the parent is."""
    import signal

    class SoftTimeLimit(Exception):
        pass

    def fire(signum: int, frame: Any) -> None:
        raise SoftTimeLimit

    previous = signal.signal(signal.SIGALRM, fire)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(SoftTimeLimit):
            sandboxed.render_chats([[{"role": "user", "content": "wordwrap"}], HEALTHY[0]])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert sandboxed.render_chats([HEALTHY[1]]) == [_in_process(ROUTER, HEALTHY[1])]


def test_chat_records_of_a_bundle_without_a_template_get_invalid_messages(tmp_path: Path) -> None:
    d = make_tiny_llama(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    rt = GenerateRuntime(d, {"context_length": 256})
    rows = _stage(rt, [HEALTHY[0]])
    assert rows[0]["error"] == "invalid_messages" and "has no chat template; send a plain prompt" in rows[0]["message"]


def _smollm2_template() -> str:
    from batchinf.runtime.gguf import GGUFFile
    from tests.helpers.real_models import smollm2_gguf

    with GGUFFile(smollm2_gguf()) as g:
        return g.metadata["tokenizer.chat_template"]


NORMAL = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] ~ '!' }}{% if loop.last %}"
          "[{{ loop.length }}]{% endif %}{% endfor %}{{ (3 * 'ab') + 'c' }}{{ 2**10 }}{{ '%5d' % 3 }}"
          "{{ messages|map(attribute='role')|join(',') }}{{ range(3)|list }}{{ 'a b'.split()|tojson }}"
          "{{ bos_token }}{% if add_generation_prompt %}<go>{% endif %}")


@pytest.mark.parametrize("which", ["smollm2", "tiny chatml", "normal"])
def test_the_sandbox_renders_real_templates_identically(which: str) -> None:
    from batchinf.runtime.template_sandbox import TemplateSandbox

    source = {"smollm2": _smollm2_template, "tiny chatml": lambda: CHAT_TEMPLATE, "normal": lambda: NORMAL}[which]()
    variables = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": None, "unk_token": None}
    conversations = [*HEALTHY, MESSAGES + [{"role": "user", "content": "x" * 10000}],
                     [{"role": "user", "content": "lone \ud800 surrogate, {{ not a template }}"}]]
    sandbox = TemplateSandbox(source, variables, memory_bytes=LIMIT_BYTES, seconds=SECONDS)
    try:
        assert sandbox.render(conversations) == [_in_process(source, m, **variables) for m in conversations]
    finally:
        sandbox.close()


def test_a_template_that_bombs_on_a_fixture_conversation_refuses_the_bundle(tmp_path: Path) -> None:
    from batchinf.runtime.bundle import check_chat_template

    template = "{% if messages|length > 1 %}" + BOMBS["format width"] + "{% endif %}" + CHAT_TEMPLATE
    d = _llama_with_template(tmp_path, template)
    rt = GenerateRuntime(d, {"context_length": 256, "chat_template": True})
    with pytest.raises(BundleError, match="cannot render fixture conversation 1 .*memory limit"):
        check_chat_template(rt, d)


def test_a_template_that_bombs_while_compiling_refuses_the_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.config import settings
    from batchinf.runtime.bundle import check_chat_template

    # Jinja folds a filter of a constant at compile time: this one would run for a minute there
    template = '{{ "' + "v" * 1500000 + '"|wordwrap(4) }}' + CHAT_TEMPLATE
    monkeypatch.setenv("BATCHINF_TEMPLATE_SECONDS", str(SECONDS))
    settings.cache_clear()
    d = _llama_with_template(tmp_path, template)
    rt = GenerateRuntime(d, {"context_length": 256, "chat_template": True})
    t0 = time.monotonic()
    with pytest.raises(BundleError, match="does not compile .*CPU time|does not compile .*did not start"):
        check_chat_template(rt, d)
    assert time.monotonic() - t0 < 15
    settings.cache_clear()


def test_the_sandbox_process_inherits_no_secret_and_no_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.runtime.template_sandbox import TemplateSandbox

    if not Path("/proc/self/environ").exists():
        pytest.skip("needs /proc")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("BATCHINF_DATABASE_URL", "postgresql://user:pw@db/ledger")
    r, w = os.pipe()
    os.set_inheritable(w, True)         # a ledger socket or store connection a library left inheritable
    sandbox = TemplateSandbox(CHAT_TEMPLATE, {}, memory_bytes=LIMIT_BYTES, seconds=SECONDS)
    try:
        assert sandbox.render([MESSAGES]) == [_in_process(CHAT_TEMPLATE, MESSAGES)]
        pid = sandbox.pid
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not [e for e in environ if e.startswith((b"AWS_", b"BATCHINF_"))], environ
        assert sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd")) == [0, 1, 2]
        assert Path(f"/proc/{pid}/limits").read_text().count(str(LIMIT_BYTES)) == 2    # RLIMIT_AS soft and hard
    finally:
        sandbox.close()
        os.close(r)
        os.close(w)
    assert sandbox.pid is None


def test_a_forked_process_renders_with_its_own_sandbox(sandboxed: GenerateRuntime) -> None:
    assert sandboxed.render_chat(HEALTHY[0]) == _in_process(ROUTER, HEALTHY[0])
    parent_child = sandboxed.template_sandbox.pid
    pid = os.fork()
    if pid == 0:        # the fork must not talk over the parent's pipes, nor kill its process
        ok = sandboxed.render_chat(HEALTHY[1]) == _in_process(ROUTER, HEALTHY[1]) \
            and sandboxed.template_sandbox.pid != parent_child
        sandboxed.template_sandbox.close()
        os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert sandboxed.template_sandbox.pid == parent_child
    assert sandboxed.render_chat(HEALTHY[1]) == _in_process(ROUTER, HEALTHY[1])


@pytest.mark.integration
def test_a_job_whose_records_set_off_bombs_succeeds_with_their_error_rows(
        tmp_path: Path, bi_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.parquet as pq

    from batchinf.bundles import import_bundle
    from batchinf.config import settings
    from batchinf.controller import drive
    from batchinf.manifest import parse_manifest
    from batchinf.submit import submit
    from batchinf.verify import verify_output

    monkeypatch.setenv("BATCHINF_TEMPLATE_MEMORY_BYTES", str(LIMIT_BYTES))
    monkeypatch.setenv("BATCHINF_TEMPLATE_SECONDS", str(SECONDS))
    settings.cache_clear()
    import_bundle(_llama_with_template(tmp_path, ROUTER), "router", alias="prod")
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    bombs = ("format width", "wordwrap", "list growth")
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(6)]
    rows[1:1] = [{"id": b, "messages": [{"role": "user", "content": b}]} for b in bombs]
    (inp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = {"name": "template-bombs", "task": "generate", "bundle": "router@prod", "options": {"max_tokens": 2},
         "input": {"uri": str(inp) + "/", "messages_field": "messages"}, "output": {"uri": str(out)}}
    job_id, _ = submit(parse_manifest(m), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == "succeeded"
    assert verify_output(str(out))["ok"]
    ids = sorted(pq.read_table(out, ignore_prefixes=["_", "errors", "."]).column("record_id").to_pylist())
    assert ids == [f"c{i}" for i in range(6)]
    errors = {e["record_id"]: e for e in pq.read_table(out / "errors").to_pylist()}
    assert sorted(errors) == sorted(bombs) and {e["error"] for e in errors.values()} == {"invalid_messages"}
    assert "BATCHINF_TEMPLATE_MEMORY_BYTES" in errors["format width"]["message"]
    assert "BATCHINF_TEMPLATE_SECONDS" in errors["wordwrap"]["message"]


def test_threads_sharing_a_runtime_render_with_sandboxes_of_their_own() -> None:
    """Two jobs (tenants) planned at once on threads sharing a runtime: each thread's submit and
    results pair with its own conversations, never the other's, even interleaved."""
    import threading

    from batchinf.runtime.template_sandbox import ThreadSandboxes

    boxes = ThreadSandboxes({"chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"})
    gate, got = threading.Barrier(2), {}

    def render(tenant: str) -> None:
        sandbox = boxes.get()
        sandbox.submit([[{"role": "user", "content": f"{tenant}-{i}"}] for i in range(20)])
        gate.wait()                                 # both have submitted before either collects
        got[tenant] = sandbox.results()
        sandbox.close()

    threads = [threading.Thread(target=render, args=(t,)) for t in ("acme", "globex")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got == {t: [f"[{t}-{i}]" for i in range(20)] for t in ("acme", "globex")}
