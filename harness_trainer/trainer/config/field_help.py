"""A config field's metadata: its help text, which the CLI's ``--help`` and the docs' tables show."""

from __future__ import annotations

from typing import Any


def field_help(text: str, **extra: Any) -> dict[str, Any]:
    """``metadata=`` of a dataclass field: ``help``, plus ``extra`` options of ``HfArgumentParser``'s
    flag (``aliases=[]``)."""
    return {"help": text, **extra}
