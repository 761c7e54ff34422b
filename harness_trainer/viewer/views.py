"""The viewer's view model: a run's rollout records and evaluations as the steps, groups, rollouts, turns
and token spans its page shows (:mod:`.page` renders them).

Each token is a span coloured by its role (:data:`ROLES`, the package docstring says which is which), its
text decoded by the tokenizer and escaped here. A turn's prompt starts with what an earlier turn already
showed (its parent's full sequence, or a sibling's prompt); that shared part is not repeated. Traces are
rendered while a token budget lasts: newest step first, then the evaluations' samples, newest evaluation
first; a rollout past it keeps its row, its trace left out.
"""

from __future__ import annotations

import html
import math
import os
import shlex
from collections import Counter
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness_trainer.trace import TrainingTrace, TrainingTurn
    from harness_trainer.trainer.feed.rollout_records import RolloutRecord

ROLES = ("trained", "context", "auxiliary", "discarded")


@dataclass
class TurnView:
    index: int
    node_id: str
    tokens: str
    """The turn's shown tokens as HTML spans, escaped here."""
    roles: Counter[str]
    shared: int
    """Leading prompt tokens not shown again: the same as in turn ``shared_with``."""
    shared_with: int | None
    finish_reason: str | None


@dataclass
class RolloutView:
    record: RolloutRecord
    turns: list[TurnView] = field(default_factory=list)
    """Empty when the trace is left out (the page's token budget was spent) or there is none."""
    roles: Counter[str] = field(default_factory=Counter)
    rows: int = 0
    turn_count: int = 0
    completion_tokens: int = 0
    left_out: bool = False
    journal: str | None = None
    """The command that exports the rollout's trace from its capture journal; None without a capture id."""


@dataclass
class GroupView:
    index: int
    task_name: str | None
    task_index: int | None
    rollouts: list[RolloutView]
    harness: str | None = None
    """The agent its members ran, in a run that mixes harnesses."""


@dataclass
class StepView:
    step: int | None
    """None: the rollouts no step took."""
    metrics: dict[str, Any] | None
    groups: list[GroupView]


@dataclass
class EvalView:
    """One evaluation: the ``eval.jsonl`` lines of one step and split, one per task (per task and harness,
    in a run that mixes harnesses), and the samples of ``eval_rollouts.jsonl`` by task (``task_name``,
    ``task_index``, ``harness``: None in a run of one)."""

    step: int
    policy_version: Any
    split: Any
    k: Any
    temperature: Any
    tasks: list[dict[str, Any]]
    samples: dict[tuple[Any, Any, Any], list[RolloutView]] = field(default_factory=dict)

    def samples_of(self, task: dict[str, Any]) -> list[RolloutView]:
        """The samples of one of :attr:`tasks`; [] when none were recorded (a run before
        ``eval_rollouts.jsonl``)."""
        return self.samples.get(_task_key(task), [])

    @property
    def task_count(self) -> int:
        """The tasks evaluated: one line each, or one per harness in a mix (each task is under each)."""
        return len(self.tasks) // max(len(self.harnesses), 1)

    @property
    def harnesses(self) -> list[str]:
        """The harnesses its tasks ran under, in the order written; [] in a run of one harness."""
        return list(dict.fromkeys(h for task in self.tasks if (h := task.get("harness")) is not None))

    def harness_passes(self) -> list[tuple[str, float | None, float | None]]:
        """Each harness's ``(name, pass@1, pass@k)``: the means over its own task lines."""
        passes = []
        for name in self.harnesses:
            mine = [task for task in self.tasks if task.get("harness") == name]
            passes.append((name, _mean_of(mine, "pass@1"), _mean_of(mine, "pass@k")))
        return passes

    @property
    def pass_at_1(self) -> float | None:
        return _mean_of(self.tasks, "pass@1")

    @property
    def pass_at_k(self) -> float | None:
        return _mean_of(self.tasks, "pass@k")

    @property
    def reward(self) -> float | None:
        """The mean reward over every scored sample of every task."""
        rewards = [r for task in self.tasks for r in task.get("rewards") or [] if _is_number(r)]
        return sum(rewards) / len(rewards) if rewards else None

    @property
    def unscorable(self) -> int:
        return sum(1 for task in self.tasks for reason in task.get("unscorable") or [] if reason is not None)


def step_views(
    records: list[RolloutRecord],
    metrics: dict[int, dict[str, Any]],
    text: TokenText,
    budget: int,
    capture_dir: str | os.PathLike[str] | None,
) -> list[StepView]:
    """Newest step first, then the rollouts no step took (step None); groups and members in the order they
    were logged; traces rendered while the token ``budget`` lasts."""
    by_step: dict[int | None, dict[int, GroupView]] = {}
    # Stable: the logged order within a step. The untaken last: the reader sees what trained first.
    for record in sorted(records, key=lambda r: (r.step is None, -(r.step or 0))):
        groups = by_step.setdefault(record.step, {})
        group = groups.get(record.group)
        if group is None:
            group = groups[record.group] = GroupView(
                record.group, record.task_name, record.task_index, [], harness=record.harness
            )
        view = _view(record, text if budget > 0 else None, capture_dir)
        budget -= view.roles.total()
        group.rollouts.append(view)
    return [
        StepView(step, metrics.get(step) if step is not None else None, list(groups.values()))
        for step, groups in by_step.items()
    ]


def attach_samples(
    evaluations: list[EvalView],
    records: list[RolloutRecord],
    text: TokenText,
    budget: int,
    capture_dir: str | os.PathLike[str] | None,
) -> None:
    """Each eval sample under its task in the evaluation of its step, in the order written; traces
    rendered while the token ``budget`` lasts, newest evaluation first.

    Samples are kept on the latest timeline, as the evaluations are: a step evaluated again (a resumed run,
    or ``harness-trainer eval`` into the same folder) keeps its last samples, under the last evaluation of
    that step that has their task.
    """
    from harness_trainer.trainer.feed.rollout_log import latest_steps

    kept = latest_steps((r.step, (r.group, r.member), r) for r in records if r.step is not None)
    by_task: dict[tuple[int, Any, Any, Any], list[RolloutRecord]] = {}
    for step, step_records in kept.items():
        for record in step_records:
            by_task.setdefault((step, record.task_name, record.task_index, record.harness), []).append(record)
    owners: dict[tuple[int, Any, Any, Any], EvalView] = {}
    for evaluation in evaluations:  # the later of a step's evaluations wins; the key keeps its first place
        for task in evaluation.tasks:
            owners[(evaluation.step, *_task_key(task))] = evaluation
    for key, evaluation in owners.items():  # newest evaluation first, as ``evaluations`` are
        if key not in by_task:
            continue
        views = evaluation.samples[key[1:]] = []
        for record in by_task[key]:
            view = _view(record, text if budget > 0 else None, capture_dir)
            budget -= view.roles.total()
            views.append(view)


def read_evaluations(path: str | os.PathLike[str]) -> list[EvalView]:
    """The evaluations of an ``eval.jsonl``, newest step first: its lines grouped by step and split in the
    order written, on the latest timeline (a resumed run that evaluates a step again supersedes it, as in
    ``metrics.jsonl``).

    Raises:
        ValueError: a line is not a JSON object, or has no integer ``step``.
    """
    from harness_trainer.trainer.feed.rollout_log import latest_steps, read_jsonl

    def entries() -> Iterator[tuple[int, Hashable, dict[str, Any]]]:
        for number, _, line in read_jsonl(path):
            step = line.get("step")
            if type(step) is not int:
                raise ValueError(f"{path}:{number}: an evaluation line needs an integer step")
            yield step, (line.get("split"), *_task_key(line)), line

    evaluations: list[EvalView] = []
    for step, lines in reversed(latest_steps(entries()).items()):
        by_split: dict[Any, EvalView] = {}
        for line in lines:
            split = line.get("split")
            if split not in by_split:
                by_split[split] = EvalView(
                    step, line.get("policy_version"), split, line.get("k"), line.get("temperature"), []
                )
            by_split[split].tasks.append(line)
        evaluations.extend(by_split.values())
    return evaluations


def _task_key(line: dict[str, Any]) -> tuple[Any, Any, Any]:
    """An eval line's task within its evaluation: its name, index and harness (None in a run of one)."""
    return line.get("task_name"), line.get("task_index"), line.get("harness")


def _mean_of(lines: list[dict[str, Any]], key: str) -> float | None:
    values = [line[key] for line in lines if _is_number(line.get(key))]
    return sum(values) / len(values) if values else None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def journal_command(capture_session_id: str, capture_dir: str | os.PathLike[str] | None) -> str:
    """``harness-trainer proxy-trace …`` for a capture session's journal, quoted for a POSIX shell;
    ``DATA_DIR`` stands for the capture proxy's data folder when ``capture_dir`` is None."""
    if capture_dir is None:
        return f"harness-trainer proxy-trace DATA_DIR/sessions/{shlex.quote(capture_session_id)}"
    journal = Path(capture_dir) / "sessions" / capture_session_id
    return f"harness-trainer proxy-trace {shlex.quote(str(journal))}"


def _view(
    record: RolloutRecord, text: TokenText | None, capture_dir: str | os.PathLike[str] | None
) -> RolloutView:
    """:func:`_rollout`, with the command that exports its trace from its capture journal."""
    view = _rollout(record, text)
    if record.capture_session_id is not None:
        view.journal = journal_command(record.capture_session_id, capture_dir)
    return view


def _rollout(record: RolloutRecord, text: TokenText | None) -> RolloutView:
    """The rollout's view, its turns rendered unless ``text`` is None (the budget is spent)."""
    from harness_trainer.trainer.step.rows import build_rows

    view = RolloutView(record)
    trace = record.trace
    if trace is None:
        return view
    view.turn_count = len(trace.turns)
    view.completion_tokens = sum(len(turn.completion_token_ids) for turn in trace.turns)
    if text is None:
        view.left_out = True
        return view
    view.rows = len(build_rows(trace))
    for index, turn in enumerate(trace.turns):
        shared_with, shared = _shared_prefix(trace, index)
        tokens, roles = _tokens(turn, shared, text)
        finish = (((turn.response.get("choices") or [{}])[0]) or {}).get("finish_reason")
        view.turns.append(TurnView(index, turn.node_id, tokens, roles, shared, shared_with, finish))
        view.roles.update(roles)
    return view


def _shared_prefix(trace: TrainingTrace, index: int) -> tuple[int | None, int]:
    """The longest start of turn ``index``'s prompt already shown by an earlier turn: that turn's full
    sequence (its parent, found first in an append-only history) or its prompt (a sibling)."""
    prompt = trace.turns[index].prompt_token_ids
    best: tuple[int | None, int] = (None, 0)
    for earlier in range(index - 1, -1, -1):
        other = trace.turns[earlier]
        start = len(other.prompt_token_ids)
        end = start + len(other.completion_token_ids)
        if start > len(prompt) or prompt[:start] != other.prompt_token_ids:
            continue
        if end <= len(prompt) and prompt[start:end] == other.completion_token_ids:
            if end > best[1]:
                best = (earlier, end)
            if earlier == index - 1:  # the previous call is the parent: the usual case, nothing longer
                break
        elif start > best[1]:
            best = (earlier, start)
    return best


def _tokens(turn: TrainingTurn, shared: int, text: TokenText) -> tuple[str, Counter[str]]:
    prompt, completion = turn.prompt_token_ids, turn.completion_token_ids
    mask = turn.loss_mask[len(prompt) :]
    auxiliary = bool(completion) and not any(mask)
    roles: Counter[str] = Counter(context=len(prompt) - shared)
    parts = [f'<span class="context" title="id {token}">{text[token]}</span>' for token in prompt[shared:]]
    for token, logp, bit in zip(completion, turn.per_token_logps, mask, strict=True):
        role = "auxiliary" if auxiliary else "trained" if bit else "discarded"
        roles[role] += 1
        parts.append(f'<span class="{role}" title="id {token}, logp {logp:.4f}">{text[token]}</span>')
    return "".join(parts), roles


class TokenText(dict[int, str]):
    """Escaped display text of each token id, decoded alone on first use, newlines marked; ``⟨id⟩`` without
    a tokenizer or for an id it cannot decode."""

    def __init__(self, tokenizer_dir: str | os.PathLike[str] | None) -> None:
        super().__init__()
        self._tokenizer: Any = None
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def __missing__(self, token: int) -> str:
        piece = ""
        if self._tokenizer is not None:
            try:
                piece = self._tokenizer.decode([token])
            # Slow tokenizers raise on an id past their vocabulary, fast ones give "": both show the id.
            except (IndexError, KeyError, ValueError, OverflowError):
                piece = ""
        text = html.escape(piece).replace("\n", "↵\n") if piece else f"⟨{token}⟩"
        self[token] = text
        return text
