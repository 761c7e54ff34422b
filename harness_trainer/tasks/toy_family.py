"""A generated family of toy Harbor tasks with a held-out split: the same skills on unseen instances.

The bundled ``harness_trainer/examples/tasks`` are five different tasks, each one of a kind, so a model
trained on them can only be asked about them. This family is a few shell *skills*, each with a fixed solution
template that mostly copies tokens from the instruction (a file name, a value) into one command, and several
wordings:

- ``write-line``: create ``/app/NAME`` holding the line ``VALUE`` → ``printf '%s\\n' 'VALUE' > /app/NAME``;
- ``make-dir``: create the directory ``/app/NAME`` (two levels deep) → ``mkdir -p /app/NAME``;
- ``copy-file``: copy the existing ``/app/NAME`` to ``/app/VALUE`` → ``cp /app/NAME /app/VALUE``;
- ``delete-file``: delete ``/app/NAME``, keeping ``/app/keep.txt`` → ``rm /app/NAME``.

Contract of :func:`toy_family` (pure: a function of its arguments, no filesystem, no global randomness):

1. Splits ``train`` and ``test``, ``per_skill`` instances of every skill in each; an instance is
   ``(skill, name, value)`` (``value`` is ``""`` where a skill has none) and a wording.
2. Held out: the names and values of one split never appear in the other (each pool is shuffled from
   ``seed`` and cut in two), so no test instance shares its ``(skill, name, value)`` or its instruction
   with any train instance; within a split, every task has its own name. The *pieces* of a test name or
   value (``notes``, ``md``, ``archive``, ``quiet``, ``river``) all occur in train names or values: a
   test instance is a new combination of pieces the warm-up saw, something a tiny model can plausibly
   copy, not a word it never met.
3. Wordings rotate per skill, so every wording of every skill occurs in ``train``.
4. The same arguments give the same tasks, byte for byte.

:func:`write_family` writes them as Harbor task folders (``ROOT/<split>/<skill>-<name>/``: instruction.md,
task.toml, environment/Dockerfile, solution/solve.sh, tests/test.sh). The committed copy is
``harness_trainer/examples/toy-skills`` (``python -m harness_trainer.tasks.toy_family
harness_trainer/examples/toy-skills`` rewrites it; a test checks that it equals the generator's output). The
verifiers check the workspace for real in the sandbox and never pass an untouched one, so the dev loop's
distractor (``ls -la``) is graded 0.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "test")
SKILLS = ("write-line", "make-dir", "copy-file", "delete-file")
DEFAULT_SEED = 0
DEFAULT_PER_SKILL = {"train": 8, "test": 4}
KEEP_FILE = "keep.txt"
KEEP_LINE = "do not delete me"

WORDINGS: dict[str, tuple[str, ...]] = {
    "write-line": (
        "Create the file `/app/{name}` containing exactly one line: `{value}`",
        "Write the line `{value}` to a new file `/app/{name}`.",
        "Make `/app/{name}` a file whose only line is `{value}`.",
    ),
    "make-dir": (
        "Create the directory `/app/{name}`.",
        "Make a new folder at `/app/{name}`.",
        "`/app/{name}` should exist as a directory; create it.",
    ),
    "copy-file": (
        "Copy `/app/{name}` to `/app/{value}`.",
        "Make a copy of the file `/app/{name}` named `/app/{value}`; keep the original.",
        "Duplicate `/app/{name}` as `/app/{value}`.",
    ),
    "delete-file": (
        "Delete the file `/app/{name}`.",
        "Remove `/app/{name}`; leave every other file in `/app` alone.",
        "`/app/{name}` is no longer needed: delete it.",
    ),
}
SOLUTIONS = {
    "write-line": "printf '%s\\n' '{value}' > /app/{name}",
    "make-dir": "mkdir -p /app/{name}",
    "copy-file": "cp /app/{name} /app/{value}",
    "delete-file": "rm /app/{name}",
}
CHECKS = {
    "write-line": "[ -f /app/{name} ] && [ \"$(cat /app/{name})\" = '{value}' ]",
    "make-dir": "[ -d /app/{name} ]",
    "copy-file": "[ -f /app/{value} ] && [ \"$(cat /app/{value})\" = '{content}' ] "
    "&& [ \"$(cat /app/{name})\" = '{content}' ]",
    "delete-file": f"[ ! -e /app/{{name}} ] && [ \"$(cat /app/{KEEP_FILE})\" = '{KEEP_LINE}' ]",
}
WHAT_IS_CHECKED = {
    "write-line": "/app/{name} holds the line '{value}' (a trailing newline is optional)",
    "make-dir": "/app/{name} is a directory",
    "copy-file": "/app/{value} holds what /app/{name} holds, and /app/{name} is still there",
    "delete-file": f"/app/{{name}} is gone and /app/{KEEP_FILE} is untouched",
}

# Name and value pieces: plain lower-case words, safe inside single quotes and in a path.
_STEMS = (
    "notes", "todo", "report", "summary", "draft", "budget", "inbox", "journal", "plan", "agenda",
    "memo", "ledger", "recipe", "diary", "outline", "roster", "invoice", "letter", "schedule", "minutes",
    "checklist", "log", "index", "backlog",
)  # fmt: skip
_EXTENSIONS = ("txt", "md", "log", "cfg")
_DIRS = (
    "archive", "backup", "build", "cache", "drafts", "exports", "images", "logs", "output", "reports",
    "scripts", "shared", "static", "uploads", "vendor", "assets", "media", "results", "staging", "tmp",
)  # fmt: skip
_ADJECTIVES = ("quiet", "green", "rapid", "silver", "bright", "hollow", "gentle", "amber", "frozen", "lucky")
_NOUNS = ("river", "lamp", "falcon", "garden", "engine", "harbor", "meadow", "rocket", "candle", "window")


@dataclass(frozen=True)
class ToyTask:
    """One generated task: ``skill`` applied to ``name`` (and ``value``), told in wording ``wording``."""

    split: str
    skill: str
    name: str
    value: str
    wording: int

    @property
    def folder(self) -> str:
        return f"{self.skill}-{re.sub(r'[^a-z0-9]+', '-', self.name)}"

    @property
    def instruction(self) -> str:
        return WORDINGS[self.skill][self.wording].format(name=self.name, value=self.value) + "\n"

    @property
    def content(self) -> str:
        """The line the workspace's existing ``/app/NAME`` holds (copy-file, delete-file)."""
        return f"the {self.name.split('.')[0]} of this task"

    def files(self) -> dict[str, str]:
        """The task folder's files, relative path → text (``.sh`` files are executable)."""
        fields = {"name": self.name, "value": self.value, "content": self.content}
        setup = {
            "copy-file": f"RUN echo '{self.content}' > /app/{self.name}\n",
            "delete-file": f"RUN echo '{self.content}' > /app/{self.name} "
            f"&& echo '{KEEP_LINE}' > /app/{KEEP_FILE}\n",
        }.get(self.skill, "")
        return {
            "instruction.md": self.instruction,
            "task.toml": _TOML.format(skill=self.skill, split=self.split),
            "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\n" + setup,
            "solution/solve.sh": _SOLVE.format(command=SOLUTIONS[self.skill].format(**fields)),
            "tests/test.sh": _TEST.format(
                what=WHAT_IS_CHECKED[self.skill].format(**fields), check=CHECKS[self.skill].format(**fields)
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


def _cut(pool: list[tuple[str, ...]], counts: dict[str, int], rng: random.Random) -> dict[str, list[tuple]]:
    """``pool`` shuffled, then cut: train takes the first ``counts["train"]`` items, test the next
    ``counts["test"]`` of the others that are made only of pieces some train item has.

    Raises:
        ValueError: the pool holds too few such items.
    """
    pool = list(pool)
    rng.shuffle(pool)
    train = pool[: counts["train"]]
    seen = {piece for item in train for piece in item}
    test = [item for item in pool[counts["train"] :] if seen.issuperset(item)][: counts["test"]]
    if len(train) < counts["train"] or len(test) < counts["test"]:
        raise ValueError(f"the name pools hold too few instances for {counts}")
    return {"train": train, "test": test}


def toy_family(seed: int = DEFAULT_SEED, per_skill: dict[str, int] | None = None) -> dict[str, list[ToyTask]]:
    """Every task of the family, by split (contract in the module docstring).

    Raises:
        ValueError: ``per_skill`` asks for more instances than the name or value pools hold.
    """
    per_skill = {**DEFAULT_PER_SKILL, **(per_skill or {})}
    rng = random.Random(seed)
    # File names per split: one for write-line and delete-file, two for copy-file (source and copy).
    files = _cut([(s, e) for s in _STEMS for e in _EXTENSIONS], {k: 4 * n for k, n in per_skill.items()}, rng)
    dirs = _cut([(a, b) for a in _DIRS for b in _DIRS if a != b], per_skill, rng)
    values = _cut([(a, n) for a in _ADJECTIVES for n in _NOUNS], per_skill, rng)
    family: dict[str, list[ToyTask]] = {}
    for split in SPLITS:
        count = per_skill[split]
        names = iter(".".join(name) for name in files[split])
        tasks = []
        for i in range(count):
            wording = i % len(WORDINGS["write-line"])
            tasks += [
                ToyTask(split, "write-line", next(names), " ".join(values[split][i]), wording),
                ToyTask(split, "make-dir", "/".join(dirs[split][i]), "", wording),
                ToyTask(split, "copy-file", next(names), next(names), wording),
                ToyTask(split, "delete-file", next(names), "", wording),
            ]
        family[split] = sorted(tasks, key=lambda t: t.folder)
    return family


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
