"""MkDocs hook: the reference sections generated from the code at build time.

A page asks for one with a marker line, `<!-- generated: NAME [ARG] -->`, which the build replaces
with the section (markdown): the CLI's command tree (`cli`), the settings in batchinf/config.py
(`settings`), the manifest's JSON Schema (`manifest`), the REST API's OpenAPI document (`rest`),
the module map (`modules`) and a benchmark's docstring (`benchmark NAME`). Nothing here is typed by
hand, so the pages stay true as the code changes. `render(text)` is what the hook applies; the
tests call it too.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARKER = re.compile(r"^<!-- generated: (\w+)(?: (\S+))? -->$", re.MULTILINE)


def cell(text: Any) -> str:
    """Text fit for one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def first_sentence(doc: str | None) -> str:
    """The first sentence of a docstring's first paragraph."""
    para = " ".join((doc or "").strip().split("\n\n")[0].split())
    match = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", para)
    return para[:match.start() + 1] if match else para


# --- CLI: the click command tree of batchinf.cli:main ---------------------------------------------

def cli_reference() -> str:
    import click

    from batchinf.cli import main

    out: list[str] = []

    def walk(cmd: click.Command, path: list[str], parent: click.Context | None) -> None:
        ctx = click.Context(cmd, info_name=path[-1], parent=parent)
        if len(path) > 1:
            out.append(f"{'#' * min(len(path), 4)} `{' '.join(path)}`\n")
        out.append(f"```\n{cmd.get_usage(ctx)}\n```\n")
        if cmd.help:
            out.append(inspect.cleandoc(cmd.help) + "\n")
        rows = [r for p in cmd.get_params(ctx) if isinstance(p, click.Option) and "--help" not in p.opts
                and (r := p.get_help_record(ctx))]
        args = [p.human_readable_name for p in cmd.params if isinstance(p, click.Argument)]
        if args:
            out.append("Arguments: " + ", ".join(f"`{a}`" for a in args) + "\n")
        if rows:
            out.append("| option | meaning |\n|---|---|")
            out.extend(f"| `{cell(names)}` | {cell(text)} |" for names, text in rows)
            out.append("")
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    walk(sub, [*path, name], ctx)

    walk(main, ["batchinf"], None)
    return "\n".join(out)


# --- settings: the fields of batchinf/config.py's Settings and their variables ---------------------

READERS = {"_int", "_float", "_text", "_flag", "_choice", "_optional_float", "_json_object"}


def _constant(node: ast.expr) -> Any:
    """The value of a constant expression (`64 << 20`, `6 * 3600`), or None."""
    if not all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop))
               for n in ast.walk(node)):
        return None
    return eval(compile(ast.Expression(node), "<config>", "eval"), {"__builtins__": {}})


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value} ({value >> 30} GiB)" if value % (1 << 30) == 0 else f"{value} ({value >> 20} MiB)"
    return "unset" if value is None else str(value)


def _default(node: ast.expr) -> str:
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_text" and node.args:
        return f"`{node.args[0].value}`"
    if isinstance(node, ast.Constant) and node.value is None:
        return "unset"
    value = _constant(node)
    return _show(value) if value is not None else f"`{ast.unparse(node)}`"


def _defaults(tree: ast.Module) -> dict[str, str]:
    """Variable -> its default as load_settings() applies it (source text where it is computed)."""
    load = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "load_settings")
    out: dict[str, str] = {}
    for node in ast.walk(load):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            call = node.values[0]
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "_text" and call.args:
                out.setdefault(call.args[0].value, _default(node.values[-1]))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in READERS and node.args:
            if not isinstance(node.args[0], ast.Constant):
                continue
            index = 2 if node.func.id == "_choice" else 1
            out.setdefault(node.args[0].value, _default(node.args[index]) if len(node.args) > index else "unset")
    return out


LEADING = re.compile(r"^([A-Z][A-Z0-9_]+(?:(?:, else |, | / | and )[A-Z][A-Z0-9_]+)*)[:;]?\s*")


def _settings(source: str, defaults: dict[str, str]) -> list[tuple[list[str], str, list[str]]]:
    """(variables, meaning, fields) for the Settings class, in its order: a field's trailing
    comment names its variable first; a field whose comment does not continues the one above."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("class Settings"))
    out: list[tuple[list[str], str, list[str]]] = []
    for line in lines[start + 1:]:
        if line.strip().startswith(("@", "def ")):
            break
        field = re.match(r"^    (\w+): [^#]+?(?:#\s?(.*))?$", line)
        comment = field.group(2) or "" if field else line.strip()[2:]
        if not field and not (out and re.match(r"^\s+# ", line) and not line.lstrip().startswith("# ---")):
            continue
        head = LEADING.match(comment) if field else None
        names = re.findall(r"[A-Z][A-Z0-9_]+", head.group(1)) if head else []
        if field and (names or not out):
            out.append((names, comment[head.end():] if head else comment, [field.group(1)]))
            continue
        variables, meaning, fields = out[-1]
        more = [n for n in re.findall(r"\b[A-Z][A-Z0-9_]+[A-Z0-9]\b", comment) if n in defaults and n not in variables]
        out[-1] = (variables + (more if field else []), f"{meaning} {comment}", fields + ([field.group(1)] if field else []))
    return out


def settings_reference() -> str:
    from batchinf import config

    source = Path(config.__file__).read_text()
    defaults = _defaults(ast.parse(source))
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    seen: set[str] = set()
    for variables, meaning, fields in _settings(source, defaults):
        if fields == ["limits"]:
            for var, default, what in config.LIMITS.values():
                seen.add(var)
                rows.append(f"| `{var}` | {cell(_show(default))} | the operator's bound on {cell(what)} "
                            "(per tenant: `batchinf tenant limit`) |")
            continue
        variables = [v for v in variables if v not in seen]
        if not variables:
            continue
        seen.update(variables)
        shown = " / ".join(f"`{v}`" for v in variables)
        default = " / ".join(cell(defaults.get(v, "unset")) for v in variables)
        rows.append(f"| {shown} | {default} | {cell(meaning)} |")
    return "\n".join(rows) + "\n"


# --- the job manifest: its JSON Schema (batchinf.manifest.job_schema) -----------------------------

def _type(spec: dict[str, Any]) -> str:
    if "$ref" in spec:
        return spec["$ref"].rsplit("/", 1)[-1].rsplit("__", 1)[-1]
    if "enum" in spec:
        return " \\| ".join(f"`{v}`" for v in spec["enum"])
    if "anyOf" in spec:
        return " or ".join(_type(s) for s in spec["anyOf"])
    kind = spec.get("type", "any")
    if kind == "array":
        return f"list of {_type(spec.get('items', {}))}"
    return " or ".join(kind) if isinstance(kind, list) else str(kind)


def _properties(schema: dict[str, Any]) -> list[str]:
    required = set(schema.get("required", ()))
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, spec in schema.get("properties", {}).items():
        default = "required" if name in required else (f"`{json.dumps(spec['default'])}`" if "default" in spec else "")
        bounds = ", ".join(f"{k} {spec[k]}" for k in ("minimum", "exclusiveMinimum", "maximum", "maxLength")
                           if k in spec and abs(spec[k]) < 1 << 62)
        text = cell(spec.get("description", "")) + (f" ({bounds})" if bounds else "")
        rows.append(f"| `{name}` | {_type(spec)} | {default} | {text} |")
    return rows


def manifest_reference() -> str:
    from batchinf.manifest import job_schema

    schema = job_schema()
    out = [cell(schema.get("description", "")), "", "## Top level", "", *_properties(schema), ""]
    nested = {name: spec for name, spec in schema["properties"].items() if spec.get("properties")}
    for name, spec in nested.items():
        out += [f"## `{name}`", "", cell(spec.get("description", "")), "", *_properties(spec), ""]
    for name, spec in schema["$defs"].items():
        out += [f"## {name}", "", cell(spec.get("description", "")), "", *_properties(spec), ""]
    return "\n".join(out)


# --- REST: the app's OpenAPI document ---------------------------------------------------------------

def rest_reference() -> str:
    from batchinf.api.app import create_app

    doc = create_app().openapi()
    out = [f"OpenAPI {doc['openapi']}, {cell(doc['info'].get('title', ''))} {doc['info'].get('version', '')}: "
           "the same document `batchinf serve` serves at `/openapi.json`.", ""]
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            out.append(f"## `{method.upper()} {path}`\n")
            text = op.get("description") or op.get("summary") or ""
            if text:
                out.append(inspect.cleandoc(text) + "\n")
            params = op.get("parameters", [])
            if params:
                out += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
                out += [f"| `{p['name']}` | {p['in']} | {_type(p.get('schema', {}))} | {'yes' if p.get('required') else ''} "
                        f"| {cell(p.get('description', ''))} |" for p in params]
                out.append("")
            body = op.get("requestBody", {}).get("content", {})
            if body:
                out.append("Request body: " + ", ".join(f"`{kind}`" for kind in body) + "\n")
            responses = op.get("responses", {})
            out.append("Responses: " + ", ".join(
                f"`{code}` {cell(r.get('description', ''))}" for code, r in responses.items()) + "\n")
    return "\n".join(out)


# --- the module map: every layer's modules and what each is for -------------------------------------

def layers() -> list[tuple[str, ...]]:
    """LAYERS of tests/unit/test_architecture.py, the rule the import graph is checked against, read
    from its source (a test module is not imported)."""
    tree = ast.parse((ROOT / "tests" / "unit" / "test_architecture.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "LAYERS")
    return ast.literal_eval(node.value)


def modules_reference() -> str:
    from tests.helpers.imports import module_files

    files = {**module_files(ROOT, "batchinf"),
             **{f"batchinf.{m}": p for m, p in module_files(ROOT, "workers").items()}}
    LAYERS = layers()
    prefixes = [p for layer in LAYERS for p in layer]

    def owner(module: str) -> str | None:
        hits = [p for p in prefixes if module == p or module.startswith(p + ".")]
        return max(hits, key=len) if hits else None

    out = ["| layer | module | what it does | modules in it |", "|---|---|---|---|"]
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            path = files.get(prefix)
            doc = ast.get_docstring(ast.parse(path.read_text())) if path else None
            inside = sorted(m.rsplit(".", 1)[-1] for m in files
                            if m.startswith(prefix + ".") and owner(m) == prefix and m.count(".") == prefix.count(".") + 1)
            name = prefix.removeprefix("batchinf.")
            kind = "/" if path and path.name == "__init__.py" else ".py"
            shown = f"`{name.replace('.', '/')}{kind}`"
            out.append(f"| {i} | {shown} | {cell(first_sentence(doc))} | {', '.join(f'`{m}`' for m in inside)} |")
    return "\n".join(out) + "\n"


# --- benchmarks: each one's own description ----------------------------------------------------------

def benchmark_reference(name: str) -> str:
    path = ROOT / "benchmarks" / f"{name}.py"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return f"`benchmarks/{name}.py` describes itself (`python benchmarks/{name}.py --help`):\n\n```text\n{doc}\n```\n"


GENERATORS: dict[str, Callable[..., str]] = {
    "cli": cli_reference,
    "settings": settings_reference,
    "manifest": manifest_reference,
    "rest": rest_reference,
    "modules": modules_reference,
    "benchmark": benchmark_reference,
}


def render(markdown: str) -> str:
    """The page with every `<!-- generated: ... -->` marker replaced by its section."""
    def section(match: re.Match[str]) -> str:
        name, arg = match.group(1), match.group(2)
        return GENERATORS[name](*([arg] if arg else []))
    return MARKER.sub(section, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return render(markdown)
