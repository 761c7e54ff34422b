"""A pass-rate curriculum: which dataset row each rollout group rolls out, from how each task has fared.

A rollout *passes* when its reward is at least ``pass_reward`` (default 1.0: the verifier's full marks;
Harbor's rewards are 0 or 1, so this is "reward > 0" there, and partial credit is not a pass). Each task
(a dataset row, by its position) keeps the passes and scored rollouts of its last ``window`` groups, how
many groups it has had and whether it ever passed. Its sampling weight:

- ``retired_weight`` (0: never sampled again) once its last ``window`` groups are all in and their pass
  rate is at least ``retire_threshold``: the policy solves it, so its groups have little left to teach;
- ``unsolved_weight`` once it had ``window`` groups and never passed: still retried, less often;
- 1 otherwise (untried tasks included).

Determinism, exactly, across runs and resumes: group ``i``'s row is drawn from the weights with
``random.Random`` seeded from ``(seed, i)``, the weights being those after the first ``max(0, i - lag +
1)`` groups (in admission order) were taken, ``lag`` being the scheduler's admission limit. Those groups
are exactly the ones the trainer must have taken before the scheduler may admit group ``i``, so the
choice never depends on how far ahead the trainer happens to be. The scheduler calls :meth:`taken` as the
trainer takes each group (under its own lock, before admission can see the take), and :meth:`choose` at
admission; a lock here covers the two threads. The state is the tasks folded over the groups no later
choice or resume can leave out, plus the few taken groups after them (:meth:`settle`); :meth:`state_dict`
of the trainer's data position resumes to the same choices, the groups taken after it being taken again.

Every group taken counts, dropped ones included (a zero-variance group is exactly a task solved, or
failed, by every member); a group with no scored member tells nothing and changes nothing.
When every task's weight is 0 (all retired, or given up with ``unsolved_weight=0``), :meth:`taken` raises
:class:`CurriculumExhausted` rather than let the run wait for rows that can never be chosen.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness_trainer.trainer.step.groups import Group

STATE_VERSION = 1


class CurriculumExhausted(RuntimeError):
    """Every task's weight is 0: nothing is left to sample (the message says how many were retired)."""


class CurriculumStateError(ValueError):
    """A saved curriculum state that does not fit this run (another dataset, an unknown format)."""


@dataclass(frozen=True)
class PassRateRule:
    """The curriculum's knobs: ``AsyncGRPOConfig.curriculum_*``, checked and documented there, with the same
    defaults."""

    window: int = 2
    pass_reward: float = 1.0
    retire_threshold: float = 1.0
    retired_weight: float = 0.0
    unsolved_weight: float = 0.25


@dataclass(frozen=True)
class TaskRecord:
    """What the curriculum knows of one task: its last groups' ``(passes, scored)``, oldest first."""

    recent: tuple[tuple[int, int], ...] = ()
    groups: int = 0
    passes: int = 0


@dataclass(frozen=True)
class GroupResult:
    """One taken group, as the curriculum counts it: its row, its passing and scored members."""

    row: int
    passes: int
    scored: int


def group_result(row: int, rewards: Iterable[float | None], pass_reward: float) -> GroupResult:
    """``row``'s group with these member rewards (None: not scored)."""
    values = [reward for reward in rewards if reward is not None]
    return GroupResult(row, sum(value >= pass_reward for value in values), len(values))


def fold(tasks: dict[int, TaskRecord], result: GroupResult, window: int) -> dict[int, TaskRecord]:
    """``tasks`` after ``result`` (a new dict; the records are immutable); unchanged when it scored none."""
    if not result.scored:
        return tasks
    record = tasks.get(result.row, TaskRecord())
    recent = (*record.recent, (result.passes, result.scored))[-window:]
    updated = TaskRecord(recent, record.groups + 1, record.passes + result.passes)
    return {**tasks, result.row: updated}


def task_status(record: TaskRecord, rule: PassRateRule) -> str:
    """``"retired"``, ``"unsolved"`` or ``"active"`` (module docstring)."""
    if record.groups >= rule.window and record.passes == 0:
        return "unsolved"
    recent = record.recent[-rule.window :]
    scored = sum(s for _, s in recent)
    if len(recent) >= rule.window and scored and sum(p for p, _ in recent) / scored >= rule.retire_threshold:
        return "retired"
    return "active"


def task_weight(record: TaskRecord, rule: PassRateRule) -> float:
    """One task's sampling weight (module docstring)."""
    status = task_status(record, rule)
    return (
        rule.unsolved_weight if status == "unsolved" else rule.retired_weight if status == "retired" else 1.0
    )


def weights(tasks: dict[int, TaskRecord], num_rows: int, rule: PassRateRule) -> list[float]:
    """Every row's weight, by position."""
    return [task_weight(tasks.get(row, TaskRecord()), rule) for row in range(num_rows)]


def draw(row_weights: Sequence[float], seed: int, index: int) -> int:
    """The row group ``index`` rolls out: a weighted draw seeded from ``(seed, index)`` only.

    Raises:
        CurriculumExhausted: every weight is 0.
    """
    if not any(w > 0 for w in row_weights):
        raise CurriculumExhausted(f"no row has a positive weight to draw group {index}'s from")
    # A string seed is hashed with SHA-512 by random.seed: the same on every run and platform.
    rng = random.Random(f"curriculum:{seed}:{index}")
    return rng.choices(range(len(row_weights)), weights=row_weights)[0]


def exhausted_message(tasks: dict[int, TaskRecord], num_rows: int, rule: PassRateRule) -> str:
    """Why no task can be chosen: how many were retired, and how many given up as never solved."""
    unsolved = sum(task_status(tasks.get(row, TaskRecord()), rule) == "unsolved" for row in range(num_rows))
    return (
        f"the curriculum has no task left to sample: of {num_rows} tasks, {num_rows - unsolved} are retired "
        f"(pass rate ≥ curriculum_retire_threshold={rule.retire_threshold} over their last "
        f"{rule.window} groups, curriculum_retired_weight={rule.retired_weight}) and {unsolved} never "
        f"passed (curriculum_unsolved_weight={rule.unsolved_weight}). The policy has learnt what these "
        "tasks can teach; stop here, or raise curriculum_retired_weight / curriculum_unsolved_weight to "
        "keep sampling them"
    )


@dataclass
class _State:
    tasks: dict[int, TaskRecord] = field(default_factory=dict)
    folded: int = 0
    """Groups folded into ``tasks`` (group indices below it)."""
    tail: list[GroupResult] = field(default_factory=list)
    """Groups ``folded``, ``folded + 1``, … taken but not folded: a choice, or a resume, may still leave
    them out."""


class PassRateCurriculum:
    """The row chooser of :class:`~harness_trainer.trainer.feed.scheduling.RolloutScheduler` (module
    docstring).

    Args:
        num_rows: rows of the training dataset.
        rule: the knobs.
        seed: the run's seed.
        lag: the scheduler's admission limit (groups in flight plus finished but not taken).
        state: a :meth:`state_dict` to resume from; None: a fresh curriculum.
        start: the first group this run admits (the groups taken so far); a fresh curriculum treats the
            ones before it as never seen.

    Raises:
        CurriculumStateError: ``state`` is not a state of this dataset, or not of ``start`` groups taken.
        CurriculumExhausted: ``state`` leaves no task to sample.
    """

    def __init__(
        self,
        num_rows: int,
        rule: PassRateRule,
        *,
        seed: int,
        lag: int,
        state: dict[str, Any] | None = None,
        start: int = 0,
    ) -> None:
        if num_rows < 1 or lag < 1:
            raise ValueError(f"num_rows and lag must be at least 1, got {num_rows} and {lag}")
        self.num_rows, self.rule, self.seed, self.lag = num_rows, rule, seed, lag
        self._lock = threading.Lock()
        self._chosen: dict[int, int] = {}
        self._state = _State(folded=start) if state is None else _load(state, num_rows)
        self._taken = self._state.folded + len(self._state.tail)
        if self._taken != start:
            raise CurriculumStateError(
                f"the curriculum state counts {self._taken} groups taken, the checkpoint {start}"
            )
        self._check(self._latest())

    def choose(self, index: int) -> int:
        """Group ``index``'s row (the scheduler's loop thread, at admission).

        Raises:
            RuntimeError: the groups this choice depends on were not all taken yet (a bug in the caller).
        """
        seen = max(0, index - self.lag + 1)
        with self._lock:
            state = self._state
            if seen > self._taken:
                raise RuntimeError(f"group {index} chosen before the {seen} groups it depends on were taken")
            tasks = state.tasks
            for result in state.tail[: max(0, seen - state.folded)]:
                tasks = fold(tasks, result, self.rule.window)
            row = draw(weights(tasks, self.num_rows, self.rule), self.seed, index)
            self._chosen[index] = row
        return row

    def taken(self, group: Group) -> None:
        """Count ``group``, the next in admission order, as taken (the trainer's thread, before admission
        can see the take).

        Raises:
            CurriculumExhausted: after this group no task has a positive weight.
            RuntimeError: ``group`` is not the next one, or was not chosen here (a bug in the caller).
        """
        with self._lock:
            if group.index != self._taken or group.index not in self._chosen:
                raise RuntimeError(f"group {group.index} taken out of turn: expected group {self._taken}")
            row = self._chosen.pop(group.index)
            rewards = [r.reward if r.scored else None for r in group.rollouts]
            self._state.tail.append(group_result(row, rewards, self.rule.pass_reward))
            self._taken += 1
            latest = self._latest()
        self._check(latest)

    def settle(self, groups_consumed: int) -> None:
        """Fold what neither a later choice nor a resume from ``groups_consumed`` (the trainer's data
        position, which only grows) can leave out: the groups before ``groups_consumed - lag + 1``."""
        with self._lock:
            state = self._state
            while state.tail and state.folded < min(groups_consumed, self._taken) - self.lag + 1:
                state.tasks = fold(state.tasks, state.tail.pop(0), self.rule.window)
                state.folded += 1

    def state_dict(self, groups_consumed: int) -> dict[str, Any]:
        """The state of a run resumed at ``groups_consumed`` (groups taken since are taken again), as JSON
        data for the checkpoint (``TrainerState.extra["curriculum"]``)."""
        self.settle(groups_consumed)
        with self._lock:
            state = self._state
            tail = state.tail[: max(0, groups_consumed - state.folded)]
            return {
                "version": STATE_VERSION,
                "num_rows": self.num_rows,
                "folded": state.folded,
                "tasks": {
                    str(row): {
                        "recent": [list(pair) for pair in r.recent],
                        "groups": r.groups,
                        "passes": r.passes,
                    }
                    for row, r in sorted(state.tasks.items())
                },
                "tail": [[r.row, r.passes, r.scored] for r in tail],
            }

    def summary(self) -> dict[str, float]:
        """Metrics as of every group taken: tasks retired and never solved, the mean recent pass rate."""
        with self._lock:
            latest = self._latest()
        records = [latest.get(row, TaskRecord()) for row in range(self.num_rows)]
        statuses = [task_status(r, self.rule) for r in records]
        rates = [
            sum(p for p, _ in r.recent) / scored for r in records if (scored := sum(s for _, s in r.recent))
        ]
        return {
            "curriculum/retired_tasks": float(statuses.count("retired")),
            "curriculum/unsolved_tasks": float(statuses.count("unsolved")),
            "curriculum/pass_rate": sum(rates) / len(rates) if rates else 0.0,
        }

    def _latest(self) -> dict[int, TaskRecord]:
        """The tasks after every group taken (callers hold the lock)."""
        tasks = self._state.tasks
        for result in self._state.tail:
            tasks = fold(tasks, result, self.rule.window)
        return tasks

    def _check(self, tasks: dict[int, TaskRecord]) -> None:
        if not any(w > 0 for w in weights(tasks, self.num_rows, self.rule)):
            raise CurriculumExhausted(exhausted_message(tasks, self.num_rows, self.rule))


def _load(data: dict[str, Any], num_rows: int) -> _State:
    if data.get("version") != STATE_VERSION:
        raise CurriculumStateError(f"curriculum state version {data.get('version')!r} is not {STATE_VERSION}")
    if data.get("num_rows") != num_rows:
        raise CurriculumStateError(
            f"the curriculum state is of a dataset of {data.get('num_rows')} rows, this run has {num_rows}: "
            "resume with the same training dataset"
        )
    tasks = {
        int(row): TaskRecord(
            tuple((int(p), int(s)) for p, s in r["recent"]), int(r["groups"]), int(r["passes"])
        )
        for row, r in data["tasks"].items()
    }
    tail = [GroupResult(int(row), int(p), int(s)) for row, p, s in data["tail"]]
    return _State(tasks, int(data["folded"]), tail)
