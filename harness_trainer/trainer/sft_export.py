"""``harness-trainer export-sft``: a run's accepted rollouts as a dataset TRL's ``SFTTrainer`` loads as it is.

A rollout is accepted when its reward is set and at least ``min_reward``; one without a trace (a group
``rollout_log_steps`` left out, or nothing captured) is skipped and counted. Each trace becomes rows the
way the trainer builds its own (:func:`~harness_trainer.trainer.step.rows.build_rows`: one per leaf of the
trace's prefix forest, one for an append-only conversation), and each row holds, under TRL's names:

- ``messages``: the conversation in TRL's conversational format: the leaf call's request messages, then
  the reply the model sampled (its ``tool_calls`` kept), shaped as chat templates take them
  (:func:`~harness_trainer.dev_engine.chat.normalize_messages`: text content, tool-call arguments as
  objects), so the template the engine rendered with renders them to the row's own ids;
- ``tools``: the request's tool definitions as a JSON string (``SFTTrainer`` parses a string), or null;
- ``prompt_ids``, ``completion_ids``: the engine's exact ids, split before the row's first trained token;
- ``completion_mask``: one bit per completion id, 1 where the model sampled it and the row trains it,
  0 for context (tool results and other environment tokens, sampled tokens the capture masked out);
- ``task_name``, ``reward``, ``rollout_id``: from the rollout's record.

``SFTTrainer`` trains on ``messages`` (it tokenises them; no ``input_ids`` column, which would make it
skip that). The exact tokens, mask included, are its pre-tokenised form once mapped:
``input_ids = prompt_ids + completion_ids``, ``completion_mask = [0] * len(prompt_ids) + completion_mask``,
with ``completion_only_loss=True``. Rows with the same ids are one trajectory: the first is kept.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from harness_trainer.dev_engine.chat import RenderError, normalize_messages
from harness_trainer.trace import TrainingTrace
from harness_trainer.trainer.feed.evaluation import EVAL_ROLLOUTS_FILE, read_eval_rollouts
from harness_trainer.trainer.feed.rollout_log import ROLLOUTS_FILE, read_rollout_log
from harness_trainer.trainer.feed.rollout_records import RolloutRecord
from harness_trainer.trainer.step.outcome import completion_messages
from harness_trainer.trainer.step.rows import build_rows

Source = Literal["rollouts", "eval"]
Format = Literal["jsonl", "parquet", "hf"]
SOURCE_FILES: dict[Source, str] = {"rollouts": ROLLOUTS_FILE, "eval": EVAL_ROLLOUTS_FILE}
COLUMNS = (
    "messages", "tools", "prompt_ids", "completion_ids", "completion_mask",
    "task_name", "reward", "rollout_id",
)  # fmt: skip
_SUFFIXES: dict[Format, str] = {"jsonl": ".jsonl", "parquet": ".parquet", "hf": ""}


class ExportError(ValueError):
    """Nothing to export (no rollouts, none accepted, none with a trace) or a path that cannot be used."""


@dataclass(frozen=True)
class ExportSummary:
    """What an export did with a run's rollouts."""

    rollouts: int
    accepted: int
    """Reward set and at least the threshold."""
    without_trace: int
    """Accepted, but skipped: no trace logged."""
    without_tokens: int
    """Accepted with a trace that has no trained token (every turn masked out): skipped."""
    rows: int
    """Rows the accepted traces gave, duplicates included."""
    duplicates: int
    """Rows dropped: the same ids as an earlier row."""

    @property
    def written(self) -> int:
        """Rows in the dataset."""
        return self.rows - self.duplicates

    def line(self, min_reward: float) -> str:
        """The summary in one line."""
        return (
            f"{self.rollouts} rollouts, {self.accepted} accepted (reward >= {min_reward:g}); skipped "
            f"{self.without_trace} without a trace and {self.without_tokens} without a trained token; "
            f"{self.rows} rows, {self.duplicates} dropped as duplicate trajectories, {self.written} kept"
        )


def trace_rows(trace: TrainingTrace) -> list[dict[str, Any]]:
    """The conversation and token columns of each row of ``trace`` (module docstring); [] when nothing
    in it is trained. Pure."""
    entries = trace.to_trace_entries()
    sequences = [turn.prompt_token_ids + turn.completion_token_ids for turn in trace.turns]
    rows = []
    for row in build_rows(trace):
        # A row is its leaf call's whole sequence; identical calls are one leaf, the earliest (as built).
        entry = entries[sequences.index(row.input_ids)]
        tools = (entry.get("request") or {}).get("tools")
        start = row.targets.index(1)
        rows.append({
            "messages": _messages(entry),
            "tools": json.dumps(tools) if tools else None,
            "prompt_ids": row.input_ids[:start],
            "completion_ids": row.input_ids[start:],
            "completion_mask": row.targets[start:],
        })  # fmt: skip
    return rows


def _messages(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The call's request messages, then its reply: TRL's transcript (:func:`completion_messages`, the
    reply's text alone) with the reply's tool calls put back, as supervised data needs them."""
    messages = completion_messages([entry])
    choices = (entry.get("response") or {}).get("choices") or []
    calls = (choices[0].get("message") or {}).get("tool_calls") if choices else None
    if calls:
        messages[-1] = {**messages[-1], "tool_calls": calls}
    return normalize_messages(messages)


def sft_rows(
    records: Iterable[RolloutRecord], min_reward: float
) -> tuple[list[dict[str, Any]], ExportSummary]:
    """The rows of the accepted records, in their order, each trajectory once, and what was left out.
    Pure.

    Raises:
        ExportError: an accepted rollout's messages are not text (an image part), naming the rollout.
    """
    rows: list[dict[str, Any]] = []
    seen: set[tuple[int, ...]] = set()
    rollouts = accepted = without_trace = without_tokens = built = 0
    for record in records:
        rollouts += 1
        if record.reward is None or record.reward < min_reward:
            continue
        accepted += 1
        if record.trace is None:
            without_trace += 1
            continue
        try:
            shaped = trace_rows(record.trace)
        except RenderError as exc:
            raise ExportError(f"rollout {record.rollout_id} (group {record.group}): {exc}") from exc
        if not shaped:
            without_tokens += 1
        for row in shaped:
            built += 1
            key = (*row["prompt_ids"], *row["completion_ids"])
            if key in seen:
                continue
            seen.add(key)
            rows.append({
                **row, "task_name": record.task_name, "reward": record.reward,
                "rollout_id": record.rollout_id,
            })  # fmt: skip
    summary = ExportSummary(rollouts, accepted, without_trace, without_tokens, built, built - len(rows))
    return rows, summary


def resolve_input(path: Path, source: Source | None) -> tuple[Source, Path]:
    """Which records to read: a run folder's ``rollouts.jsonl`` (or ``eval_rollouts.jsonl`` with
    ``source="eval"``), or a file given directly, read as its name says (``eval_rollouts.jsonl`` as an
    evaluation's samples, any other as a rollout log).

    Raises:
        ExportError: no such file, or ``source`` contradicts the file named.
    """
    if path.is_dir():
        chosen: Source = source or "rollouts"
        file = path / SOURCE_FILES[chosen]
        if not file.is_file():
            raise ExportError(f"{path} has no {file.name}: not a run folder, or no rollout was logged yet")
        return chosen, file
    if not path.is_file():
        raise ExportError(f"{path} does not exist")
    named: Source = "eval" if path.name == EVAL_ROLLOUTS_FILE else "rollouts"
    if source is not None and source != named:
        raise ExportError(f"--source {source} does not match {path}: it is read as the {named} file")
    return named, path


def read_records(source: Source, file: Path) -> list[RolloutRecord]:
    """The records of ``file`` (as :func:`resolve_input` gives it) with the project's reader for
    ``source``, traces taken as written (they were validated when captured).

    Raises:
        ExportError: a line is not JSON or not a record (the message names the file and line).
    """
    try:
        if source == "eval":  # its reader takes the run folder
            return read_eval_rollouts(file.parent, validate_traces=False)
        return read_rollout_log(file, validate_traces=False)
    except ValueError as exc:
        raise ExportError(str(exc)) from exc


def default_output(file: Path, source: Source, fmt: Format) -> Path:
    """``sft.jsonl`` / ``sft.parquet`` / ``sft/`` (hf) beside the records; ``sft-eval...`` for an
    evaluation's samples."""
    stem = "sft" if source == "rollouts" else "sft-eval"
    return file.parent / f"{stem}{_SUFFIXES[fmt]}"


def write_dataset(rows: list[dict[str, Any]], out: Path, fmt: Format) -> None:
    """Write ``rows`` to ``out`` under a temporary name beside it, then rename it into place: a failure
    leaves no partial file. An existing file is replaced; an existing folder only when it is a dataset
    ``save_to_disk`` wrote and ``fmt`` is ``hf``.

    Raises:
        ExportError: ``out`` is a folder, or (for ``hf``) a file or a folder of something else.
    """
    if fmt == "hf" and out.exists() and not (out / "state.json").is_file():
        raise ExportError(f"{out} exists and is not a saved dataset: pick another --output")
    if fmt != "hf" and out.is_dir():
        raise ExportError(f"{out} is a folder: --format {fmt} writes a file")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if fmt == "jsonl":
            data = tmp / out.name
            data.write_bytes(b"".join(orjson.dumps({c: row[c] for c in COLUMNS}) + b"\n" for row in rows))
            os.replace(data, out)
        elif fmt == "parquet":
            data = tmp / out.name
            _dataset(rows).to_parquet(str(data))
            os.replace(data, out)
        else:
            data = tmp / "dataset"
            _dataset(rows).save_to_disk(str(data))
            if out.exists():  # a dataset written before: moved aside, dropped with the temporary folder
                out.rename(tmp / "replaced")
            data.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dataset(rows: list[dict[str, Any]]) -> Any:
    """``rows`` as a ``datasets.Dataset``. Messages are stored as JSON (``Json``): as Arrow structs,
    messages and tool arguments with different keys would come back with the missing ones set to null,
    and a chat template would render those."""
    from datasets import Dataset, Features, Json, List, Value

    ids = List(Value("int64"))
    features = Features({
        "messages": List(Json()), "tools": Value("string"), "prompt_ids": ids, "completion_ids": ids,
        "completion_mask": ids, "task_name": Value("string"), "reward": Value("float64"),
        "rollout_id": Value("string"),
    })  # fmt: skip
    return Dataset.from_list([{c: row[c] for c in COLUMNS} for row in rows], features=features)


def export_sft(
    path: Path,
    *,
    min_reward: float,
    fmt: Format = "jsonl",
    output: Path | None = None,
    source: Source | None = None,
) -> tuple[Path, ExportSummary]:
    """Export the accepted rollouts of ``path`` (a run folder or a records file, :func:`resolve_input`)
    as an SFT dataset; returns where it was written and the summary.

    Raises:
        ExportError: a threshold that is not a finite number; nothing to read, no rollout, none accepted,
            no accepted one with a trace, no row; or a path that cannot be used. Nothing is written then.
    """
    if not math.isfinite(min_reward):
        raise ExportError(f"--min-reward must be a finite number, not {min_reward}")
    chosen, file = resolve_input(path, source)
    records = read_records(chosen, file)
    if not records:
        raise ExportError(f"{file} holds no rollouts")
    rows, summary = sft_rows(records, min_reward)
    if summary.accepted == 0:
        best = max((r.reward for r in records if r.reward is not None), default=None)
        raise ExportError(
            f"no rollout of {file} has a reward >= {min_reward:g} ({summary.rollouts} rollouts, best reward "
            f"{'none' if best is None else f'{best:g}'})"
        )
    if not rows:
        why = f"{summary.without_trace} without a trace, {summary.without_tokens} without a trained token"
        if summary.without_trace:
            why += "; rollout_log_steps=N keeps one step's traces every N steps, 0 none"
        raise ExportError(
            f"none of the {summary.accepted} accepted rollouts of {file} has a trace with a trained token "
            f"({why})"
        )
    out = output if output is not None else default_output(file, chosen, fmt)
    write_dataset(rows, out, fmt)
    return out, summary
