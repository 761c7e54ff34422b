"""One step's training data from finished groups: advantages, rows, per-rollout weights, and the metrics.

Pure functions (no torch). A group with fewer than two scored members gives no signal and is dropped;
each scored rollout gets one advantage, broadcast to all its rows; rollouts whose advantage is exactly 0
carry no policy gradient and are left out when nothing else (a KL term) needs their tokens. Each kept
rollout weighs ``1 / (N_r · R)`` per trained token (``N_r`` its trained tokens, ``R`` the kept rollouts),
or, with ``normalization="step"``, ``1 / (max N_r · R)``; either way a rollout that split into many rows
counts once, and micro-batch losses simply add up.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from harness_trainer.rollouts.agreement import MATCH, MISMATCH, NOT_AVAILABLE
from harness_trainer.trainer.step.advantages import group_advantages, scored
from harness_trainer.trainer.step.groups import Group, Rollout
from harness_trainer.trainer.step.rows import Row
from harness_trainer.trainer.step.timesplit import TimeSplit, time_split


@dataclass
class StepBatch:
    """What one optimizer step trains on."""

    rows: list[Row] = field(default_factory=list)
    advantages: dict[int, float] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    rollouts: list[Rollout] = field(default_factory=list)
    dropped_groups: int = 0

    @property
    def trained_tokens(self) -> int:
        return sum(row.n_targets for row in self.rows)


def assemble(
    groups: Sequence[Group],
    *,
    advantage_epsilon: float,
    keep_zero_advantage: bool,
    normalization: str = "rollout",
) -> StepBatch:
    """Score the groups and lay their rollouts out as rows with advantages and weights.

    ``normalization="rollout"``: each rollout's tokens weigh ``1 / (N_r · R)`` (its token mean; every
    rollout counts the same). ``"step"``: every token weighs ``1 / (max_r N_r · R)`` (Dr. GRPO's constant
    denominator), so a long failed rollout is pushed down per token as hard as a short success is pushed
    up; a rollout split into many rows still counts once.
    """
    batch = StepBatch()
    kept: list[tuple[Rollout, float]] = []
    for group in groups:
        rewards = [r.reward if r.scored else None for r in group.rollouts]
        if scored(rewards) < 2:
            batch.dropped_groups += 1
            continue
        for rollout, advantage in zip(
            group.rollouts, group_advantages(rewards, advantage_epsilon), strict=True
        ):
            if advantage is None or not rollout.rows:
                continue
            if advantage == 0.0 and not keep_zero_advantage:
                continue
            kept.append((rollout, advantage))
    trained = [(rollout, advantage, sum(r.n_targets for r in rollout.rows)) for rollout, advantage in kept]
    trained = [item for item in trained if item[2] > 0]
    longest = max((n for _, _, n in trained), default=1)
    for index, (rollout, advantage, n_targets) in enumerate(trained):
        batch.rollouts.append(rollout)
        batch.advantages[index] = advantage
        denominator = n_targets if normalization == "rollout" else longest
        batch.weights[index] = 1.0 / (denominator * len(trained))
        batch.rows.extend(replace(row, rollout=index) for row in rollout.rows)
    return batch


AGREEMENT_STATUSES = (MATCH, MISMATCH, NOT_AVAILABLE)


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def rollout_metrics(
    groups: Sequence[Group], *, policy_version: int, reward_name: str | None
) -> dict[str, float]:
    """TRL-named metrics of the step's groups (``reward``, ``reward_std``, ``tools/…``, ``completions/…``)
    plus this trainer's own (``rollout/…``, ``rows/…``, ``staleness/…`` counted from each scored rollout's
    :func:`behaviour_version`, ``perf/<phase>_s``, ``whitebox/…`` in white-box runs, and
    ``perf/rollout_llm_s`` / ``_env_s`` / ``_other_s``: the mean :func:`rollout_time_split` over the step's
    rollouts, and ``sandbox/seconds_per_rollout``: :func:`sandbox_metrics`)."""
    rollouts = [r for g in groups for r in g.rollouts]
    scored_rollouts = [r for r in rollouts if r.scored]
    rewards = [r.reward for r in scored_rollouts if r.reward is not None]
    staleness = [policy_version - behaviour_version(r) for r in scored_rollouts]
    group_stds = []
    for group in groups:
        values = [r.reward for r in group.scored if r.reward is not None]
        if len(values) >= 2:
            group_stds.append(statistics.stdev(values))
    with_outcome = [r for r in rollouts if r.outcome is not None]
    calls = sum(r.outcome.tool_call_count for r in with_outcome if r.outcome)
    failures = sum(r.outcome.tool_failure_count for r in with_outcome if r.outcome)
    lengths = [
        sum(len(turn.completion_token_ids) for turn in r.trace.turns) for r in rollouts if r.trace is not None
    ]
    with_rows = [r for r in rollouts if r.rows]
    env_rewards = [
        r.outcome.env_reward for r in with_outcome if r.outcome and r.outcome.env_reward is not None
    ]
    metrics = {
        "reward": _mean(rewards),
        "reward_std": _mean(group_stds),
        "frac_reward_zero_std": _mean([float(s == 0.0) for s in group_stds]),
        "rewards/env_reward": _mean(env_rewards),
        "tools/call_frequency": calls / len(with_outcome) if with_outcome else 0.0,
        "tools/failure_frequency": failures / calls if calls else 0.0,
        "completions/mean_length": _mean(lengths),
        "completions/max_length": float(max(lengths, default=0)),
        "completions/min_length": float(min(lengths, default=0)),
        "num_turns": _mean([len(r.trace.turns) for r in rollouts if r.trace is not None]),
        "rollout/count": float(len(rollouts)),
        "rollout/unscorable": float(sum(r.unscorable is not None for r in rollouts)),
        "rollout/ungraded": float(sum(r.unscorable is None and r.reward is None for r in rollouts)),
        "rollout/timed_out_frac": _mean([float(r.timed_out) for r in rollouts]),
        "rollout/seconds_mean": _mean([r.seconds for r in rollouts]),
        "rows/per_rollout": _mean([len(r.rows) for r in with_rows]),
        "rows/fork_frac": _mean([float(len(r.rows) > 1) for r in with_rows]),
        "staleness/mean": _mean(staleness),
        "staleness/max": float(max(staleness, default=0)),
        "staleness/tokens_median": token_staleness_median(scored_rollouts, policy_version),
    }
    metrics |= phase_metrics(rollouts)
    metrics |= sandbox_metrics(rollouts)
    metrics |= whitebox_metrics(rollouts)
    metrics |= agreement_metrics(rollouts)
    if rollouts:
        splits = [rollout_time_split(r) for r in rollouts]
        metrics["perf/rollout_llm_s"] = _mean([s.llm_s for s in splits])
        metrics["perf/rollout_env_s"] = _mean([s.env_s for s in splits])
        metrics["perf/rollout_other_s"] = _mean([s.other_s for s in splits])
    if reward_name:
        metrics[f"rewards/{reward_name}"] = _mean(rewards)
    return metrics


def behaviour_version(rollout: Rollout) -> int:
    """The policy version a rollout's training data was sampled from, as staleness counts it: the earliest
    dispatch version (the capture proxy's ``dispatch_version``) of its supervised turns, else the version
    current when the rollout started (a proxy that was never told the versions, an older trace)."""
    turns = rollout.trace.turns if rollout.trace is not None else []
    dispatched = [
        version
        for turn in turns
        if any(turn.loss_mask[len(turn.prompt_token_ids) :])
        and isinstance(version := turn.metadata.get("dispatch_version"), int)
        and not isinstance(version, bool)
    ]
    return min(dispatched, default=rollout.policy_version)


def token_staleness_median(rollouts: Sequence[Rollout], policy_version: int) -> float:
    """The median staleness of the rollouts' sampled (supervised) tokens: ``policy_version`` less the
    version each turn was dispatched under (``dispatch_version``, else the rollout's start version), each
    turn weighing its supervised tokens; 0 when there are none. A rollout that spans a weight push has
    turns of two versions, and each counts as its own."""
    counts: dict[int, int] = {}
    for rollout in rollouts:
        for turn in rollout.trace.turns if rollout.trace is not None else []:
            sampled = sum(turn.loss_mask[len(turn.prompt_token_ids) :])
            version = turn.metadata.get("dispatch_version")
            if not isinstance(version, int) or isinstance(version, bool):
                version = rollout.policy_version
            if sampled:
                counts[policy_version - version] = counts.get(policy_version - version, 0) + sampled
    total = sum(counts.values())
    if not total:
        return 0.0
    ordered = sorted(counts.items())
    below, lower = 0, None
    for staleness, count in ordered:  # the weighted median: the mean of the two middle tokens' values
        if lower is None and below + count > (total - 1) // 2:
            lower = staleness
        if below + count > total // 2:
            return (lower + staleness) / 2 if lower is not None else float(staleness)
        below += count
    return float(ordered[-1][0])


def rollout_time_split(rollout: Rollout) -> TimeSplit:
    """The rollout's wall time as model calls, environment and the rest (:mod:`.timesplit`)."""
    turns = rollout.trace.turns if rollout.trace is not None else []
    phases = rollout.verify_metrics.get("phase_seconds") or {}
    return time_split((turn.metadata for turn in turns), phases, rollout.seconds)


def whitebox_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """``whitebox/<counter>``: the mean of each white-box episode counter (turns, roots, retemplated turns,
    parse errors, …: :mod:`harness_trainer.whitebox.episode`) over the rollouts whose verify metrics report
    it; none in black-box runs."""
    values: dict[str, list[float]] = {}
    for rollout in rollouts:
        for name, value in rollout.verify_metrics.items():
            if (
                str(name).startswith("whitebox/")
                and isinstance(value, int | float)
                and not isinstance(value, bool)
            ):
                values.setdefault(str(name), []).append(float(value))
    return {name: _mean(found) for name, found in sorted(values.items())}


def agreement_metrics(rollouts: Sequence[Rollout], prefix: str = "agreement/") -> dict[str, float]:
    """How many rollouts' agents kept a record of their model calls that ``match`` the capture, did not
    (``mismatch``), or kept none (``not_available``): :mod:`harness_trainer.rollouts.agreement`. Nothing
    when no rollout was checked (a factory that does not report it)."""
    verdicts = [v.get("status") for r in rollouts if isinstance(v := r.verify_metrics.get("agreement"), dict)]
    if not verdicts:
        return {}
    return {f"{prefix}{status}": float(verdicts.count(status)) for status in AGREEMENT_STATUSES}


def phase_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """``perf/<phase>_s``: the mean seconds of each phase (``sandbox_start``, ``install``, ``agent``,
    ``upload``, ``verifier``…) over the rollouts that report it (``verify.metrics["phase_seconds"]``);
    none when no rollout reports phases (an engine-side factory)."""
    seconds: dict[str, list[float]] = {}
    for rollout in rollouts:
        for phase, value in (rollout.verify_metrics.get("phase_seconds") or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                seconds.setdefault(str(phase), []).append(float(value))
    return {f"perf/{phase}_s": _mean(values) for phase, values in sorted(seconds.items())}


def sandbox_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """``sandbox/seconds_per_rollout``: the mean sandbox-seconds (``verify.metrics["sandbox_seconds"]``:
    each of a rollout's sandboxes from start to close, summed, as
    :mod:`harness_trainer.rollouts.server.sandbox_meter` counts them) over the rollouts that report it, a
    rollout whose sandbox never started counting 0: what the step's rollouts cost a backend that bills
    sandbox time. None when no rollout reports it (an engine-side factory)."""
    seconds = [
        float(value)
        for rollout in rollouts
        if isinstance(value := rollout.verify_metrics.get("sandbox_seconds"), int | float)
        and not isinstance(value, bool)
    ]
    return {"sandbox/seconds_per_rollout": _mean(seconds)} if seconds else {}
