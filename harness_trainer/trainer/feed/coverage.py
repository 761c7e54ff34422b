"""Which tasks each harness was trained on: ``output_dir/coverage.json``, in a run that mixes harnesses.

Counted from the groups each step takes (trained or dropped, as ``groups_consumed`` counts them), so a
resumed run continues from its checkpoint's counts (``TrainerState.extra["coverage"]``) and a group the
resume rolls out again is not counted twice. The file, rewritten whole (a temporary file renamed over it)
after each step's groups are taken::

    {"harnesses": ["mini-swe-agent", "opencode"],
     "tasks": {"fix-the-build": {"opencode": {"groups": 2, "rollouts": 8, "scored": 7}}, ...}}

A task a harness never drew has no entry under it. A run of one harness writes no file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from harness_trainer.trainer.step.groups import Group

COVERAGE_FILE = "coverage.json"
COUNTS = ("groups", "rollouts", "scored")


class Coverage:
    """Task × harness counts of the groups steps took (module docstring)."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.tasks: dict[str, dict[str, dict[str, int]]] = {
            str(task): {str(h): {k: int(c.get(k, 0)) for k in COUNTS} for h, c in by.items()}
            for task, by in ((state or {}).get("tasks") or {}).items()
        }

    def add(self, groups: Iterable[Group]) -> bool:
        """Count ``groups`` that ran on a harness of a mix; whether any did."""
        counted = False
        for group in groups:
            if group.harness is None:
                continue
            task = str(group.row.get("task_name", group.row.get("task_index", "?")))
            counts = self.tasks.setdefault(task, {}).setdefault(group.harness, dict.fromkeys(COUNTS, 0))
            counts["groups"] += 1
            counts["rollouts"] += len(group.rollouts)
            counts["scored"] += len(group.scored)
            counted = True
        return counted

    def state_dict(self) -> dict[str, Any]:
        """The counts, JSON-serialisable, as :class:`Coverage` takes them back."""
        harnesses = sorted({h for by in self.tasks.values() for h in by})
        return {"harnesses": harnesses, "tasks": {task: self.tasks[task] for task in sorted(self.tasks)}}

    def write(self, output_dir: str | os.PathLike[str]) -> Path | None:
        """Write ``coverage.json`` into ``output_dir`` (atomically); None when nothing was counted."""
        if not self.tasks:
            return None
        target = Path(output_dir) / COVERAGE_FILE
        partial = target.with_name(f".{COVERAGE_FILE}.tmp")
        partial.write_text(json.dumps(self.state_dict(), indent=1) + "\n")
        os.replace(partial, target)
        return target
