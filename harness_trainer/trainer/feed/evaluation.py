"""Evaluation: ``k`` rollouts of every eval task at the current weights, scored and written down.

An evaluation is one pass over the eval rows: each row rolled out ``eval_num_generations`` times (one
group, seeded as training seeds its groups, from a seed of its own so every evaluation of a run, and the
same-seed runs of a benchmark, roll each task out with the same seeds), through a session factory of its
own (the trainer's builder with ``sampling=`` the eval policy and ``split=`` the eval split), run by a
:class:`~harness_trainer.trainer.feed.scheduling.RolloutScheduler` of its own. Eval rollouts are never trained
on and never enter the training scheduler, so they count toward no staleness bound; the trainer does not
step while it evaluates, so they all run at one weight version, which is recorded.

In a run that mixes harnesses (a factory whose ``harness_mix`` is mixed and whose ``create`` takes
``harness=``: :class:`~.eval_harnesses.PicksHarness`), every eval task is rolled out ``k`` times under
*each* harness of the mix: group ``h × tasks + i`` is task ``i`` under the ``h``-th harness
(:class:`~.eval_harnesses.EveryHarness`, which asks the factory for it by name), each (task, harness)
seeded as its group. A factory of one harness (or one that cannot be asked for a harness) is evaluated as
it always was: one group per task.

Scoring, per task and harness (pure: :func:`task_results`, :func:`summarize`, :func:`harness_summary`):

- a sample *passes* when its reward (the verifier's, after ``rollout_reward_fn``, as in training) is at
  least ``pass_reward``;
- an unscorable sample (an infrastructure failure: no sandbox, the engine gone) says nothing about the
  policy: it is left out of the task's ``n`` and counted in ``eval/unscorable``; a task with no scored
  sample is left out of the means;
- ``pass@1`` and ``pass@k`` are the unbiased estimates of Chen et al. (2021) from ``n`` scored samples of
  which ``c`` passed: ``1 - C(n - c, k) / C(n, k)`` (``pass@1`` = ``c / n``); ``pass@k`` uses the
  configured ``k``, and with fewer than ``k`` scored samples it uses ``n``.

Metrics (the step's ``metrics.jsonl`` line; ``eval_on_start``'s at step 0): ``eval/reward`` (mean reward
of the scored samples), ``eval/pass@1`` and ``eval/pass@k`` (means over tasks; in a mix, over every
(task, harness), so each harness weighs the same), ``eval/unscorable``, ``eval/tasks``,
``eval/policy_version``, ``eval/wall_s``; in a mix also, for each harness from its own samples alone,
``eval/harness/<name>/`` + ``reward``, ``pass@1``, ``pass@k``, ``unscorable`` and ``tasks``. When the
evaluation ends, ``output_dir/eval.jsonl`` gets one line per task (and harness, named in its ``harness``
key, which a run of one harness does not write) and evaluation (:class:`EvalRecord`), then
``output_dir/eval_rollouts.jsonl`` one line per sample
(the :class:`~.rollout_records.RolloutRecord` of training's ``rollouts.jsonl``, with
the evaluation's ``step`` and policy version, the task's group index and the ``trace``, null when none was
captured; unscorable samples included, with their reason), each file appended, flushed and synced; a
stopped evaluation writes neither. The split is in ``eval.jsonl`` only: a sample's task line there has its
``step``, ``task_name`` and ``task_index`` (:func:`read_eval_rollouts` reads the samples).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from harness_trainer.rollouts.client.contract import RolloutFactory
from harness_trainer.trainer.feed.eval_harnesses import EveryHarness
from harness_trainer.trainer.feed.rollout_log import read_jsonl, record_of
from harness_trainer.trainer.feed.rollout_records import RolloutRecord, member_record
from harness_trainer.trainer.feed.rollout_run import RewardFn
from harness_trainer.trainer.feed.scheduling import RolloutScheduler, SchedulerConfig
from harness_trainer.trainer.step.groups import Group

logger = logging.getLogger(__name__)

EVAL_FILE = "eval.jsonl"
EVAL_ROLLOUTS_FILE = "eval_rollouts.jsonl"
EVAL_SEED_OFFSET = 1_000_003
"""Added to the run's seed for eval groups: apart from the training groups' seeds (seed + group index)."""
HARNESS_PREFIX = "eval/harness/"
"""Each harness's eval metrics, in a run that mixes harnesses: ``eval/harness/<name>/pass@1`` …"""


class EvalRecord(BaseModel):
    """One task of one evaluation, as a line of ``eval.jsonl``."""

    step: int
    """The trainer's step when it ran (0: before training)."""
    policy_version: int
    split: str | None
    task_name: str | None
    task_index: int | None
    harness: str | None = None
    """The harness its samples ran, in a run that mixes harnesses (a run of one writes no ``harness``)."""
    k: int
    temperature: float
    rewards: list[float | None]
    """Each sample's reward; null when it was unscorable."""
    unscorable: list[str | None]
    """Each sample's unscorable reason, or null."""
    passed: int
    pass_at_1: float | None
    pass_at_k: float | None

    def line(self) -> dict[str, Any]:
        """The JSON object written, ``pass@1`` / ``pass@k`` spelled as in the metrics; ``harness`` only in a
        mix."""
        values = self.model_dump()
        if values["harness"] is None:
            del values["harness"]
        values["pass@1"] = values.pop("pass_at_1")
        values["pass@k"] = values.pop("pass_at_k")
        return values


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` passed (Chen et al., 2021); ``k`` is
    capped at ``n``.

    Raises:
        ValueError: ``n`` < 1, ``c`` outside ``[0, n]`` or ``k`` < 1.
    """
    if n < 1 or not 0 <= c <= n or k < 1:
        raise ValueError(f"pass@k needs n ≥ 1, 0 ≤ c ≤ n and k ≥ 1; got n={n}, c={c}, k={k}")
    k = min(k, n)
    if n - c < k:
        return 1.0
    # C(n - c, k) / C(n, k) as a product, exact in floats for the small n of an evaluation.
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


@dataclass(frozen=True)
class TaskResult:
    """One eval task's samples (under one harness, in a mix): each reward (None: unscorable) and unscorable
    reason."""

    task_name: str | None
    task_index: int | None
    rewards: tuple[float | None, ...]
    unscorable: tuple[str | None, ...]
    harness: str | None = None

    def scored(self) -> list[float]:
        return [reward for reward in self.rewards if reward is not None]

    def passed(self, pass_reward: float) -> int:
        return sum(reward >= pass_reward for reward in self.scored())


def task_results(groups: Sequence[Group]) -> list[TaskResult]:
    """Each eval group as its task's result (and its harness's); an ungraded sample (no reward, no reason) is
    unscorable."""
    results = []
    for group in groups:
        rewards = tuple(r.reward if r.scored else None for r in group.rollouts)
        reasons = tuple(None if r.scored else (r.unscorable or "ungraded") for r in group.rollouts)
        row = group.row
        results.append(
            TaskResult(row.get("task_name"), row.get("task_index"), rewards, reasons, harness=group.harness)
        )
    return results


def summarize(results: Sequence[TaskResult], *, k: int, pass_reward: float) -> dict[str, float]:
    """The ``eval/`` metrics of one evaluation (module docstring), over every result; NaN means where no
    task was scored. ``eval/tasks`` counts tasks, not (task, harness) results: in a mix every task has one
    result per harness."""
    scored = [r for r in results if r.scored()]
    rewards = [reward for r in scored for reward in r.scored()]
    at_1 = [pass_at_k(len(r.scored()), r.passed(pass_reward), 1) for r in scored]
    at_k = [pass_at_k(len(r.scored()), r.passed(pass_reward), k) for r in scored]
    harnesses = {r.harness for r in results}
    return {
        "eval/reward": _mean(rewards),
        "eval/pass@1": _mean(at_1),
        "eval/pass@k": _mean(at_k),
        "eval/unscorable": float(sum(reason is not None for r in results for reason in r.unscorable)),
        "eval/tasks": float(len(results) // max(len(harnesses), 1)),
    }


def harness_summary(results: Sequence[TaskResult], *, k: int, pass_reward: float) -> dict[str, float]:
    """Each harness's :func:`summarize`, from its own results alone, under ``eval/harness/<name>/``; {} when
    no result names a harness (a run of one)."""
    by_harness: dict[str, list[TaskResult]] = {}
    for result in results:
        if result.harness is not None:
            by_harness.setdefault(result.harness, []).append(result)
    metrics: dict[str, float] = {}
    for name, mine in by_harness.items():
        for key, value in summarize(mine, k=k, pass_reward=pass_reward).items():
            metrics[f"{HARNESS_PREFIX}{name}/{key.removeprefix('eval/')}"] = value
    return metrics


def harness_names(metrics: dict[str, Any]) -> list[str]:
    """The harnesses a metrics line has eval metrics of (``eval/harness/<name>/pass@1``), sorted."""
    suffix = "/pass@1"
    return sorted(
        key[len(HARNESS_PREFIX) : -len(suffix)]
        for key in metrics
        if key.startswith(HARNESS_PREFIX) and key.endswith(suffix)
    )


def eval_records(
    results: Sequence[TaskResult], *, step: int, policy_version: int, split: str | None, k: int,
    temperature: float, pass_reward: float,
) -> list[EvalRecord]:  # fmt: skip
    """One :class:`EvalRecord` per task."""
    records = []
    for r in results:
        n, c = len(r.scored()), r.passed(pass_reward)
        records.append(
            EvalRecord(
                step=step,
                policy_version=policy_version,
                split=split,
                task_name=r.task_name,
                task_index=r.task_index,
                harness=r.harness,
                k=k,
                temperature=temperature,
                rewards=list(r.rewards),
                unscorable=list(r.unscorable),
                passed=c,
                pass_at_1=pass_at_k(n, c, 1) if n else None,
                pass_at_k=pass_at_k(n, c, k) if n else None,
            )
        )
    return records


def instruction_of(row: dict[str, Any]) -> str | None:
    """A dataset row's instruction: its ``prompt`` (text, or the last user message's content)."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt.strip()
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1].strip()
    return None


def overlapping_tasks(train_rows: Sequence[dict[str, Any]], eval_rows: Sequence[dict[str, Any]]) -> list[str]:
    """The eval rows whose instruction is also a training row's, named (task name, else the instruction's
    start)."""
    trained = {text for row in train_rows if (text := instruction_of(row))}
    overlap = []
    for row in eval_rows:
        text = instruction_of(row)
        if text is not None and text in trained:
            overlap.append(str(row.get("task_name") or text[:60]))
    return overlap


class Evaluator:
    """Runs evaluations of the eval rows through ``factory`` and writes ``eval.jsonl`` and
    ``eval_rollouts.jsonl``.

    Args:
        factory: the eval session factory (the trainer's builder with the eval sampling and split); one
            that mixes harnesses has each task rolled out under each (module docstring).
        rows: the eval rows, one task each.
        k: rollouts per task.
        seed: the run's seed; eval groups are seeded from it plus :data:`EVAL_SEED_OFFSET`.
        temperature: the eval sampling temperature, checked on every captured turn and recorded.
        pass_reward: the pass test.
        max_concurrent_rollouts, rollout_timeout, vocab_size, max_unexpected_errors: as in training.
        reward_fn: the run's ``rollout_reward_fn``.
        output_dir: where ``eval.jsonl`` and ``eval_rollouts.jsonl`` are.
        split: the eval split's name, recorded.
    """

    def __init__(
        self,
        factory: RolloutFactory,
        rows: Sequence[dict[str, Any]],
        *,
        k: int,
        seed: int,
        temperature: float,
        pass_reward: float,
        max_concurrent_rollouts: int,
        rollout_timeout: float | None,
        vocab_size: int | None,
        max_unexpected_errors: int = 3,
        reward_fn: RewardFn | None,
        output_dir: Path,
        split: str | None,
    ) -> None:
        if not rows:
            raise ValueError("the eval dataset has no rows")
        self.rows = list(rows)
        every = EveryHarness.of(factory, len(self.rows))
        self.harnesses = every.names if every is not None else None
        """The harnesses every eval task is rolled out under, in a mix; None for a factory of one."""
        self.factory: RolloutFactory = every if every is not None else factory
        self.num_groups = len(self.rows) * (len(self.harnesses) if self.harnesses else 1)
        # One pass over the rows (under each harness), all admitted at once, each evaluation with the same
        # seeds.
        self.config = SchedulerConfig(
            num_generations=k, max_concurrent_rollouts=max_concurrent_rollouts,
            admission_limit=self.num_groups, max_groups=self.num_groups, rollout_timeout=rollout_timeout,
            seed=seed + EVAL_SEED_OFFSET, vocab_size=vocab_size, temperature=temperature,
            max_unexpected_errors=max_unexpected_errors,
        )  # fmt: skip
        self.reward_fn = reward_fn
        self.path = output_dir / EVAL_FILE
        self.rollouts_path = output_dir / EVAL_ROLLOUTS_FILE
        self.split = split
        self.pass_reward = pass_reward

    def evaluate(
        self, step: int, policy_version: int, stop: threading.Event
    ) -> tuple[dict[str, float], list[EvalRecord]] | None:
        """One evaluation at ``policy_version``: its metrics and its records, once they are in
        ``eval.jsonl`` and its samples in ``eval_rollouts.jsonl``; None when ``stop`` was set first (nothing
        is written). Every eval session is closed on every path.

        Raises:
            what :meth:`RolloutScheduler.next_group` raises (a malformed capture, a broken reward function).
        """
        started = time.monotonic()
        scheduler = RolloutScheduler(
            self.factory, self.rows, self.config, reward_fn=self.reward_fn,
            policy_version=lambda: policy_version,
        )  # fmt: skip
        groups: list[Group] = []
        scheduler.start()
        try:
            while len(groups) < self.num_groups:
                if stop.is_set():
                    return None
                group = scheduler.next_group(timeout=0.5)
                if group is not None:
                    groups.append(group)
        finally:
            scheduler.stop()
        k, temperature = self.config.num_generations, float(self.config.temperature or 0.0)
        results = task_results(groups)
        records = eval_records(
            results, step=step, policy_version=policy_version, split=self.split, k=k,
            temperature=temperature, pass_reward=self.pass_reward,
        )  # fmt: skip
        _append(self.path, [orjson.dumps(record.line()) for record in records])
        # fallback=str, as in rollouts.jsonl: a verifier's finding holding an odd object must not fail it.
        samples = sample_records(groups, step)
        _append(self.rollouts_path, [record.model_dump_json(fallback=str).encode() for record in samples])
        metrics = summarize(results, k=k, pass_reward=self.pass_reward)
        metrics |= harness_summary(results, k=k, pass_reward=self.pass_reward)
        metrics["eval/policy_version"] = float(policy_version)
        metrics["eval/wall_s"] = time.monotonic() - started
        logger.info(eval_line(step, policy_version, metrics, k, len(self.rows), self.split))
        return metrics, records


def sample_records(groups: Sequence[Group], step: int) -> list[RolloutRecord]:
    """Each eval sample's record, with its trace, at the evaluation's ``step``, task by task."""
    return [member_record(group, rollout, step=step) for group in groups for rollout in group.rollouts]


def read_eval(output_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The lines of a run's ``eval.jsonl`` (an unterminated last line skipped); [] when there is none."""
    path = Path(output_dir) / EVAL_FILE
    if not path.exists():
        return []
    return [values for _, _, values in read_jsonl(path)]


def read_eval_rollouts(
    output_dir: str | os.PathLike[str], *, validate_traces: bool = True
) -> list[RolloutRecord]:
    """The samples of a run's ``eval_rollouts.jsonl`` in the order written (an unterminated last line
    skipped); [] when there is none. A resumed run that evaluates a step again appends its samples again:
    the later ones are that step's. ``validate_traces`` as in
    :func:`~harness_trainer.trainer.feed.rollout_log.read_rollout_log`.

    Raises:
        ValueError: a line is not JSON or not a rollout record; the message names the file and the line.
    """
    path = Path(output_dir) / EVAL_ROLLOUTS_FILE
    if not path.exists():
        return []
    records = []
    for number, _, values in read_jsonl(path):
        try:
            records.append(record_of(values, validate_trace=validate_traces))
        except ValidationError as exc:
            raise ValueError(f"{path}:{number}: not a rollout record: {exc}") from exc
    return records


def eval_line(
    step: int, policy_version: int, metrics: dict[str, float], k: int, tasks: int, split: str | None
) -> str:
    """One evaluation as a line: pass@1, and pass@k when k > 1 (with k = 1 they are one number); in a mix,
    each harness's too."""

    def passes(prefix: str) -> str:
        said = f"pass@1 {metrics[prefix + 'pass@1']:.3f}"
        return said + (f", pass@{k} {metrics[prefix + 'pass@k']:.3f}" if k > 1 else "")

    names = harness_names(metrics)
    where = f" of split {split!r}" if split else ""
    each = f" under each of {len(names)} harnesses" if names else ""
    line = (
        f"eval at step {step} (weights v{policy_version}): {passes('eval/')} over {tasks} tasks{where}"
        f"{each}, {k} sample{'s' if k > 1 else ''} each, in {metrics['eval/wall_s']:.0f} s"
    )
    return line + "".join(f"; {name}: {passes(f'{HARNESS_PREFIX}{name}/')}" for name in names)


def _append(path: Path, lines: list[bytes]) -> None:
    with path.open("ab") as handle:
        handle.write(b"".join(line + b"\n" for line in lines))
        handle.flush()
        os.fsync(handle.fileno())


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan
