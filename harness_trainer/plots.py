"""Training curves from a run's ``metrics.jsonl`` as one PNG: reward (± reward_std; in a run that mixes
harnesses, each harness's reward too, joined across the steps it had groups in), held-out eval
(``eval/pass@1`` and ``eval/pass@k``, at the steps that evaluated; in a mix, each harness's pass@1 too,
``eval/harness/<name>/pass@1``), completion length, tool calls per rollout, loss and seconds per step.

Drawn with matplotlib's Agg canvas on a bare ``Figure`` (no pyplot, no display, no global state), so it
works on a headless host and from any thread. A metric a run did not log leaves its panel empty with a
note; a ``null`` value (a non-finite number) leaves a gap, except in a panel of sparse metrics (eval), which
joins the steps that logged it. Steps follow the latest timeline: when a resumed
run logged a step again, the earlier run's lines from that step on are left out. Importing this module
loads neither matplotlib nor pydantic (the CLI builds its parser with :func:`add_plot_arguments`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness_trainer.trainer.reporting import METRICS_FILE

CURVES_FILE = "curves.png"
INSTALL_HINT = "pip install 'harness-trainer[plots]'"
FIGURE_SIZE_IN = (14.0, 7.0)
DPI = 100
"""The PNG is ``FIGURE_SIZE_IN × DPI`` pixels: 1400 × 700."""

PANELS: tuple[tuple[str, str, str | None], ...] = (
    ("reward", "reward (band: ± reward_std)", "reward_std"),
    ("eval/pass@1", "eval: pass@1 (dashed: pass@k)", None),
    ("completions/mean_length", "completion tokens per rollout", None),
    ("tools/call_frequency", "tool calls per rollout", None),
    ("loss", "loss", None),
    ("perf/step_s", "seconds per step", None),
)
"""Each panel: the metric, its title, and the metric drawn as a ± band around it (if any)."""
SPARSE = {"eval/pass@1": "eval/pass@k"}
"""Metrics logged only at some steps, joined across the others; each with a second metric drawn dashed."""


def metrics_file(path: str | os.PathLike[str]) -> Path:
    """``path`` itself, or the ``metrics.jsonl`` inside it when it is a run folder."""
    path = Path(path)
    return path / METRICS_FILE if path.is_dir() else path


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The logged lines of a ``metrics.jsonl`` (or of the run folder holding one), in step order, latest
    timeline only.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not a JSON object with an integer ``step``; the message names file and line.
    """
    from harness_trainer.trainer.feed.rollout_log import latest_steps, read_jsonl

    file = metrics_file(path)

    def entries() -> Iterator[tuple[int, None, dict[str, Any]]]:
        for number, _, values in read_jsonl(file):
            step = values.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                raise ValueError(f"{file}:{number}: a metrics line needs an integer 'step'")
            yield step, None, values

    return [lines[-1] for lines in latest_steps(entries()).values()]


def plot_metrics(metrics_path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Draw the run's curves (see the module docstring) to ``out`` (default: ``curves.png`` beside the
    metrics file) and return its path.

    Raises:
        FileNotFoundError: no metrics file.
        ValueError: the file has no metrics lines, or a malformed one (named by file and line).
        ImportError: matplotlib is not installed; the message says what to install.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(f"plotting needs matplotlib: {INSTALL_HINT}") from exc
    file = metrics_file(metrics_path)
    lines = read_metrics(file)
    if not lines:
        raise ValueError(f"{file}: no metrics lines to plot")
    target = Path(out) if out is not None else file.with_name(CURVES_FILE)
    steps = [line["step"] for line in lines]

    figure = Figure(figsize=FIGURE_SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(f"{file.resolve().parent.name}: {len(lines)} logged steps")
    for axes, (name, title, band) in zip(figure.subplots(2, 3).flat, PANELS, strict=True):
        axes.set_title(title, fontsize=10)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        if name in SPARSE:
            _draw_sparse(axes, lines, name)
            continue
        values = _series(lines, name)
        if all(math.isnan(value) for value in values):
            axes.text(0.5, 0.5, f"{name}: not logged", ha="center", va="center", transform=axes.transAxes)
            continue
        axes.plot(steps, values, marker="." if len(steps) < 50 else None, linewidth=1.5)
        spread = _series(lines, band) if band is not None else None
        if spread is not None and not all(math.isnan(value) for value in spread):
            lower = [value - width for value, width in zip(values, spread, strict=True)]
            upper = [value + width for value, width in zip(values, spread, strict=True)]
            axes.fill_between(steps, lower, upper, alpha=0.25, linewidth=0)
        if name == "reward":
            _draw_harnesses(axes, lines)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, format="png")
    return target


def logged_points(lines: list[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    """The steps that logged ``name`` as a number, and its values there."""
    points = [(line["step"], value) for line, value in zip(lines, _series(lines, name), strict=True)]
    kept = [(step, value) for step, value in points if not math.isnan(value)]
    return [step for step, _ in kept], [value for _, value in kept]


def _draw_sparse(axes: Any, lines: list[dict[str, Any]], name: str) -> None:
    steps, values = logged_points(lines, name)
    if not steps:
        axes.text(0.5, 0.5, f"{name}: not logged", ha="center", va="center", transform=axes.transAxes)
        return
    axes.plot(steps, values, marker="o", linewidth=1.5, label=name)
    second_steps, second = logged_points(lines, SPARSE[name])
    if second_steps:
        axes.plot(second_steps, second, marker="o", linestyle="--", linewidth=1.0, label=SPARSE[name])
    if name == "eval/pass@1":
        _draw_eval_harnesses(axes, lines)
    axes.set_ylim(-0.05, 1.05)


def harness_eval_curves(lines: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Each harness's held-out pass@1 (``eval/harness/<name>/pass@1``) at the steps that logged it, by
    harness name; {} for a run of one harness."""
    from harness_trainer.trainer.feed.evaluation import HARNESS_PREFIX, harness_names

    names = sorted({name for line in lines for name in harness_names(line)})
    return {name: logged_points(lines, f"{HARNESS_PREFIX}{name}/pass@1") for name in names}


def _draw_eval_harnesses(axes: Any, lines: list[dict[str, Any]]) -> None:
    curves = harness_eval_curves(lines)
    for name, (steps, values) in curves.items():
        axes.plot(steps, values, marker=".", linestyle=":", linewidth=1.0, label=f"{name} pass@1")
    if curves:
        axes.legend(fontsize=8)


def _draw_harnesses(axes: Any, lines: list[dict[str, Any]]) -> None:
    """Each harness's reward (``harness/<name>/reward``), where a run mixes harnesses."""
    from harness_trainer.trainer.step.harness_metrics import harness_names

    names = sorted({name for line in lines for name in harness_names(line)})
    if not names:
        return
    axes.lines[0].set_label("all")
    for name in names:
        steps, values = logged_points(lines, f"harness/{name}/reward")
        if steps:
            axes.plot(steps, values, linewidth=1.0, linestyle="--", marker=".", label=name)
    axes.legend(fontsize=8)


def _series(lines: list[dict[str, Any]], name: str) -> list[float]:
    """One metric per line; NaN where it was not logged or was logged as null (so the curve has a gap)."""
    values = []
    for line in lines:
        value = line.get(name)
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        values.append(float(value) if numeric else math.nan)
    return values


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``harness-trainer plot METRICS_JSONL_OR_RUN_DIR [-o FILE]``."""
    parser.add_argument("metrics", type=Path, help="a metrics.jsonl, or the run folder holding one")
    parser.add_argument(
        "-o", "--output", type=Path, default=None, help=f"PNG to write (default: {CURVES_FILE} beside it)"
    )


def run_plot(args: argparse.Namespace) -> int:
    """``harness-trainer plot``: print the PNG's path; 2 with a message when the metrics cannot be read."""
    try:
        path = plot_metrics(args.metrics, args.output)
    except (OSError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
