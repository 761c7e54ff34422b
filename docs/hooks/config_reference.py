"""MkDocs hook: the configuration reference, generated at build time from the code.

A page holding ``<!-- config-reference -->`` gets one table per section of ``AsyncGRPOConfig``'s fields
(name, type, default, the field's ``metadata["help"]``), read with ``dataclasses.fields()``; a field whose
type is itself a dataclass is documented the same way under its own heading, recursively. Sections follow
the ``# Section.`` comments of the class bodies when the source is at hand. ``<!-- trl-fields -->`` becomes
the tables of ``harness_trainer/trainer/config/trl_fields.py``: TRL's names taken under another name, refused
unless their value means what the trainer does anyway, and ignored, each group with its reason.

Nothing here is checked in as text, so the page cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import html
import inspect
import re
import sys
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MARKER = "<!-- config-reference -->"
TRL_MARKER = "<!-- trl-fields -->"
SECTION = re.compile(r"^(\s+)# (.{1,60}?)\.?\s*$")


def _imports() -> tuple[type, Any]:
    if str(ROOT) not in sys.path:  # `mkdocs build` from another folder still documents this checkout
        sys.path.insert(0, str(ROOT))
    from harness_trainer.trainer.config import trl_fields
    from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig

    return AsyncGRPOConfig, trl_fields


def _text(value: str) -> str:
    """Markdown table cell text: HTML escaped outside code spans, pipes and newlines made harmless."""
    parts = value.replace("\n", " ").split("`")
    parts = [p if i % 2 else html.escape(p, quote=False) for i, p in enumerate(parts)]
    return "`".join(parts).replace("|", "\\|")


def _code(value: str) -> str:
    """Inline code that survives a table cell (a pipe in a Markdown code span would end the cell)."""
    return "<code>" + html.escape(value.replace("\n", " "), quote=False).replace("|", "&#124;") + "</code>"


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        try:
            value = f.default_factory()
        except Exception:  # a factory that needs more than nothing: say so rather than fail the build
            return "(computed)"
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return f"a `{type(value).__name__}` (below)"
    return _code(repr(value))


def _type_name(f: dataclasses.Field[Any]) -> str:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", repr(f.type))
    return _code(str(kind).replace("typing.", ""))


def _nested(cls: type, name: str) -> type | None:
    """The dataclass a field holds (also inside ``X | None``), or None."""
    try:
        hint = typing.get_type_hints(cls)[name]
    except Exception:
        return None
    candidates = [hint, *typing.get_args(hint)]
    return next((c for c in candidates if isinstance(c, type) and dataclasses.is_dataclass(c)), None)


def _sections(cls: type) -> dict[str, str]:
    """Field name → the ``# Section.`` comment above it in its class body (empty when unknown)."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            lines, _ = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("class ")), 0)
        body_indent = None
        section, previous = "", ""
        for line in lines[start + 1 :]:
            stripped = line.strip()
            indent = len(line) - len(line.lstrip())
            if stripped and body_indent is None:
                body_indent = indent
            after_break = not previous.strip() or previous.strip().endswith(('"""', "'''"))
            match = SECTION.match(line)
            if match and len(match.group(1)) == body_indent and after_break:
                section = match.group(2)
            elif stripped and indent == body_indent:
                name = re.match(r"(\w+)\s*:", stripped)
                if name:
                    found.setdefault(name.group(1), section)
            previous = line
    return found


def config_reference(
    cls: type, prefix: str = "", level: int = 2, supported: frozenset[str] = frozenset()
) -> str:
    """Markdown for every field of dataclass ``cls``, nested dataclasses under their own heading."""
    fields = dataclasses.fields(cls)
    sections = _sections(cls)
    order: list[str] = []
    for f in fields:
        if sections.get(f.name, "") not in order:
            order.append(sections.get(f.name, ""))
    out: list[str] = []
    nested: list[tuple[str, type]] = []
    for section in order:
        if section or len(order) > 1:
            out += [f"{'#' * level} {section or 'Other fields'}", ""]
        out += ["| field | type | default | what it does |", "|---|---|---|---|"]
        for f in fields:
            if sections.get(f.name, "") != section:
                continue
            inner = _nested(cls, f.name)
            name = f"{prefix}{f.name}"
            help_text = _text(str(f.metadata.get("help", "")))
            if f.name in supported and not prefix:
                help_text += " *(TRL's name and meaning)*"
            if inner is not None:
                nested.append((name, inner))
                help_text += f" See [`{name}`](#{_anchor(name)})."
            out.append(f"| `{name}` | {_type_name(f)} | {_default(f)} | {help_text} |")
        out.append("")
    for name, inner in nested:
        doc = inspect.getdoc(inner) or ""
        title = f"`{name}`: `{inner.__name__}`"
        summary = re.sub(r":\w+:`", "`", doc.split("\n\n")[0])  # Sphinx roles: plain code spans
        out += [f"{'#' * level} {title} {{ #{_anchor(name)} }}", "", _text(summary), ""]
        out.append(config_reference(inner, prefix=f"{name}.", level=min(level + 1, 6)))
    return "\n".join(out)


def _anchor(name: str) -> str:
    return "field-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def trl_tables(trl_fields: Any) -> str:
    out = ["### TRL names taken under another name", "", "| TRL's field | this config's field |", "|---|---|"]
    out += [f"| `{trl}` | `{ours}` |" for trl, ours in sorted(trl_fields.TRL_ALIASES.items())]
    out += ["", "### Refused unless the value means what this trainer does", ""]
    out += ["| TRL's fields: the values accepted | why |", "|---|---|"]
    for reason, names in trl_fields.TRL_REFUSED:
        cell = "<br>".join(
            f"`{name}`: " + (", ".join(_code(repr(v)) for v in accepted) if accepted else "none")
            for name, accepted in sorted(names.items())
        )
        out.append(f"| {cell} | {_text(reason)} |")
    out += ["", "### Accepted and ignored, with the reason logged", "", "| TRL's fields | why |", "|---|---|"]
    for reason, names in trl_fields.TRL_IGNORED:
        out.append(f"| {', '.join(f'`{n}`' for n in sorted(names))} | {_text(reason)} |")
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if CONFIG_MARKER not in markdown and TRL_MARKER not in markdown:
        return markdown
    config_cls, trl_fields = _imports()
    supported = frozenset(name for name, ours in trl_fields.TRL_SUPPORTED.items() if name == ours)
    markdown = markdown.replace(CONFIG_MARKER, config_reference(config_cls, level=3, supported=supported))
    return markdown.replace(TRL_MARKER, trl_tables(trl_fields))
