"""Is a held-out split held out? Every way a test task could be solved by replaying a training task.

A held-out split measures transfer only if no test task can be solved by what training taught verbatim.
:func:`find_leaks` compares every test task with every training task, pure (it reads the task folders and
nothing else), and returns each shared piece as a :class:`Leak` (the test task, the training task, what
they share):

- ``solution``: the same reference solution (``solution/solve.sh``, byte for byte);
- ``verifier``: the same verifier (``tests/test.sh``);
- ``expected output``: the same other files under ``tests/`` (the expected outputs a verifier compares
  against, where a task has any), as a whole;
- ``value``: a value of the test task (``[metadata] values`` in task.toml, as generated families such as
  :mod:`harness_trainer.tasks.toy_family` write them) that a training task also has: a test value must be
  absent from the training split.

Tasks without a solution, or without other test files, share nothing there (an absent file is not a
match). :func:`check_held_out` is what a benchmark calls: it raises :class:`ValueError` naming the leaking
pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness_trainer.tasks.sources import LocalTaskSource
from harness_trainer.tasks.task import HarborTask

SOLUTION = "solution"
VERIFIER = "verifier"
EXPECTED_OUTPUT = "expected output"
VALUE = "value"
SHARED = (SOLUTION, VERIFIER, EXPECTED_OUTPUT, VALUE)
"""What a test task can share with a training task, in the order :func:`find_leaks` reports it."""
SHOWN = 5
"""How many leaks :func:`check_held_out`'s message names (then how many more there are)."""


@dataclass(frozen=True)
class Leak:
    """``test`` (a held-out task's name) shares ``shared`` with ``train`` (a training task's name);
    ``detail`` is the shared value, where that is what is shared."""

    test: str
    train: str
    shared: str
    detail: str = ""

    def __str__(self) -> str:
        what = f"{self.shared} {self.detail!r}" if self.detail else self.shared
        return f"test task {self.test!r} shares its {what} with train task {self.train!r}"


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def _expected_outputs(task: HarborTask) -> tuple[tuple[str, str], ...] | None:
    """The files under ``tests/`` but ``test.sh``, as (relative path, text); None where there are none."""
    tests = task.tests_dir
    if not tests.is_dir():
        return None
    files = tuple(
        (str(path.relative_to(tests)), path.read_text(errors="replace"))
        for path in sorted(tests.rglob("*"))
        if path.is_file() and path.relative_to(tests) != Path("test.sh")
    )
    return files or None


def task_values(task: HarborTask) -> tuple[str, ...]:
    """The task's values (``[metadata] values`` of its task.toml); empty where it names none."""
    values = task.config.get("metadata", {}).get("values", ())
    if isinstance(values, str):
        return (values,)
    return tuple(str(value) for value in values)


def find_leaks(train: Sequence[HarborTask], test: Sequence[HarborTask]) -> list[Leak]:
    """Every piece a ``test`` task shares with a ``train`` task, in the order of ``test``, then
    :data:`SHARED`, then ``train``."""
    pieces = {
        SOLUTION: lambda task: _read(task.path / "solution" / "solve.sh"),
        VERIFIER: lambda task: _read(task.tests_dir / "test.sh"),
        EXPECTED_OUTPUT: _expected_outputs,
    }
    trained = [
        (task, {what: piece(task) for what, piece in pieces.items()}, task_values(task)) for task in train
    ]
    leaks: list[Leak] = []
    for held in test:
        mine = {what: piece(held) for what, piece in pieces.items()}
        for what in pieces:
            if mine[what] is None:
                continue
            leaks += [
                Leak(held.name, task.name, what) for task, theirs, _ in trained if theirs[what] == mine[what]
            ]
        for value in task_values(held):
            leaks += [
                Leak(held.name, task.name, VALUE, value) for task, _, values in trained if value in values
            ]
    return leaks


def leaks_in(root: str | Path, train_split: str = "train", test_split: str = "test") -> list[Leak]:
    """:func:`find_leaks` on the task folder ``root``'s two splits."""
    source = LocalTaskSource(root)
    return find_leaks(source.tasks(train_split), source.tasks(test_split))


def check_held_out(root: str | Path, train_split: str = "train", test_split: str = "test") -> None:
    """Refuse a task folder whose ``test_split`` leaks: a test task shares its solution, verifier, expected
    output or a value with a task of ``train_split``.

    Raises:
        ValueError: naming the first :data:`SHOWN` leaking pairs and what they share, and how many more.
    """
    leaks = leaks_in(root, train_split, test_split)
    if not leaks:
        return
    shown = "; ".join(str(leak) for leak in leaks[:SHOWN])
    more = f" (and {len(leaks) - SHOWN} more)" if len(leaks) > SHOWN else ""
    raise ValueError(
        f"the {test_split!r} split of {root} is not held out from {train_split!r}: {shown}{more}; a task "
        "solved by replaying a training task's solution measures memory, not transfer"
    )
