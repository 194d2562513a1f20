"""Hostile chat templates (they ship inside bundles and GGUF files): a template that would hang a
worker or build gigabytes fails fast with a clear error -- the bundle is refused at import, or a
record that triggers it gets its `invalid_messages` row -- and the sandbox still blocks escapes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jinja2
import pytest

from batchinf.errors import BundleError
from batchinf.runtime.chat_template import TemplateLimitError, compile_template, render
from batchinf.runtime.generate import GenerateRuntime
from tests.helpers.tiny_llama import make_tiny_llama

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
