"""The task folders shipped inside the package, so a checkout and an installed wheel find them the same way.

- :data:`TASKS` (``harness_trainer/examples/tasks``): seven toy Harbor tasks, five in ``train`` and two in
  ``test``, each one of a kind; the dev loop's default ``--tasks``.
- :data:`TOY_SKILLS` (``harness_trainer/examples/toy-skills``): the generated toy-skills family
  (:mod:`harness_trainer.tasks.toy_family`), 800 one-skill ``train`` tasks and 16 held-out ``test`` tasks
  (12 with values training never shows, 4 combining two skills training shows only alone).

They are package data (``pyproject.toml``), so ``pip install .`` (a wheel, a Jobs image) installs them
next to this file. Nothing reads their file modes: verifiers run as ``bash tests/test.sh`` and
solutions are read as text.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS = HERE / "tasks"
TOY_SKILLS = HERE / "toy-skills"
