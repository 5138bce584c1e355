"""The settings reference, docs/settings.md, rendered from the `config` package itself: what
each field is called in the environment, its type, its default, and the comment written
above it in the source, so the reference cannot drift from the code.

    .venv/bin/python -m config.reference > docs/settings.md
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import tokenize
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

import config

INTRO = """\
# Settings

Every setting is an environment variable, read when a process starts; "(none)" means unset.
This file is generated from `config/`, one module per concern, and the comments above each
field there: edit those, then run `.venv/bin/python -m config.reference > docs/settings.md`.
"""

BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def render() -> str:
    return "\n".join([INTRO, *(_section(cls) for cls in config.SECTIONS)])


def _section(cls: type[BaseSettings]) -> str:
    module = sys.modules[cls.__module__]
    source = inspect.getsource(module)
    # The docstring's first paragraph, "Title: what it covers.", gives the heading and the line under it.
    summary = " ".join((module.__doc__ or cls.__name__).split("\n\n")[0].split())
    title, _, scope = summary.partition(": ")
    path = Path(inspect.getfile(module)).relative_to(Path(config.__file__).parent.parent)
    where = f"{scope[:1].upper()}{scope[1:].rstrip('.')} (`{path}`)." if scope else f"`{path}`."
    lines = [f"## {title.rstrip('.')}", "", where, "",
             "| variable | type | default | what |", "|---|---|---|---|"]
    for name, annotation, description in _fields(source, cls.__name__):
        field = cls.model_fields[name]
        lines.append(f"| {_env(name, field)} | {_type(annotation, field)} | {_default(field)} | {description} |")
    return "\n".join(lines) + "\n"


def _fields(source: str, class_name: str) -> list[tuple[str, ast.expr, str]]:
    """The fields the class itself declares, in source order, each with its description:
    the comment block directly above it, or above the first field of its group (fields
    not parted by a blank line), plus its own trailing comment. Comments exist only in the
    source, so they come from its tokens."""
    above: dict[int, str] = {}  # line of a comment on a line of its own: its text
    trailing: dict[int, str] = {}  # line of a comment after code: its text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            (above if tok.line.strip().startswith("#") else trailing)[tok.start[0]] = text
    (cls,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == class_name]
    out: list[tuple[str, ast.expr, str]] = []
    group, previous_end = "", 0
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        block: list[str] = []
        line = stmt.lineno - 1
        while line in above:
            block.insert(0, above[line])
            line -= 1
        if block:
            group = " ".join(block)
        elif previous_end != stmt.lineno - 1:
            group = ""
        # The group's comment is written out once, on its first field; a field's own trailing
        # comment says more about it than "As above."
        text = group if block else ("As above." if group else "")
        if stmt.end_lineno in trailing:
            own = trailing[stmt.end_lineno]
            text = f"{text} {own}" if block else own
        # Comments are plain text: keep a `|` from ending the cell and `<host>` from reading as HTML.
        out.append((stmt.target.id, stmt.annotation, text.replace("|", "\\|").replace("<", "\\<")))
        previous_end = stmt.end_lineno or stmt.lineno
    return out


def _env(name: str, field: FieldInfo) -> str:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        names = [str(c) for c in alias.choices]
    elif isinstance(alias, str):
        names = [alias]
    else:
        names = [f"{config.Settings.model_config.get('env_prefix', '')}{name}".upper()]
    return ", ".join(f"`{n}`" for n in names)


def _type(annotation: ast.expr, field: FieldInfo) -> str:
    """The annotation as written, less `| None` (an unset default says that), a Literal as
    its choices, and the field's bounds."""
    parts = []
    stack = [annotation]
    while stack:
        node = stack.pop(0)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            stack[:0] = [node.left, node.right]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Literal":
            choices = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            names = [f"`{ast.literal_eval(c)}`" for c in choices]
            parts.append(" or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names))
        elif ast.unparse(node) != "None":
            parts.append({"SecretStr": "secret", "Path": "path"}.get(ast.unparse(node), ast.unparse(node)))
    bounds = [f"{BOUNDS[k]} {getattr(m, k)}" for m in field.metadata for k in BOUNDS if hasattr(m, k)]
    return ", ".join([" or ".join(parts), *bounds])


def _default(field: FieldInfo) -> str:
    value: Any = field.get_default(call_default_factory=True)
    if value is None or isinstance(value, SecretStr) or "SecretStr" in str(field.annotation):
        return "(none)"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"


if __name__ == "__main__":
    print(render(), end="")
