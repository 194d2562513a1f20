"""Chat-template bombs that no check inside Jinja sees: each builds over 600 MB, or runs for a
minute, inside one filter, method, operator or macro chain (values other than the ones issue 26
quotes). The sandbox process's limits (runtime/template_sandbox.py) stop every one of them."""

from __future__ import annotations

S = ", s" * 39
BOMBS = {
    "format width": "{{ ('{0:>876543}' * 800).format('x') }}",
    "percent width": "{{ ('%765432s' * 900) % (('y',) * 900) }}",
    "format filter width": "{{ ('%654321s' * 1000)|format(*(['z'] * 1000)) }}",
    "expandtabs": "{{ ('\\t' * 3000000).expandtabs(300) }}",
    "indent": "{{ ('\\n' * 1500000)|indent(400, true, true) }}",
    "center": "{{ (['c'] * 700)|map('center', 987654)|join }}",
    "ljust": "{{ (['l'] * 700)|join('.'.ljust(999999)) }}",
    "join separator": "{{ (['j'] * 900)|join('-' * 777777) }}",
    "replace chain": "{{ ('ab' * 5000)|replace('a', 'aaaaaa')|replace('a', 'aaaaaa')|replace('a', 'aaaaaa')"
                     "|replace('a', 'aaaaaa')|replace('a', 'aaaaaa') }}",
    "translate": "{{ ('q' * 9000).translate({113: 'w' * 99999}) }}",
    "wordwrap": "{{ ('w' * 1500000)|wordwrap(4) }}",       # quadratic: 3.5 s at 600,000 characters
    "string repetition": "{% set s = 'r' * 15000000 %}{{ [s" + S + "]|join }}",
    "list growth": "{{ ([[0] * 7000000] * 12)|sum(start=[])|length }}",
    "macro recursion": "{% macro m(n) %}{% if n > 0 %}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(54321) }}",
    "macro doubling": "{% macro m(s, n) %}{% if n > 0 %}{{ m(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}"
                      "{% endmacro %}{{ m('ab', 30) }}",
}


def router(template: str) -> str:
    """`template`, but a conversation whose last message names a bomb sets that bomb off first."""
    return ("{% set c = messages[-1]['content'] %}"
            + "".join(f"{'{% if' if i == 0 else '{% elif'} c == {name!r} %}}{src}" for i, (name, src) in enumerate(BOMBS.items()))
            + "{% endif %}" + template)
