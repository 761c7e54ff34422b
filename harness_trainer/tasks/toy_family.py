"""A generated family of toy Harbor tasks with a held-out split that no training solution solves.

The bundled ``harness_trainer/examples/tasks`` are five different tasks, each one of a kind, so a model
trained on them can only be asked about them. This family is a few shell *skills*, each with one solution
template with one slot, and two wordings:

- ``make-dir``: create the directory ``/app/VALUE`` → ``mkdir -p /app/VALUE``;
- ``write-word``: ``/app/status.txt`` holds the word ``VALUE`` → ``echo VALUE > /app/status.txt``;
- ``touch-file``: create the empty file ``/app/VALUE.txt`` → ``touch /app/VALUE.txt``;
- ``delete-ext``: delete every ``*.VALUE`` file in ``/app``, keeping ``/app/keep.txt`` → ``rm /app/*.VALUE``.

Every value comes from one pool (:data:`WORDS`, 69 words), and every task has its own: at the default counts
``train`` holds 48 one-skill tasks (12 per skill, 48 values) and ``test`` 12 one-skill tasks (3 per skill)
and 4 *two-step* tasks (two skills, two values: the two instructions one after the other, the solution
``CMD1 && CMD2``, a verifier checking both), 20 values in all.

Contract of :func:`toy_family` (pure: a function of its arguments, no filesystem, no global randomness):

1. Splits ``train`` and ``test``; ``per_skill`` says how many one-skill tasks of every skill each split
   holds, ``combined`` how many two-step tasks ``test`` holds (``train`` holds none).
2. Held out for real: no value of a test task occurs anywhere in ``train`` (the pool is shuffled from
   ``seed`` and cut), so no test task's solution, verifier or expected outcome equals a training task's
   (:mod:`harness_trainer.tasks.held_out` checks a task folder for that, and a test checks the shipped
   copy); replaying a training solution never solves a test task. A two-step task combines two skills that
   ``train`` holds only alone. Solving a test task means copying its value from the instruction into the
   skill's command (and, for a two-step one, doing two skills in one command line).
3. Wordings are taken in turn per skill, so every wording of every skill occurs in both splits.
4. The same arguments give the same tasks, byte for byte; the seed picks the cut of the pool, the wordings'
   start and the two-step pairs.

Why single-token values in one pool: an earlier version held out names never seen in training
(``notes.md`` from ``notes`` and ``md``) that took several tokens to copy, and the tiny model did not learn
to copy them in a CPU warm-up (solver share of probability 0.006 train / 0.000 test after 100 steps); the
version after it held out only unseen (value, wording) pairings of four values per skill, so its test
solutions were training solutions. Here each value is one token of the tiny model's tokenizer in every
place it stands (``/app/VALUE``, ``*.VALUE``, `` VALUE``), in the same place in the instruction and the
command, and training has 48 of them, one per task, so that a warm model cannot solve the training tasks by
pairing a skill with a few memorised values. Measured (``docs/getting-started.md``): that was not enough.
The warm-up's fine-tune on this train split, 150 full-batch steps (the CPU time a session had), learned the
format and about one value per skill and wording, and gave held-out values below probability 0.0005 at their
slot, ranked no better than chance among the unseen words: no held-out sample solved its task (0/128 at steps
30 to 150). The tiny model starts from random weights, and copying an unseen token did not emerge from 48
examples at that budget.

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
SKILLS = ("make-dir", "write-word", "touch-file", "delete-ext")
DEFAULT_SEED = 0
DEFAULT_PER_SKILL = {"train": 12, "test": 3}
DEFAULT_COMBINED = 4
KEEP_FILE = "keep.txt"
KEEP_LINE = "do not delete me"
STATUS_FILE = "status.txt"
THEN = " && "
"""How a two-step task's solution joins its two commands (one shell command line)."""

WORDS: tuple[str, ...] = (
    "act", "add", "around", "ask", "bai", "bou", "cai", "cause", "cou", "dai", "default", "demo", "dou",
    "early", "end", "error", "fai", "fejou", "fer", "format", "fou", "gai", "gou", "hai", "hou", "huti",
    "jai", "jou", "kai", "kou", "kuwi", "lai", "lose", "lou", "low", "mai", "mou", "move", "old", "pai",
    "place", "pou", "question", "rai", "repo", "resi", "rou", "sai", "saidu", "server", "sou", "space",
    "tai", "ted", "tem", "term", "thing", "top", "vai", "version", "vou", "wai", "way", "wegu", "wou",
    "xai", "xou", "zai", "zou",
)  # fmt: skip
"""The values, one pool for every skill: each is one token of the tiny model's tokenizer wherever a value
stands (after ``/app/``, after ``*.``, before ``.txt``, after a space), so copying a value is copying one
token; none is a command, a word of the wordings, or a name the task already uses."""
WORDINGS: dict[str, tuple[str, ...]] = {
    "make-dir": (
        "Create the directory `/app/{value}`.",
        "Make a new folder at `/app/{value}`.",
    ),
    "write-word": (
        f"Write the word {{value}} to `/app/{STATUS_FILE}`.",
        f"Set the contents of `/app/{STATUS_FILE}` to the word {{value}}.",
    ),
    "touch-file": (
        "Create an empty file `/app/{value}.txt`.",
        "`/app/{value}.txt` should exist (empty is fine); create it.",
    ),
    "delete-ext": (
        "Delete every `*.{value}` file in `/app`.",
        "Remove all the `*.{value}` files from `/app`; keep the rest.",
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


def toy_family(
    seed: int = DEFAULT_SEED, per_skill: dict[str, int] | None = None, combined: int = DEFAULT_COMBINED
) -> dict[str, list[ToyTask]]:
    """Every task of the family, by split (contract in the module docstring).

    Raises:
        ValueError: the counts need more values than :data:`WORDS` holds, or more two-step tasks than
            :data:`PAIRS` has pairs.
    """
    per_skill = {**DEFAULT_PER_SKILL, **(per_skill or {})}
    needed = len(SKILLS) * (per_skill["train"] + per_skill["test"]) + 2 * combined
    if needed > len(WORDS) or combined > len(PAIRS):
        raise ValueError(
            f"too few values or pairs for {per_skill} and {combined} two-step tasks: {needed} values needed, "
            f"{len(WORDS)} in WORDS; {len(PAIRS)} skill pairs"
        )
    rng = random.Random(seed)
    words = list(WORDS)
    rng.shuffle(words)
    trained = len(SKILLS) * per_skill["train"]
    train_words, test_words = iter(words[:trained]), iter(words[trained:needed])
    wordings = len(WORDINGS[SKILLS[0]])
    family: dict[str, list[ToyTask]] = {split: [] for split in SPLITS}
    for skill in SKILLS:
        start = rng.randrange(wordings)  # wordings in turn: every one of them in each split
        for split, words_left in (("train", train_words), ("test", test_words)):
            family[split] += [
                ToyTask(split, (skill,), (next(words_left),), (start + i) % wordings)
                for i in range(per_skill[split])
            ]
    for i, pair in enumerate(rng.sample(PAIRS, combined)):
        family["test"].append(ToyTask("test", pair, (next(test_words), next(test_words)), i % wordings))
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
