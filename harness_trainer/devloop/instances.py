"""Transcripts of a template's tasks, made from one recording: tasks that differ only in their numbers.

A generated family (:mod:`harness_trainer.tasks.toy_family`) holds many tasks that are one template filled in
with different values, each task's ``task.toml`` listing them under ``[metadata] values``: the same
instruction, solution, verifier and environment but for the values. Recording a transcript through a real
agent takes seconds a task (mini-swe-agent about 7 s here), and a warm model that must learn to copy a value
it never saw needs many values to learn from. So the warm-up records one task per template
(:func:`plan_recordings`) and makes every other task's transcript from that recording by putting the task's
values' token ids where the recorded task's stood (:func:`instance_rows`).

That is exact when a value is written as the same ids wherever it stands: so only all-digit values count
(:func:`template_key`), under a tokenizer that splits every digit off on its own (Qwen2's pre-tokenizer does:
``\\p{N}`` alone). A test records two tasks of one template through the real agents and compares the made
transcript with the real one, id for id. What it cannot reproduce: the output of a command that prints the
clock (a distractor's ``ls -la``) shows the recording's time, which is prompt, never trained on.
A value is swapped wherever its ids occur in the recording, so a recording whose value also stands in the
agent's preamble, the ids every recorded transcript starts with, is refused (:func:`instance_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness_trainer.tasks.held_out import task_values
from harness_trainer.tasks.task import HarborTask
from harness_trainer.trainer.step.rows import Row


@dataclass(frozen=True)
class Template:
    """Tasks that are one template filled in with different values: ``recorded`` is the one recorded
    through the agent, ``members`` every task of the template (``recorded`` first) with its values."""

    recorded: str
    members: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def values(self) -> tuple[str, ...]:
        return self.members[0][1]


def template_key(task: HarborTask) -> tuple | None:
    """What a task is with its values blanked out: every file of its folder, path and text, with each value
    replaced by its slot; ``None`` for a task that has no values or a value that is not all digits (its
    transcript is recorded for itself). Tasks with equal keys differ only in their values, which have the
    same lengths slot by slot (so a swap keeps every position)."""
    values = task_values(task)
    if not values or not all(value.isdigit() for value in values):
        return None
    files = []
    for path in sorted(p for p in Path(task.path).rglob("*") if p.is_file()):
        name, text = str(path.relative_to(task.path)), path.read_text(errors="replace")
        for slot, value in enumerate(values):
            name, text = name.replace(value, f"\0{slot}\0"), text.replace(value, f"\0{slot}\0")
        files.append((name, text))
    return (tuple(len(value) for value in values), tuple(files))


def plan_recordings(tasks: Sequence[HarborTask]) -> list[Template]:
    """Group ``tasks`` by :func:`template_key`, in their order: each group's first task is the one to record.
    A task without a key is a template of its own."""
    groups: dict[object, list[HarborTask]] = {}
    for task in tasks:
        key = template_key(task)
        groups.setdefault(task.name if key is None else key, []).append(task)
    return [
        Template(recorded=group[0].name, members=tuple((t.name, task_values(t)) for t in group))
        for group in groups.values()
    ]


def swap(ids: Sequence[int], old: Sequence[int], new: Sequence[int]) -> tuple[list[int], list[int]]:
    """``ids`` with every occurrence of ``old`` (left to right, not overlapping) replaced by ``new`` (as
    long), and the positions where they started."""
    if len(old) != len(new) or not old:
        raise ValueError(f"a swap keeps every position: {len(old)} ids cannot become {len(new)}")
    out, at, i, old = list(ids), [], 0, list(old)
    while i <= len(out) - len(old):
        if out[i : i + len(old)] == old:
            out[i : i + len(old)] = new
            at.append(i)
            i += len(old)
        else:
            i += 1
    return out, at


def instance_rows(
    rows: Sequence[Row], recorded: Sequence[str], values: Sequence[str], digit_ids: Sequence[int],
    *, preamble: int,
) -> list[Row]:  # fmt: skip
    """The rows of the task whose values are ``values``, made from the rows of the recording of the task
    whose values are ``recorded`` (same template); ``digit_ids[d]`` is digit ``d``'s token id; ``preamble``
    is how many ids every recorded transcript starts with (the agent's own prompt, the same for every task).

    Raises:
        ValueError: a recorded value does not occur in the rows, or occurs in the preamble.
    """
    made = []
    for row in rows:
        ids = row.input_ids
        for old, new in zip(recorded, values, strict=True):
            ids, at = swap(ids, [digit_ids[int(c)] for c in old], [digit_ids[int(c)] for c in new])
            if not at or at[0] < preamble:
                where = "nowhere" if not at else f"at {at[0]}, in the agent's prompt (first {preamble} ids)"
                raise ValueError(
                    f"value {old} of the recorded transcript stands {where}: a transcript for {new} cannot "
                    "be made from it; record that task itself"
                )
        made.append(Row(row.rollout, ids, list(row.targets), list(row.behaviour_logps)))
    return made


def common_prefix(sequences: Sequence[Sequence[int]]) -> int:
    """How many ids every one of ``sequences`` starts with; 0 for fewer than two (nothing to compare: the
    preamble of one recording is unknown)."""
    if len(sequences) < 2:
        return 0
    shortest = min(len(s) for s in sequences)
    for i in range(shortest):
        if any(s[i] != sequences[0][i] for s in sequences):
            return i
    return shortest
