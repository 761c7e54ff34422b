"""The run's full record of its rollouts: ``output_dir/rollouts.jsonl``, every rollout as it completes;
:class:`RolloutLog` writes it, :func:`read_rollout_log` reads it. Its records, and how a finished rollout or
a step becomes them, are in :mod:`.rollout_records`.

Three kinds of line, one JSON object each, appended and synced to disk (``fsync``) as they are written:

- **A rollout** (a :class:`RolloutRecord` with ``"step": null``), written from the scheduler's side as each
  rollout completes, errored and unscorable ones included, whether or not a step ever takes its group.
  Fields, in this order: ``step`` (null when written), ``group``, ``member``, ``rollout_id`` (the episode
  id its factory was given, ``group{G}-member{M}``), ``capture_session_id`` (the capture session its model
  calls went through, unscorable rollouts included when they got one, else null; its journal is
  ``DATA_DIR/sessions/ID`` in the capture proxy's data folder, read by ``harness-trainer proxy-trace``),
  ``task_name``, ``task_index``, ``harness`` (the agent its group ran, in a run that mixes harnesses;
  else null), ``reward`` (after ``rollout_reward_fn``), ``env_reward`` (the
  verifier's), ``advantage`` and ``not_trained`` (null when written: the step's outcome line sets them),
  ``unscorable`` (the reason, or null), ``timed_out``, ``seconds`` (the scheduler's wall time), ``llm_s``,
  ``env_s``, ``other_s`` (that time split: trainer/step/timesplit.py), ``policy_version`` (when it started),
  ``dispatch_version_min`` / ``_max`` and ``return_version_min`` / ``_max`` (over its turns: the policy
  version the capture proxy knew when it sent each call, and the version that answered; null without
  any), ``tool_call_count``, ``tool_failure_count``, ``tool_calls_by_name``, ``phase_seconds``,
  ``sandbox_seconds`` (what its sandboxes ran for, null when not reported), ``snapshot`` (the snapshot its
  sandbox started from when its group was set up once: rollouts/server/group_setup.py; else null),
  ``findings`` (the verifier's, dicts or strings), ``agreement`` and ``agreement_detail`` (the agent's own
  record of its model calls against the capture: ``match``, ``mismatch`` with the first difference, or
  ``not_available``; null when not checked: harness_trainer/rollouts/agreement.py), ``trace_logged``
  (whether its trace is written) and ``trace`` (the TrainingTrace JSON; null when nothing was captured,
  or when ``rollout_log_steps`` leaves this group's trace out).
- **An outcome** (:class:`RolloutOutcome`, ``{"kind": "outcome", "step", "group", "member", "advantage",
  "not_trained"}``), written by the trainer when a step takes the rollout's group: the step, and either
  the advantage it trained with or why it did not train (:data:`.rollout_records.NOT_TRAINED_REASONS`).
  A group dropped while a step gathers its groups gets that step's outcomes.
- **A run start** (:class:`RunStart`, ``{"kind": "start", "step", "start_group"}``), written when a run
  (fresh or resumed) opens the log: the step it starts after and the first group it will roll out.

Rollout lines are written per rollout, not per group: a crash loses only the rollouts still running, and
a member held up (an agent running to its timeout) does not hold back its siblings' lines. They are the
bulk of the file (a trace per rollout), so ``rollout_log_steps`` = N keeps the traces of one step's worth
of groups every N steps: group ``g``'s when ``g // groups_per_step + 1`` is a multiple of N (the groups
that would train at every N-th step, were none dropped); 0 keeps none. Every other field is always
written. Groups a stopping run had taken and dropped, for a step that never came, get that step's outcomes
when it closes the log; the groups it had not taken have none.

Readers (:func:`read_rollout_log`) merge each rollout with its outcome into one :class:`RolloutRecord`;
a rollout no step took reads with ``step`` null and ``not_trained`` = :data:`NOT_TAKEN`. A run start
supersedes what earlier runs wrote that it will write again: rollouts of groups from ``start_group`` on
(it re-runs them), and outcomes and old-format records of steps after ``step`` (it trains them again).
For a rollout written twice otherwise, the last line wins.

Files written before this format hold one line per rollout of each logged step, with the step set
(``advantage`` null when not trained): they read as before (a step lower than the one before, or a rollout
repeated within a step, means a resumed run wrote from that step again: :func:`latest_steps`), with
``not_trained`` derived from them (:data:`.rollout_records.UNSCORABLE`, :data:`.rollout_records.UNGRADED`,
else :data:`NOT_TRAINED`) and the newer fields at their defaults; before ``rollout_id`` and
``capture_session_id`` existed, both read null.

A line a crash cut short is dropped when the log is opened again, and skipped by readers.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Hashable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import orjson
from pydantic import ValidationError

from harness_trainer.trace import TrainingTrace, TrainingTurn
from harness_trainer.trainer.feed.rollout_records import (
    NOT_TAKEN,
    NOT_TRAINED,
    RolloutOutcome,
    RolloutRecord,
    RunStart,
    own_reason,
)

logger = logging.getLogger(__name__)

ROLLOUTS_FILE = "rollouts.jsonl"
# How RolloutLog writes a rollout's first fields (pydantic dumps fields in declaration order); a null step
# is a rollout line of this format, a number one of the format before it.
_HEAD = re.compile(rb'\{"step":(-?\d+|null),"group":(-?\d+),"member":(-?\d+),')
_KIND = b'{"kind":'

_BLOCK = 1 << 20  # bytes read at a time when looking back for the last newline

T = TypeVar("T")


class RolloutLog:
    """Appends lines to ``output_dir/rollouts.jsonl``, from any thread; a context manager, :meth:`close`
    idempotent."""

    def __init__(self, output_dir: str | os.PathLike[str]) -> None:
        self.path = Path(output_dir) / ROLLOUTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            _drop_cut_short_line(self.path)
        self._file = open(self.path, "ab")
        # The scheduler's threads write rollouts while the trainer writes outcomes: a line is never split.
        self._lock = threading.Lock()

    def write(self, records: Iterable[RolloutRecord | RolloutOutcome | RunStart]) -> None:
        """Append lines, then flush and sync them to disk together.

        Raises:
            RuntimeError: the log is closed.
        """
        # fallback=str: a verifier's finding holding an odd object must not stop training over a log line.
        # Serialised outside the lock: a long trace takes a while, and other writers need not wait for it.
        lines = b"".join(record.model_dump_json(fallback=str).encode() + b"\n" for record in records)
        with self._lock:
            if self._file.closed:
                raise RuntimeError("RolloutLog.write after close")
            self._file.write(lines)
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the file; a second call does nothing."""
        with self._lock:
            self._file.close()

    def __enter__(self) -> RolloutLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _drop_cut_short_line(path: Path) -> None:
    """Truncate an unterminated last line (a write cut short by a crash), so that what a resumed run
    appends starts a line of its own instead of gluing onto it."""
    with open(path, "rb+") as file:
        end = file.seek(0, os.SEEK_END)
        position = end
        while position > 0:
            start = max(0, position - _BLOCK)
            file.seek(start)
            block = file.read(position - start)
            newline = block.rfind(b"\n")
            if newline >= 0:
                position = start + newline + 1
                break
            position = start
        if position < end:
            logger.warning(
                "%s: dropping an unterminated last line of %d bytes (a write cut short)", path, end - position
            )
            file.truncate(position)


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes, dict[str, Any]]]:
    """``(line number, line, parsed object)`` for each non-blank line of an append-only JSONL file.

    An unterminated last line that does not parse (a write cut short by a crash) is skipped with a warning.

    Raises:
        ValueError: a line is not a JSON object; the message names the file and the line.
    """
    for number, _, line in _lines(path):
        yield number, line, _parse(path, number, line)


def _lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, int, bytes]]:
    """Non-blank lines with their numbers and byte offsets, less an unterminated last line that does not
    parse."""
    offset = 0
    with open(path, "rb") as file:
        for number, line in enumerate(file, start=1):
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            if not line.endswith(b"\n"):  # the last line: complete, or a write cut short by a crash
                try:
                    orjson.loads(line)
                except orjson.JSONDecodeError:
                    logger.warning(
                        "%s:%d: skipping an unterminated last line (a write cut short)", path, number
                    )
                    return
            yield number, start, line


def _parse(path: str | os.PathLike[str], number: int, line: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path}:{number}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}:{number}: expected a JSON object, got {type(value).__name__}")
    return value


def latest_steps(
    entries: Iterable[tuple[int, Hashable, T]], *, last: int | None = None
) -> dict[int, list[T]]:
    """Entries by step, in step order, keeping only the latest timeline; ``entries`` are
    ``(step, key, item)`` in file order, ``key`` naming the item within its step.

    A step lower than the one before, or a key repeated within a step, means a resumed run wrote from that
    step again: everything kept from that step on is dropped. With ``last``, only the last ``last`` steps
    are kept (trimmed as the entries stream, so a later rewind past trimmed steps shows fewer).
    """
    kept: dict[int, list[T]] = {}
    previous: int | None = None
    keys: set[Hashable] = set()
    for step, key, item in entries:
        if previous is not None and (step < previous or (step == previous and key in keys)):
            for stale in [s for s in kept if s >= step]:
                del kept[stale]
            previous = None
        if step != previous:
            keys = set()
        keys.add(key)
        kept.setdefault(step, []).append(item)
        previous = step
        if last is not None and len(kept) > last:
            del kept[next(iter(kept))]
    return kept


def read_rollout_log(
    path: str | os.PathLike[str], *, last_steps: int | None = None, validate_traces: bool = True
) -> list[RolloutRecord]:
    """The rollouts of ``path`` (a ``rollouts.jsonl``, or the run folder holding it), merged with their
    outcomes, superseded lines left out (module docstring): those a step took in step order (then in the
    order their outcomes were written), then those no step took, by group and member. With
    ``last_steps``, only those of the last steps that took any, and those no step took.

    A rollout's step, group and member are read from its line's head, and only the kept lines are parsed,
    so reading the end of a long run costs little more than reading the lines. ``validate_traces=False``
    takes the traces as written (they were validated when captured): checking every id of a long trace
    again costs far more than parsing it.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not JSON or not a record; the message names the file and the line.
    """
    file = Path(path)
    if file.is_dir():
        file = file / ROLLOUTS_FILE
    # Rollout lines are kept as (line number, byte offset): the lines themselves, traces and all, are read
    # again only for the records returned.
    old_format: list[tuple[int, Hashable, tuple[int, int]]] = []
    completed: dict[tuple[int, int], tuple[int, int]] = {}
    outcomes: dict[tuple[int, int], RolloutOutcome] = {}
    for number, offset, line in _lines(file):
        if line.startswith(_KIND):
            kind = _kind_line(file, number, line)
            if isinstance(kind, RolloutOutcome):
                outcomes.pop((kind.group, kind.member), None)  # re-inserted: the dict keeps write order
                outcomes[(kind.group, kind.member)] = kind
            else:  # a run start: what it writes again is superseded
                old_format = [entry for entry in old_format if entry[0] <= kind.step]
                completed = {key: value for key, value in completed.items() if key[0] < kind.start_group}
                outcomes = {key: value for key, value in outcomes.items() if value.step <= kind.step}
            continue
        step, group, member = _head(file, number, line)
        if step is None:
            completed[(group, member)] = (number, offset)
        else:
            old_format.append((step, (group, member), (number, offset)))

    taken: list[tuple[int, RolloutOutcome | None, tuple[int, int]]] = [
        (step, None, item) for step, items in latest_steps(old_format).items() for item in items
    ]
    taken += [(o.step, o, completed[key]) for key, o in outcomes.items() if key in completed]
    taken.sort(key=lambda entry: entry[0])  # stable: old-format lines, then outcomes, in file order
    kept_steps = sorted({step for step, _, _ in taken})
    if last_steps is not None:
        kept_steps = kept_steps[-last_steps:] if last_steps > 0 else []
    keep = set(kept_steps)
    untaken = [completed[key] for key in sorted(completed) if key not in outcomes]
    records = []
    with open(file, "rb") as lines:
        for outcome, (number, offset) in [(o, item) for step, o, item in taken if step in keep] + [
            (None, item) for item in untaken
        ]:
            lines.seek(offset)
            try:
                record = _record(file, number, lines.readline(), validate_traces)
            except ValidationError as exc:
                raise ValueError(f"{file}:{number}: not a rollout record: {exc}") from exc
            records.append(_merged(record, outcome))
    return records


def _merged(record: RolloutRecord, outcome: RolloutOutcome | None) -> RolloutRecord:
    """``record`` with its step, advantage and reason not to train, from ``outcome`` or (an old-format
    record, or one no step took) from itself."""
    if outcome is not None:
        return record.model_copy(
            update={"step": outcome.step, "advantage": outcome.advantage, "not_trained": outcome.not_trained}
        )
    if record.step is None:
        return record.model_copy(update={"not_trained": NOT_TAKEN})
    if record.advantage is None and record.not_trained is None:
        return record.model_copy(update={"not_trained": own_reason(record) or NOT_TRAINED})
    return record


def _head(file: Path, number: int, line: bytes) -> tuple[int | None, int, int]:
    """A rollout line's step (None: this format's completion line), group and member."""
    head = _HEAD.match(line)
    if head is not None:
        step, group, member = head.groups()
        return (None if step == b"null" else int(step)), int(group), int(member)
    value = _parse(file, number, line)  # not as RolloutLog writes it; the full record may still be one
    step, group, member = value.get("step"), value.get("group"), value.get("member")
    if not (step is None or type(step) is int) or not all(type(f) is int for f in (group, member)):
        raise ValueError(f"{file}:{number}: a rollout record needs integer step, group and member")
    return step, group, member


def _kind_line(file: Path, number: int, line: bytes) -> RolloutOutcome | RunStart:
    value = _parse(file, number, line)
    kinds: dict[Any, type[RolloutOutcome] | type[RunStart]] = {"outcome": RolloutOutcome, "start": RunStart}
    model = kinds.get(value.get("kind"))
    if model is None:
        raise ValueError(f"{file}:{number}: unknown record kind {value.get('kind')!r}")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise ValueError(f"{file}:{number}: not a {value['kind']} record: {exc}") from exc


def _record(file: Path, number: int, line: bytes, validate_trace: bool) -> RolloutRecord:
    if validate_trace:
        return RolloutRecord.model_validate_json(line)
    return record_of(_parse(file, number, line), validate_trace=False)


def record_of(values: dict[str, Any], *, validate_trace: bool = True) -> RolloutRecord:
    """A rollout line, parsed, as its record. ``validate_trace=False`` takes the trace as written (it was
    validated when captured; checking every id of a long trace again costs far more than parsing it).

    Raises:
        pydantic.ValidationError: not a rollout record.
    """
    if validate_trace:
        return RolloutRecord.model_validate(values)
    value = dict(values)
    trace = value.pop("trace", None)
    if trace is not None:
        turns = [TrainingTurn.model_construct(**turn) for turn in trace.get("turns", [])]
        value["trace"] = TrainingTrace.model_construct(schema_version=1, turns=turns)
    return RolloutRecord.model_validate(value)  # a model instance is taken as it is, not validated again
