"""Metrics of a run: always one JSON line per log in ``output_dir/metrics.jsonl``, plus the trackers named.

``metrics.jsonl`` is the durable record: each line is ``{"step": N, "time": <unix seconds>, <metric>: <value>,
…}``, appended and flushed as it is logged (a resumed run appends to the same file), with non-finite values
written as ``null`` so every line is valid JSON. Trackers are named like transformers' ``report_to``:
``"none"``, ``"all"`` (every installed one), or any of :data:`BACKENDS` as a string, a comma-separated
string or a list. TensorBoard writes to ``output_dir/runs/<run_name>``, wandb under ``output_dir/wandb``
(``WANDB_MODE=offline`` keeps it local), trackio to its local database (``TRACKIO_DIR``) unless told to use
a Space. Tracker libraries are imported only when asked for.
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

METRICS_FILE = "metrics.jsonl"
INSTALL_HINT = "pip install 'harness-trainer[tracking]'"


@dataclass(frozen=True)
class RunInfo:
    """What every tracker is opened with."""

    output_dir: Path
    run_name: str
    project: str
    config: dict[str, Any] | None


class Backend(Protocol):
    """One tracker: receives every logged step, closed once at the end."""

    def log(self, metrics: dict[str, float | int], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardBackend:
    """Scalars through ``torch.utils.tensorboard``; the config as a text entry."""

    def __init__(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run.output_dir / "runs" / run.run_name))
        if run.config:
            self._writer.add_text("config", f"```\n{json.dumps(run.config, indent=2, default=str)}\n```")

    def log(self, metrics: dict[str, float | int], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbBackend:
    """A wandb run of its own (not the global ``wandb.run``), with its files under ``output_dir``."""

    def __init__(self, run: RunInfo) -> None:
        import wandb

        self._run = wandb.init(project=run.project, name=run.run_name, config=run.config, dir=run.output_dir)

    def log(self, metrics: dict[str, float | int], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class TrackioBackend:
    """A trackio run, logged through the run object rather than trackio's module-level current run."""

    def __init__(self, run: RunInfo) -> None:
        import trackio

        self._run = trackio.init(project=run.project, name=run.run_name, config=run.config)

    def log(self, metrics: dict[str, float | int], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


@dataclass(frozen=True)
class BackendSpec:
    """A tracker: the package whose presence means it is installed, and how to open it."""

    package: str
    open: Callable[[RunInfo], Backend]


BACKENDS: dict[str, BackendSpec] = {
    "tensorboard": BackendSpec("tensorboard", TensorBoardBackend),
    "wandb": BackendSpec("wandb", WandbBackend),
    "trackio": BackendSpec("trackio", TrackioBackend),
}
REPORT_TO_CHOICES = ("none", "all", *BACKENDS)


def is_installed(package: str) -> bool:
    """Whether ``package`` can be imported, without importing it."""
    return importlib.util.find_spec(package) is not None


def resolve_report_to(
    report_to: str | Sequence[str] | None, *, installed: Callable[[str], bool] = is_installed
) -> list[str]:
    """The tracker names ``report_to`` asks for, checked: ``"all"`` gives every installed one.

    Raises:
        ValueError: an unknown name, or ``"none"``/``"all"`` beside other names.
        ImportError: a tracker named explicitly is not installed; the message says what to install.
    """
    if report_to is None:
        return []
    parts = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names = list(dict.fromkeys(part.strip() for part in parts if part.strip()))
    unknown = [name for name in names if name not in REPORT_TO_CHOICES]
    if unknown:
        raise ValueError(f"unknown report_to {unknown}; valid: {', '.join(REPORT_TO_CHOICES)}")
    if {"none", "all"} & set(names):
        if len(names) > 1:
            raise ValueError(f"report_to {names}: 'none' and 'all' stand alone")
        return [] if names == ["none"] else [n for n, spec in BACKENDS.items() if installed(spec.package)]
    missing = [BACKENDS[name].package for name in names if not installed(BACKENDS[name].package)]
    if missing:
        raise ImportError(
            f"report_to asks for {', '.join(missing)}, not installed: {INSTALL_HINT} (or pip install "
            f"{' '.join(missing)})"
        )
    return names


class MetricsReporter:
    """Writes every logged step to ``metrics.jsonl`` and to the trackers of ``report_to``.

    Usable as a context manager; :meth:`close` is idempotent.

    Raises (at construction):
        ValueError: ``report_to`` names an unknown tracker.
        ImportError: ``report_to`` names a tracker that is not installed.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        report_to: str | Sequence[str] | None,
        *,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        project: str = "harness-trainer",
    ) -> None:
        self.backend_names = resolve_report_to(report_to)
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # Like transformers, where run_name defaults to output_dir: the folder names the run.
        run = RunInfo(self.output_dir, run_name or self.output_dir.resolve().name, project, config)
        with ExitStack() as stack:
            self._jsonl = stack.enter_context(open(self.output_dir / METRICS_FILE, "a", encoding="utf-8"))
            self._backends: list[Backend] = []
            for name in self.backend_names:
                backend = BACKENDS[name].open(run)
                stack.callback(backend.close)
                self._backends.append(backend)
            # Construction succeeded: keep everything open; on an error above, the stack closes what opened.
            self._stack = stack.pop_all()
        self._closed = False

    def log(self, metrics: Mapping[str, float | int], step: int) -> None:
        """Record ``metrics`` at ``step``.

        Raises:
            ValueError: a metric is named ``step`` or ``time`` (the line's own fields).
            TypeError: a value is not a number (numpy and 0-d torch scalars are).
            RuntimeError: the reporter is closed.
        """
        if self._closed:
            raise RuntimeError("MetricsReporter.log after close")
        values = {key: _number(value) for key, value in metrics.items()}
        clash = {"step", "time"} & values.keys()
        if clash:
            raise ValueError(f"metric names {sorted(clash)} are reserved in {METRICS_FILE}")
        line = {"step": step, "time": time.time()}
        line.update({key: value if math.isfinite(value) else None for key, value in values.items()})
        self._jsonl.write(json.dumps(line, allow_nan=False) + "\n")
        self._jsonl.flush()
        for backend in self._backends:
            backend.log(values, step)

    def close(self) -> None:
        """Finish every tracker and close ``metrics.jsonl``; a second call does nothing."""
        if not self._closed:
            self._closed = True
            self._stack.close()

    def __enter__(self) -> MetricsReporter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _number(value: Any) -> float | int:
    if isinstance(value, numbers.Integral):
        return int(value)
    # __float__ rather than float(value), which would also parse strings.
    if not hasattr(value, "__float__"):
        raise TypeError(f"metric value {value!r} is not a number")
    return float(value)
