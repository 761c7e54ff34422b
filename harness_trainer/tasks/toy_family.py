"""A generated family of toy Harbor tasks with a held-out split that no training solution solves.

The bundled ``harness_trainer/examples/tasks`` are five different tasks, each one of a kind, so a model
trained on them can only be asked about them. This family is a few shell *skills*, each with one solution
template with one slot, and two wordings:

- ``make-dir``: create the directory ``/app/run-VALUE`` → ``mkdir -p /app/run-VALUE``;
- ``write-number``: ``/app/status.txt`` holds the number ``VALUE`` → ``echo VALUE > /app/status.txt``;
- ``touch-file``: create the empty file ``/app/report-VALUE.txt`` → ``touch /app/report-VALUE.txt``;
- ``delete-ext``: delete every ``*.VALUE`` file in ``/app``, keeping ``/app/keep.txt`` → ``rm /app/*.VALUE``.

A value is a three-digit number (:data:`VALUES`: every one no template text holds), and every task has its
own: at the default counts ``train`` holds 800 one-skill tasks (200 per skill, 800 values) and ``test`` 12
one-skill tasks (3 per skill) and 4 *two-step* tasks (two skills, two values: the two instructions one after
the other, the solution ``CMD1 && CMD2``, a verifier checking both), 20 values in all.

Contract of :func:`toy_family` (pure: a function of its arguments, no filesystem, no global randomness):

1. Splits ``train`` and ``test``; ``per_skill`` says how many one-skill tasks of every skill each split
   holds, ``combined`` how many two-step tasks ``test`` holds (``train`` holds none).
2. Held out for real: no value of a test task occurs anywhere in ``train`` (the pool is shuffled from
   ``seed`` and cut), so no test task's solution, verifier or expected outcome equals a training task's
   (:mod:`harness_trainer.tasks.held_out` checks a task folder for that, and a test checks the shipped
   copy); replaying a training solution never solves a test task. A two-step task combines two skills that
   ``train`` holds only alone. Solving a test task means copying its number from the instruction into the
   skill's command (and, for a two-step one, doing two skills in one command line).
3. Wordings are taken in turn per skill, so every wording of every skill occurs in both splits.
4. The same arguments give the same tasks, byte for byte; the seed picks the cut of the pool, the wordings'
   start and the two-step pairs.

Why numbers: a value is then a new *combination* of tokens every task shows (the tokenizer splits every
digit on its own, wherever it stands), as a new file name is for a pretrained model, whose every token it has
seen. The two versions before held out words. One held out names that took several tokens the training
split never showed; the next one held out words that were one token each, never seen in training. The tiny
model starts from random weights, and a token that training never shows keeps its random embedding. Its
warm-up learned each skill's format and memorised the training values, but gave an unseen value no more
probability at its slot than chance (0 of 128 held-out samples right after 150 steps). A probe of the tiny
model's shape on an instruction-to-command copy (``benchmarks/learning_search.jsonl``) showed the difference:
with unseen single tokens as values, held-out copies stayed at or below 0.10 for any number of training
values (48, 400 or 1,500); with values made of seen tokens, 48 training values of three digits gave 0.60 of
held-out digits and 0.15 of whole values right, and 200 values of three of 20 letters gave 0.50 of whole
values. The dev loop's own warm-up on 48 training numbers memorised them rather than copying
(``docs/getting-started.md``). With a fresh number for every transcript it trained on, black-box, it copied
held-out numbers (11 of 16 test tasks' commands right, teacher-forced, after 325 steps); with 400 numbers,
about as well (6 of 16 at step 275, rising). Hence 200 training tasks per skill: a warm-up records one task
per skill and wording and makes the others' transcripts from it
(:mod:`harness_trainer.devloop.instances`), so the many tasks cost no more recordings.

:func:`write_family` writes them as Harbor task folders (``ROOT/<split>/<skill>-<value>-w<wording>/``, a
two-step one ``<skill>-<value>-then-<skill>-<value>-w<wording>``: instruction.md, task.toml with the skills
and values under ``[metadata]``, environment/Dockerfile, solution/solve.sh, tests/test.sh). The committed
copy is ``harness_trainer/examples/toy-skills`` (``python -m harness_trainer.tasks.toy_family
harness_trainer/examples/toy-skills`` rewrites it; a test checks that it equals the generator's output). The
verifiers check the workspace for real in the sandbox and never pass an untouched one, so the dev loop's
distractor (``ls -la``) is graded 0.
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "test")
SKILLS = ("make-dir", "write-number", "touch-file", "delete-ext")
DEFAULT_SEED = 0
DEFAULT_PER_SKILL = {"train": 200, "test": 3}
DEFAULT_COMBINED = 4
KEEP_FILE = "keep.txt"
KEEP_LINE = "do not delete me"
STATUS_FILE = "status.txt"
THEN = " && "
"""How a two-step task's solution joins its two commands (one shell command line)."""
DIGITS = 3
"""A value is a number of this many digits (no leading zero)."""

WORDINGS: dict[str, tuple[str, ...]] = {
    "make-dir": (
        "Create the directory `/app/run-{value}`.",
        "Make a new folder at `/app/run-{value}`.",
    ),
    "write-number": (
        f"Write the number {{value}} to `/app/{STATUS_FILE}`.",
        f"Set the contents of `/app/{STATUS_FILE}` to the number {{value}}.",
    ),
    "touch-file": (
        "Create an empty file `/app/report-{value}.txt`.",
        "`/app/report-{value}.txt` should exist (empty is fine); create it.",
    ),
    "delete-ext": (
        "Delete every `*.{value}` file in `/app`.",
        "Remove all the `*.{value}` files from `/app`; keep the rest.",
    ),
}
SOLUTIONS = {
    "make-dir": "mkdir -p /app/run-{value}",
    "write-number": f"echo {{value}} > /app/{STATUS_FILE}",
    "touch-file": "touch /app/report-{value}.txt",
    "delete-ext": "rm /app/*.{value}",
}
CHECKS = {
    "make-dir": "[ -d /app/run-{value} ]",
    "write-number": f"[ \"$(cat /app/{STATUS_FILE} 2>/dev/null)\" = '{{value}}' ]",
    "touch-file": "[ -f /app/report-{value}.txt ]",
    "delete-ext": f'[ -z "$(ls /app/*.{{value}} 2>/dev/null)" ] '
    f"&& [ \"$(cat /app/{KEEP_FILE})\" = '{KEEP_LINE}' ]",
}
WHAT_IS_CHECKED = {
    "make-dir": "/app/run-{value} is a directory",
    "write-number": f"/app/{STATUS_FILE} holds the number {{value}}",
    "touch-file": "/app/report-{value}.txt exists",
    "delete-ext": f"no .{{value}} file is left in /app and /app/{KEEP_FILE} is untouched",
}
SETUP = {
    "delete-ext": f"RUN echo one > /app/one.{{value}} && echo two > /app/two.{{value}} "
    f"&& echo '{KEEP_LINE}' > /app/{KEEP_FILE}\n",
}
PAIRS: tuple[tuple[str, str], ...] = tuple(itertools.combinations(SKILLS, 2))
"""The two-step tasks' skill pairs (in :data:`SKILLS` order): every pair of two different skills."""


@dataclass(frozen=True)
class ToyTask:
    """One generated task: each of ``skills`` applied to its value (``values``, in the same order), told
    in wording ``wording``. One skill: a task of the kind training holds; two: a two-step task (held out
    only), the two instructions one after the other, one command line doing both, a verifier checking
    both."""

    split: str
    skills: tuple[str, ...]
    values: tuple[str, ...]
    wording: int

    @property
    def folder(self) -> str:
        return "-then-".join(f"{s}-{v}" for s, v in zip(self.skills, self.values, strict=True)) + (
            f"-w{self.wording}"
        )

    @property
    def parts(self) -> list[tuple[str, str]]:
        return list(zip(self.skills, self.values, strict=True))

    @property
    def instruction(self) -> str:
        return " ".join(WORDINGS[s][self.wording].format(value=v) for s, v in self.parts) + "\n"

    @property
    def solution(self) -> str:
        """The one command line that solves it."""
        return THEN.join(SOLUTIONS[s].format(value=v) for s, v in self.parts)

    @property
    def expected(self) -> tuple[str, ...]:
        """What its verifier checks, in words: the expected outcome, one line per step."""
        return tuple(WHAT_IS_CHECKED[s].format(value=v) for s, v in self.parts)

    def files(self) -> dict[str, str]:
        """The task folder's files, relative path → text (``.sh`` files are executable)."""
        return {
            "instruction.md": self.instruction,
            "task.toml": _TOML.format(
                tags=", ".join(f'"{s}"' for s in self.skills),
                skills=_list(self.skills),
                values=_list(self.values),
                split=self.split,
                difficulty="easy" if len(self.skills) == 1 else "medium",
            ),
            "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\n"
            + "".join(SETUP.get(s, "").format(value=v) for s, v in self.parts),
            "solution/solve.sh": _SOLVE.format(command=self.solution),
            "tests/test.sh": _TEST.format(
                what="; ".join(self.expected),
                check=" && ".join(f"{{ {CHECKS[s].format(value=v)}; }}" for s, v in self.parts)
                if len(self.skills) > 1
                else CHECKS[self.skills[0]].format(value=self.values[0]),
            ),
        }


def _list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"


_TOML = """version = "1.0"

[metadata]
author_name = "harness-trainer"
difficulty = "{difficulty}"
category = "shell"
tags = ["toy", "toy-skills", {tags}]
skills = {skills}
values = {values}
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


def _fixed_text() -> str:
    """Every text of a task but its values (the templates' own numbers: timeouts, memory)."""
    return "".join(
        [_TOML, _SOLVE, _TEST, KEEP_LINE]
        + [w for ws in WORDINGS.values() for w in ws]
        + [*SOLUTIONS.values(), *CHECKS.values(), *WHAT_IS_CHECKED.values(), *SETUP.values()]
    )


_FIXED = _fixed_text()
VALUES: tuple[str, ...] = tuple(str(n) for n in range(10 ** (DIGITS - 1), 10**DIGITS) if str(n) not in _FIXED)
"""The values, one pool for every skill: every number of :data:`DIGITS` digits that no template text holds
(so a value occurs in a task only where the task puts it)."""


def toy_family(
    seed: int = DEFAULT_SEED, per_skill: dict[str, int] | None = None, combined: int = DEFAULT_COMBINED
) -> dict[str, list[ToyTask]]:
    """Every task of the family, by split (contract in the module docstring).

    Raises:
        ValueError: the counts need more values than :data:`VALUES` holds, or more two-step tasks than
            :data:`PAIRS` has pairs.
    """
    per_skill = {**DEFAULT_PER_SKILL, **(per_skill or {})}
    needed = len(SKILLS) * (per_skill["train"] + per_skill["test"]) + 2 * combined
    if needed > len(VALUES) or combined > len(PAIRS):
        raise ValueError(
            f"too few values or pairs for {per_skill} and {combined} two-step tasks: {needed} values needed, "
            f"{len(VALUES)} in VALUES; {len(PAIRS)} skill pairs"
        )
    rng = random.Random(seed)
    pool = list(VALUES)
    rng.shuffle(pool)
    trained = len(SKILLS) * per_skill["train"]
    train_values, test_values = iter(pool[:trained]), iter(pool[trained:needed])
    wordings = len(WORDINGS[SKILLS[0]])
    family: dict[str, list[ToyTask]] = {split: [] for split in SPLITS}
    for skill in SKILLS:
        start = rng.randrange(wordings)  # wordings in turn: every one of them in each split
        for split, values_left in (("train", train_values), ("test", test_values)):
            family[split] += [
                ToyTask(split, (skill,), (next(values_left),), (start + i) % wordings)
                for i in range(per_skill[split])
            ]
    for i, pair in enumerate(rng.sample(PAIRS, combined)):
        family["test"].append(ToyTask("test", pair, (next(test_values), next(test_values)), i % wordings))
    return {split: sorted(tasks, key=lambda t: t.folder) for split, tasks in family.items()}


def write_family(
    root: Path,
    seed: int = DEFAULT_SEED,
    per_skill: dict[str, int] | None = None,
    combined: int = DEFAULT_COMBINED,
) -> None:
    """Write :func:`toy_family` under ``root`` as ``root/<split>/<task>/``, replacing those split folders."""
    for split, tasks in toy_family(seed, per_skill, combined).items():
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
