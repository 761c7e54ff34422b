"""The report's parts: a measurement row (value, baseline, ratios over repeats), a benchmark's section, and
the Markdown table both render into (see :mod:`benchmarks.report`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Row:
    """One measurement: its value and its baseline's (formatted, with units), and their ratio."""

    measure: str
    value: str
    baseline: str = "-"
    ratios: list[float] = field(default_factory=list)  # one per repeat (or one in all)

    def cells(self) -> tuple[str, ...]:
        if not self.ratios:
            return (self.measure, self.value, self.baseline, "-", "-", "-")
        low, high = min(self.ratios), max(self.ratios)
        spread = f"{low:.2f}-{high:.2f}" if len(self.ratios) > 1 else "-"
        median = statistics.median(self.ratios)
        return (self.measure, self.value, self.baseline, f"{median:.2f}x", spread, str(len(self.ratios)))


@dataclass
class Section:
    """One benchmark's part of the report."""

    name: str
    headline: str = ""
    rows: list[Row] = field(default_factory=list)
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: str = ""  # more Markdown after the table (the soak's waves)
    error: str = ""  # why there is no result, when there is none
    seconds: float | None = None  # the benchmark's wall time, start to exit


def spread_of(values: Sequence[float]) -> str:
    """``median x [min-max]`` of ratios, for a headline."""
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def cell(text: str) -> str:
    """``text`` safe in a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
