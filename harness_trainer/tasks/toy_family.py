"""A generated family of toy Harbor tasks with a held-out split: the same skills on unseen instances.

The bundled ``harness_trainer/examples/tasks`` are five different tasks, each one of a kind, so a model
trained on them can only be asked about them. This family is a few shell *skills*, each with one solution
template, a closed set of values for its one slot, and several wordings:

- ``make-dir``: create the directory ``/app/VALUE`` → ``mkdir -p /app/VALUE``;
- ``write-word``: ``/app/status.txt`` holds the word ``VALUE`` → ``echo VALUE > /app/status.txt``;
- ``touch-file``: create the empty file ``/app/VALUE.txt`` → ``touch /app/VALUE.txt``;
- ``delete-ext``: delete every ``.VALUE`` file in ``/app``, keeping ``/app/keep.txt`` → ``rm /app/*.VALUE``.

Each skill has four values (plain words, none shared between skills) and three wordings: twelve instances.

Contract of :func:`toy_family` (pure: a function of its arguments, no filesystem, no global randomness):

1. Splits ``train`` and ``test``; an instance is ``(skill, value, wording)``, and ``per_skill`` says how
   many instances of every skill each split holds.
2. Held out: no test instance's ``(skill, value, wording)``, and so no test instruction, occurs in
   ``train``. A test instance is an unseen pairing of a value and a wording that ``train`` holds for that
   skill, each with other partners: solving it means putting together what the instruction asks (its
   wording) with its value, not recalling an instruction seen in training. Test instances of a skill have
   different values, and (at the default counts) every value and every wording of every skill occurs in
   ``train``.
3. The same arguments give the same tasks, byte for byte; the seed picks which pairings are held out.

Why closed sets of values, and not unseen file names: an earlier version of this family held out names
never seen in training (``notes.md`` from ``notes`` and ``md``), so a solution had to copy several tokens
from the instruction. The dev loop's tiny model, warmed up on the train split for as long as a CPU run
allows, did not learn to copy (its solver transcripts stayed near probability 0 on train and test alike);
with one word from a closed set its test split rises with its train split, lagging it (see
``docs/getting-started.md``).

:func:`write_family` writes them as Harbor task folders (``ROOT/<split>/<skill>-<value>-w<wording>/``:
instruction.md, task.toml, environment/Dockerfile, solution/solve.sh, tests/test.sh). The committed copy is
``harness_trainer/examples/toy-skills`` (``python -m harness_trainer.tasks.toy_family
harness_trainer/examples/toy-skills`` rewrites it; a test checks that it equals the generator's output). The
verifiers check the workspace for real in the sandbox and never pass an untouched one, so the dev loop's
distractor (``ls -la``) is graded 0.
"""

from __future__ import annotations

import argparse
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "test")
SKILLS = ("make-dir", "write-word", "touch-file", "delete-ext")
DEFAULT_SEED = 0
DEFAULT_PER_SKILL = {"train": 8, "test": 4}
KEEP_FILE = "keep.txt"
KEEP_LINE = "do not delete me"
STATUS_FILE = "status.txt"

VALUES: dict[str, tuple[str, ...]] = {
    "make-dir": ("build", "cache", "logs", "output"),
    "write-word": ("ready", "done", "failed", "pending"),
    "touch-file": ("notes", "todo", "report", "draft"),
    "delete-ext": ("log", "tmp", "bak", "md"),
}
WORDINGS: dict[str, tuple[str, ...]] = {
    "make-dir": (
        "Create the directory `/app/{value}`.",
        "Make a new folder at `/app/{value}`.",
        "`/app/{value}` should exist as a directory; create it.",
    ),
    "write-word": (
        f"Write the word `{{value}}` to `/app/{STATUS_FILE}`.",
        f"Set the contents of `/app/{STATUS_FILE}` to `{{value}}`.",
        f"`/app/{STATUS_FILE}` must hold just `{{value}}`; write it.",
    ),
    "touch-file": (
        "Create an empty file `/app/{value}.txt`.",
        "Make a new empty file named `{value}.txt` in `/app`.",
        "`/app/{value}.txt` should exist (empty is fine); create it.",
    ),
    "delete-ext": (
        "Delete every `.{value}` file in `/app`.",
        "Remove all the `*.{value}` files from `/app`; keep the rest.",
        "The `.{value}` files in `/app` are no longer needed: delete them.",
    ),
}
SOLUTIONS = {
    "make-dir": "mkdir -p /app/{value}",
    "write-word": f"echo {{value}} > /app/{STATUS_FILE}",
    "touch-file": "touch /app/{value}.txt",
    "delete-ext": "rm /app/*.{value}",
}
CHECKS = {
    "make-dir": "[ -d /app/{value} ]",
    "write-word": f"[ \"$(cat /app/{STATUS_FILE} 2>/dev/null)\" = '{{value}}' ]",
    "touch-file": "[ -f /app/{value}.txt ]",
    "delete-ext": f'[ -z "$(ls /app/*.{{value}} 2>/dev/null)" ] '
    f"&& [ \"$(cat /app/{KEEP_FILE})\" = '{KEEP_LINE}' ]",
}
WHAT_IS_CHECKED = {
    "make-dir": "/app/{value} is a directory",
    "write-word": f"/app/{STATUS_FILE} holds the word '{{value}}'",
    "touch-file": "/app/{value}.txt exists",
    "delete-ext": f"no .{{value}} file is left in /app and /app/{KEEP_FILE} is untouched",
}
SETUP = {
    "delete-ext": f"RUN echo one > /app/one.{{value}} && echo two > /app/two.{{value}} "
    f"&& echo '{KEEP_LINE}' > /app/{KEEP_FILE}\n",
}


@dataclass(frozen=True)
class ToyTask:
    """One generated task: ``skill`` applied to ``value``, told in wording ``wording``."""

    split: str
    skill: str
    value: str
    wording: int

    @property
    def folder(self) -> str:
        return f"{self.skill}-{self.value}-w{self.wording}"

    @property
    def instruction(self) -> str:
        return WORDINGS[self.skill][self.wording].format(value=self.value) + "\n"

    def files(self) -> dict[str, str]:
        """The task folder's files, relative path → text (``.sh`` files are executable)."""
        return {
            "instruction.md": self.instruction,
            "task.toml": _TOML.format(skill=self.skill, split=self.split),
            "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\n"
            + SETUP.get(self.skill, "").format(value=self.value),
            "solution/solve.sh": _SOLVE.format(command=SOLUTIONS[self.skill].format(value=self.value)),
            "tests/test.sh": _TEST.format(
                what=WHAT_IS_CHECKED[self.skill].format(value=self.value),
                check=CHECKS[self.skill].format(value=self.value),
            ),
        }


_TOML = """version = "1.0"

[metadata]
author_name = "harness-trainer"
difficulty = "easy"
category = "shell"
tags = ["toy", "toy-skills", "{skill}"]
skill = "{skill}"
split = "{split}"

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 300.0

[environment]
build_timeout_sec = 120.0
cpus = 1
memory_mb = 1024
storage_mb = 2048
"""
_SOLVE = """#!/bin/bash
# Reference solution (generated by harness_trainer.tasks.toy_family).
set -euo pipefail
{command}
"""
_TEST = """#!/bin/bash
# Verifier (generated by harness_trainer.tasks.toy_family): {what}.
# Writes 1 (solved) or 0 to /logs/verifier/reward.txt; never fails before writing it.
mkdir -p /logs/verifier
if {check}; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def _held_out(skill: str, count: int, rng: random.Random) -> set[tuple[str, int]]:
    """``count`` (value, wording) pairings of ``skill`` for the test split: different values, and wordings
    taken in turn from a seeded start, so that each value and wording keeps other pairings in train."""
    values = list(VALUES[skill])
    rng.shuffle(values)
    start = rng.randrange(len(WORDINGS[skill]))
    return {(value, (start + i) % len(WORDINGS[skill])) for i, value in enumerate(values[:count])}


def toy_family(seed: int = DEFAULT_SEED, per_skill: dict[str, int] | None = None) -> dict[str, list[ToyTask]]:
    """Every task of the family, by split (contract in the module docstring).

    Raises:
        ValueError: ``per_skill`` asks for more test instances of a skill than it has values, or for more
            instances in all than it has pairings.
    """
    per_skill = {**DEFAULT_PER_SKILL, **(per_skill or {})}
    rng = random.Random(seed)
    family: dict[str, list[ToyTask]] = {split: [] for split in SPLITS}
    for skill in SKILLS:
        values, wordings = VALUES[skill], range(len(WORDINGS[skill]))
        if per_skill["test"] > len(values) or sum(per_skill.values()) > len(values) * len(wordings):
            raise ValueError(
                f"skill {skill!r} has too few instances for {per_skill}: {len(values)} values, "
                f"{len(values) * len(wordings)} pairings"
            )
        test = _held_out(skill, per_skill["test"], rng)
        train = [(v, w) for v in values for w in wordings if (v, w) not in test]
        rng.shuffle(train)
        family["test"] += [ToyTask("test", skill, v, w) for v, w in sorted(test)]
        family["train"] += [ToyTask("train", skill, v, w) for v, w in train[: per_skill["train"]]]
    return {split: sorted(tasks, key=lambda t: t.folder) for split, tasks in family.items()}


def write_family(root: Path, seed: int = DEFAULT_SEED, per_skill: dict[str, int] | None = None) -> None:
    """Write :func:`toy_family` under ``root`` as ``root/<split>/<task>/``, replacing those split folders."""
    for split, tasks in toy_family(seed, per_skill).items():
        shutil.rmtree(root / split, ignore_errors=True)
        for task in tasks:
            for relative, text in task.files().items():
                path = root / split / task.folder / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                if path.suffix == ".sh":
                    path.chmod(0o755)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the toy-skills task family (train and test splits).")
    parser.add_argument("root", type=Path, help="the folder to write <split>/<task>/ into")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    write_family(args.root, args.seed)


if __name__ == "__main__":
    main()
