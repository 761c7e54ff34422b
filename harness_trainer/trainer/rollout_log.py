"""What each trained step's rollouts looked like: ``output_dir/rollouts.jsonl``, one line per rollout.

Record format (one :class:`RolloutRecord` as JSON per line, fields in this order): ``step``, ``group``,
``member``, ``rollout_id`` (the episode id its factory was given, ``group{G}-member{M}``),
``capture_session_id`` (the capture session its model calls went through, unscorable rollouts included
when they got one, else null; its journal is ``DATA_DIR/sessions/ID`` in the capture proxy's data folder,
read by ``harness-trainer proxy-trace``), ``task_name``, ``task_index``, ``reward`` (the trained reward,
after ``rollout_reward_fn``), ``env_reward`` (the verifier's), ``advantage`` (null when the rollout was
not trained: unscorable, ungraded, a dropped group, a zero advantage left out), ``unscorable`` (the
reason, or null), ``timed_out``, ``seconds``, ``policy_version``, ``tool_call_count``,
``tool_failure_count``, ``tool_calls_by_name``, ``phase_seconds``, ``findings`` (the verifier's, dicts or
strings) and ``trace`` (the TrainingTrace JSON, or null when nothing was captured). Every rollout of a
step's groups is logged, dropped groups included. Records written before ``rollout_id`` and
``capture_session_id`` existed read with both null.

The file is appended to (a resumed run writes to the same file) and flushed once per step, so a crash
loses at most the step being written; a line it cut short is dropped when the log is opened again.
Readers take the latest timeline: when a resumed run writes a step again, what the earlier run wrote
from that step on is superseded (:func:`latest_steps`, also used for ``metrics.jsonl``), and an
unterminated last line is skipped.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Hashable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, Field, ValidationError

from harness_trainer.trace import TrainingTrace, TrainingTurn
from harness_trainer.trainer.groups import Rollout

logger = logging.getLogger(__name__)

ROLLOUTS_FILE = "rollouts.jsonl"
# How RolloutLog writes a record's first fields (pydantic dumps fields in declaration order).
_HEAD = re.compile(rb'\{"step":(-?\d+),"group":(-?\d+),"member":(-?\d+),')

_BLOCK = 1 << 20  # bytes read at a time when looking back for the last newline

T = TypeVar("T")


class RolloutRecord(BaseModel):
    """One rollout of a trained step, as written to ``rollouts.jsonl`` (format in the module docstring)."""

    step: int
    group: int
    member: int
    rollout_id: str | None = None
    capture_session_id: str | None = None
    task_name: str | None = None
    task_index: int | None = None
    reward: float | None = None
    env_reward: float | None = None
    advantage: float | None = None
    unscorable: str | None = None
    timed_out: bool = False
    seconds: float = 0.0
    policy_version: int = 0
    tool_call_count: int = 0
    tool_failure_count: int = 0
    tool_calls_by_name: dict[str, int] = Field(default_factory=dict)
    phase_seconds: dict[str, float] = Field(default_factory=dict)
    """Where the rollout's time went, by phase (``verify.metrics["phase_seconds"]``), when reported."""
    findings: list[dict[str, Any] | str] = Field(default_factory=list)
    trace: TrainingTrace | None = None


def rollout_record(
    rollout: Rollout,
    *,
    step: int,
    task_name: str | None,
    task_index: int | None,
    advantage: float | None,
    verify_metrics: dict[str, Any] | None,
    findings: list[Any] | None,
) -> RolloutRecord:
    """The record of ``rollout`` at ``step``. Cheap: the trace is referenced, not copied or re-validated;
    it is serialised when the record is written.

    Tool counts come from the rollout's outcome (which already prefers the session's own counts), else
    from ``verify_metrics``; a finding that is neither a dict nor a string is kept as its ``str``.
    """
    metrics = verify_metrics or {}
    outcome = rollout.outcome
    if outcome is not None:
        calls_by_name = outcome.tool_calls_by_name
        failures = outcome.tool_failure_count
    else:
        calls_by_name = {str(k): int(v) for k, v in (metrics.get("tool_calls_by_name") or {}).items()}
        failures = int(metrics.get("tool_failure_count") or 0)
    return RolloutRecord(
        step=step,
        group=rollout.group,
        member=rollout.member,
        rollout_id=rollout.rollout_id,
        capture_session_id=rollout.capture_session_id,
        task_name=None if task_name is None else str(task_name),
        task_index=task_index,
        reward=rollout.reward,
        env_reward=outcome.env_reward if outcome is not None else None,
        advantage=advantage,
        unscorable=rollout.unscorable,
        timed_out=rollout.timed_out,
        seconds=rollout.seconds,
        policy_version=rollout.policy_version,
        tool_call_count=sum(calls_by_name.values()),
        tool_failure_count=failures,
        tool_calls_by_name=calls_by_name,
        phase_seconds={str(k): float(v) for k, v in (metrics.get("phase_seconds") or {}).items()},
        findings=[item if isinstance(item, dict | str) else str(item) for item in findings or []],
        trace=rollout.trace,
    )


class RolloutLog:
    """Appends records to ``output_dir/rollouts.jsonl``; a context manager, :meth:`close` idempotent."""

    def __init__(self, output_dir: str | os.PathLike[str]) -> None:
        self.path = Path(output_dir) / ROLLOUTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            _drop_cut_short_line(self.path)
        self._file = open(self.path, "ab")

    def write(self, records: Iterable[RolloutRecord]) -> None:
        """Append one step's records and flush them together.

        Raises:
            RuntimeError: the log is closed.
        """
        if self._file.closed:
            raise RuntimeError("RolloutLog.write after close")
        # fallback=str: a verifier's finding holding an odd object must not stop training over a log line.
        lines = [record.model_dump_json(fallback=str).encode() + b"\n" for record in records]
        self._file.write(b"".join(lines))
        self._file.flush()

    def close(self) -> None:
        """Close the file; a second call does nothing."""
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
    for number, line in _lines(path):
        yield number, line, _parse(path, number, line)


def _lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes]]:
    """Non-blank lines with their numbers, less an unterminated last line that does not parse."""
    with open(path, "rb") as file:
        for number, line in enumerate(file, start=1):
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
            yield number, line


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
    """The records of ``path`` (a ``rollouts.jsonl``, or the run folder holding it), latest timeline only
    (see :func:`latest_steps`), in step order; with ``last_steps``, only those of the last steps.

    A line's step, group and member are read from its head, and only the kept lines are parsed, so reading
    the end of a long run costs little more than reading the lines. ``validate_traces=False`` takes the
    traces as written (they were validated when captured): checking every id of a long trace again costs
    far more than parsing it.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not JSON or not a record; the message names the file and the line.
    """
    file = Path(path)
    if file.is_dir():
        file = file / ROLLOUTS_FILE

    def entries() -> Iterator[tuple[int, Hashable, tuple[int, bytes]]]:
        for number, line in _lines(file):
            head = _HEAD.match(line)
            if head is not None:
                step, group, member = map(int, head.groups())
            else:  # not as RolloutLog writes it; the full record may still be one
                value = _parse(file, number, line)
                step, group, member = value.get("step"), value.get("group"), value.get("member")
                if not all(type(field) is int for field in (step, group, member)):
                    raise ValueError(
                        f"{file}:{number}: a rollout record needs integer step, group and member"
                    )
            yield step, (group, member), (number, line)

    records = []
    for lines in latest_steps(entries(), last=last_steps).values():
        for number, line in lines:
            try:
                records.append(_record(file, number, line, validate_traces))
            except ValidationError as exc:
                raise ValueError(f"{file}:{number}: not a rollout record: {exc}") from exc
    return records


def _record(file: Path, number: int, line: bytes, validate_trace: bool) -> RolloutRecord:
    if validate_trace:
        return RolloutRecord.model_validate_json(line)
    value = _parse(file, number, line)
    trace = value.pop("trace", None)
    if trace is not None:
        turns = [TrainingTurn.model_construct(**turn) for turn in trace.get("turns", [])]
        value["trace"] = TrainingTrace.model_construct(schema_version=1, turns=turns)
    return RolloutRecord.model_validate(value)  # a model instance is taken as it is, not validated again
