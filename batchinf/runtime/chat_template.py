"""Chat templates, rendered like transformers' apply_chat_template, in a bounded sandbox.

A chat template comes with the model (tokenizer_config.json or GGUF metadata), so it is untrusted
code that runs once per record. Jinja's ImmutableSandboxedEnvironment blocks escapes (dunder
attributes, mutation of the messages); `BoundedEnvironment` also bounds what one render may
cost, so a template with nested `range(100000)` loops, a line that builds a 2 GB string or
`{{ 10**(10**9) }}` fails fast with `TemplateLimitError` instead of hanging a worker:

- `range` is capped at MAX_RANGE items, and every loop iteration counts against MAX_ITERATIONS;
- `**`, `*`, `+`, `%` are intercepted (so Jinja's constant folding never evaluates them at compile
  time): integer results are capped at MAX_INT_BITS, strings and lists at MAX_OUTPUT_CHARS;
- `~` concatenation, calls and filters check their sizes; integer arguments are capped at MAX_ARG;
- a render streams through `template.generate()` and stops past MAX_OUTPUT_CHARS or
  RENDER_SECONDS of wall clock (checked at every loop iteration, operator, call and chunk).

These checks are the first line only: a bundle's template compiles and renders in
`template_sandbox.py`'s process, whose memory and CPU limits stop what they cannot see.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import loopcontrols
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RANGE = 100_000
MAX_ITERATIONS = 1_000_000
MAX_OUTPUT_CHARS = 16 << 20
MAX_INT_BITS = 8192
MAX_ARG = 1 << 20           # an integer argument of a call or filter (widths, counts)
RENDER_SECONDS = 5.0


class TemplateLimitError(jinja2.exceptions.TemplateRuntimeError):
    """A chat template went past one of the render limits."""


@dataclass
class _Budget:
    deadline: float = field(default_factory=lambda: time.monotonic() + RENDER_SECONDS)
    iterations: int = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template ran longer than {RENDER_SECONDS:g} s")

    def iterate(self) -> None:
        self.iterations += 1
        if self.iterations > MAX_ITERATIONS:
            raise TemplateLimitError(f"the chat template ran more than {MAX_ITERATIONS} loop iterations")
        self.tick()


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)


def _budget() -> _Budget:
    b = _BUDGET.get()
    if b is None:           # rendered outside render(): a budget of its own
        b = _Budget()
        _BUDGET.set(b)
    return b


def _sized(value: Any, what: str) -> Any:
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_OUTPUT_CHARS:
        raise TemplateLimitError(f"{what} would build a value of {len(value)} items (limit {MAX_OUTPUT_CHARS})")
    return value


def _check_args(args: tuple, kwargs: dict, what: str) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_ARG:
            raise TemplateLimitError(f"{what} got the argument {v} (limit {MAX_ARG})")


_FIELD_WIDTH = re.compile(r"\d{7,}")
_PERCENT_SPEC = re.compile(r"%[^a-zA-Z%]*[a-zA-Z%]")


def _check_percent(fmt: str, args: Any) -> None:
    """`fmt % args` must not pad to a huge width or precision."""
    specs = _PERCENT_SPEC.findall(fmt)
    if any(_FIELD_WIDTH.search(s) for s in specs):
        raise TemplateLimitError(f"the chat template formats with a width of over {MAX_ARG}")
    if any("*" in s for s in specs):
        _check_args(args if isinstance(args, tuple) else (args,), {}, "a %* format")


def _check_replace(s: str, old: str, new: str) -> None:
    grow = (s.count(old) if old else len(s) + 1) * len(new)
    if len(s) + grow > MAX_OUTPUT_CHARS:
        raise TemplateLimitError(f"a replace would build a string of about {len(s) + grow} characters "
                                 f"(limit {MAX_OUTPUT_CHARS})")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**" and ints and right > 0 and abs(left) > 1:
        if right * abs(left).bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"{left} ** {right} is too large (over {MAX_INT_BITS} bits)")
    elif operator == "*":
        if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"a product is too large (over {MAX_INT_BITS} bits)")
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT_CHARS:
                raise TemplateLimitError(f"repeating {len(seq)} items {n} times is over the limit of "
                                         f"{MAX_OUTPUT_CHARS}")
    elif operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                and len(left) + len(right) > MAX_OUTPUT_CHARS:
            raise TemplateLimitError(f"a concatenation is over the limit of {MAX_OUTPUT_CHARS} items")
    elif operator == "%" and isinstance(left, str):
        _check_percent(left, right)


@jinja2.pass_context
def _loop_budget(context: Any, iterable: Any) -> Any:
    """Wraps every for loop's iterable: each iteration counts against the render's budget."""
    budget = _budget()
    for item in iterable:
        budget.iterate()
        yield item


@jinja2.pass_eval_context
def _bounded_concat(eval_ctx: Any, parts: list) -> str:
    """`a ~ b ~ c`, with its size checked before it is built."""
    strs = [str(p) for p in parts]
    if sum(map(len, strs)) > MAX_OUTPUT_CHARS:
        raise TemplateLimitError(f"a ~ concatenation is over the limit of {MAX_OUTPUT_CHARS} characters")
    return markup_join(parts) if eval_ctx.autoescape else str_join(strs)


def _bounded_filter(name: str, fn: Any) -> Any:
    skip = 2 if hasattr(fn, "jinja_pass_arg") else 1     # env/context, then the filtered value

    @functools.wraps(fn)    # keeps jinja's pass_* marker
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _budget().tick()
        _check_args(args[skip:], kwargs, f"filter {name}")
        values = [a for a in args if isinstance(a, str)]
        if name == "format" and values:
            _check_percent(values[0], tuple(args[args.index(values[0]) + 1:]))
        if name == "replace" and len(values) >= 3:
            _check_replace(*values[:3])
        return _sized(fn(*args, **kwargs), f"filter {name}")
    return wrapper


def _safe_range(*args: int) -> range:
    _check_args(args, {}, "range")     # a bound, before the range object is made
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise TemplateLimitError(f"range of {len(r)} items is over the limit of {MAX_RANGE}")
    return r


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with bounded loops, operators, calls, filters and output."""

    intercepted_binops = frozenset({"**", "*", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}
        self.filters["_loop_budget"] = _loop_budget
        self.filters["_bounded_concat"] = _bounded_concat
        self.globals["range"] = _safe_range
        self.globals.pop("lipsum", None)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, "_loop_budget", [], [], None, None, lineno=loop.lineno)
        for concat in tree.find_all(nodes.Concat):
            concat.nodes = [nodes.Filter(nodes.List(concat.nodes, lineno=concat.lineno), "_bounded_concat",
                                         [], [], None, None, lineno=concat.lineno)]
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _budget().tick()
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _budget().tick()
        _check_args(args, kwargs, f"call of {getattr(__obj, '__name__', type(__obj).__name__)}")
        target = getattr(__obj, "__wrapped__", __obj)      # the sandbox wraps str.format
        owner, method = getattr(target, "__self__", None), getattr(target, "__name__", "")
        if isinstance(owner, str):
            if method in ("format", "format_map") and _FIELD_WIDTH.search(owner):
                raise TemplateLimitError(f"the chat template formats with a width of over {MAX_ARG}")
            if method == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                _check_replace(owner, args[0], args[1])
        return _sized(super().call(__context, __obj, *args, **kwargs), f"call of {method or 'a function'}")


def compile_template(source: str) -> Any:
    """A chat template compiled in the bounded sandbox, with transformers' globals and filters.
    Raises jinja2's TemplateError (syntax) or TemplateLimitError."""
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _bounded_filter("tojson", tojson)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    token = _BUDGET.set(_Budget())      # constant folding at compile time runs under a budget too
    try:
        return env.from_string(source)
    except RecursionError as exc:
        raise TemplateLimitError("the chat template is nested too deeply to compile") from exc
    finally:
        _BUDGET.reset(token)


def render(template: Any, **variables: Any) -> str:
    """Render within the limits: streamed, so the output size and the deadline are checked as it
    grows. Raises jinja2's TemplateError (TemplateLimitError past a limit)."""
    budget = _Budget()
    token = _BUDGET.set(budget)
    try:
        out, size = [], 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateLimitError(f"the chat template's output is over {MAX_OUTPUT_CHARS} characters")
            budget.tick()
            out.append(chunk)
        return "".join(out)
    except RecursionError as exc:
        raise TemplateLimitError("the chat template recursed too deeply") from exc
    except (MemoryError, OverflowError) as exc:
        raise TemplateLimitError(f"the chat template ran out of bounds ({type(exc).__name__}: {exc})") from exc
    finally:
        _BUDGET.reset(token)


def token_text(value: Any) -> str | None:
    if isinstance(value, dict):     # {"content": "<s>", "__type": "AddedToken", ...}
        return value.get("content")
    return value
