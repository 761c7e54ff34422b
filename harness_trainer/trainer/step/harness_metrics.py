"""Per-harness metrics of a step, in a run that mixes harnesses (:mod:`harness_trainer.rollouts.harness_mix`).

Pure: read from the step's finished groups, whose ``harness`` the scheduler set from the factory (None in
a run of one harness, which gets none of these). For each harness with a group in the step, under
``harness/<name>/``: ``groups``, ``rollouts``, ``reward`` (mean over its scored rollouts; absent when none
scored), ``unscorable`` (rollouts that failed), ``timed_out``, ``num_turns`` and ``completion_tokens``
(means over its rollouts with a trace), and ``agreement_match`` / ``_mismatch`` / ``_not_available``
(:func:`~harness_trainer.trainer.step.batch.agreement_metrics`). A harness without a group in the step
logs nothing that step, so its curve joins the steps it has.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from harness_trainer.trainer.step.batch import agreement_metrics
from harness_trainer.trainer.step.groups import Group

PREFIX = "harness/"


def harness_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """The step's metrics per harness (module docstring)."""
    by_harness: dict[str, list[Group]] = {}
    for group in groups:
        if group.harness is not None:
            by_harness.setdefault(group.harness, []).append(group)
    metrics: dict[str, float] = {}
    for name, mine in sorted(by_harness.items()):
        rollouts = [r for g in mine for r in g.rollouts]
        key = f"{PREFIX}{name}/"
        metrics[key + "groups"] = float(len(mine))
        metrics[key + "rollouts"] = float(len(rollouts))
        rewards = [r.reward for r in rollouts if r.scored and r.reward is not None]
        if rewards:
            metrics[key + "reward"] = statistics.fmean(rewards)
        metrics[key + "unscorable"] = float(sum(r.unscorable is not None for r in rollouts))
        metrics[key + "timed_out"] = float(sum(r.timed_out for r in rollouts))
        traces = [r.trace for r in rollouts if r.trace is not None]
        if traces:
            metrics[key + "num_turns"] = statistics.fmean(len(trace.turns) for trace in traces)
            metrics[key + "completion_tokens"] = statistics.fmean(
                sum(len(turn.completion_token_ids) for turn in trace.turns) for trace in traces
            )
        metrics |= agreement_metrics(rollouts, prefix=key + "agreement_")
    return metrics


def harness_names(metrics: dict[str, object]) -> list[str]:
    """The harnesses a metrics line has per-harness metrics of, sorted."""
    return sorted({key[len(PREFIX) :].rsplit("/", 1)[0] for key in metrics if key.startswith(PREFIX)})
