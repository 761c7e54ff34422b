"""The records of ``rollouts.jsonl`` and their building: :class:`RolloutRecord` (a rollout),
:class:`RolloutOutcome` (what a step did with it), :class:`RunStart` (a run opened the log), and why a
rollout did not train (:data:`NOT_TRAINED_REASONS`).

:func:`rollout_record` and :func:`member_record` make a finished rollout's record, :func:`step_outcomes`
the outcomes of a step's groups; :class:`.rollout_log.RolloutLog` writes them and
:func:`.rollout_log.read_rollout_log` reads them back (the file's format is in its docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from harness_trainer.trace import TrainingTrace
from harness_trainer.trainer.step.groups import Group, Rollout
from harness_trainer.trainer.step.timesplit import time_split

# Why a rollout did not train (``not_trained``).
UNSCORABLE = "unscorable"
"""The rollout failed (its ``unscorable`` says how)."""
UNGRADED = "ungraded: no reward"
FEW_SCORED = "group dropped: fewer than two scored rollouts"
ZERO_VARIANCE = "group dropped: every scored rollout had the same reward"
DROPPED = "group dropped"
ZERO_ADVANTAGE = "zero advantage"
NO_TOKENS = "no trainable tokens"
NOT_TAKEN = "not taken by a step: the run ended first, or it still waits for one"
NOT_TRAINED = "not trained"
"""An old-format record without an advantage whose reason was not written."""
NOT_TRAINED_REASONS = (
    UNSCORABLE, UNGRADED, FEW_SCORED, ZERO_VARIANCE, DROPPED, ZERO_ADVANTAGE, NO_TOKENS, NOT_TAKEN,
    NOT_TRAINED,
)  # fmt: skip


class RolloutRecord(BaseModel):
    """One rollout, as written when it completes and as read back merged with its outcome (fields in
    :mod:`.rollout_log`'s docstring)."""

    step: int | None = None
    group: int
    member: int
    rollout_id: str | None = None
    capture_session_id: str | None = None
    task_name: str | None = None
    task_index: int | None = None
    harness: str | None = None
    reward: float | None = None
    env_reward: float | None = None
    advantage: float | None = None
    not_trained: str | None = None
    unscorable: str | None = None
    timed_out: bool = False
    seconds: float = 0.0
    llm_s: float = 0.0
    env_s: float = 0.0
    other_s: float = 0.0
    policy_version: int = 0
    dispatch_version_min: int | None = None
    dispatch_version_max: int | None = None
    return_version_min: int | None = None
    return_version_max: int | None = None
    tool_call_count: int = 0
    tool_failure_count: int = 0
    tool_calls_by_name: dict[str, int] = Field(default_factory=dict)
    phase_seconds: dict[str, float] = Field(default_factory=dict)
    """Where the rollout's time went, by phase (``verify.metrics["phase_seconds"]``), when reported."""
    sandbox_seconds: float | None = None
    """What its sandboxes ran for (``verify.metrics["sandbox_seconds"]``: what a remote backend bills), when
    reported."""
    snapshot: str | None = None
    """The snapshot its sandbox started from when its group was set up once (``verify.metrics["snapshot"]``),
    else null (a cold start)."""
    findings: list[dict[str, Any] | str] = Field(default_factory=list)
    agreement: str | None = None
    """The agent's own record against the capture: match, mismatch or not_available; None: not checked."""
    agreement_detail: str | None = None
    """A mismatch's first difference."""
    trace_logged: bool = True
    trace: TrainingTrace | None = None


class RolloutOutcome(BaseModel):
    """What a step did with one rollout: trained it with ``advantage``, or not, for ``not_trained``."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["outcome"] = "outcome"
    step: int
    group: int
    member: int
    advantage: float | None = None
    not_trained: str | None = None


class RunStart(BaseModel):
    """A run (fresh or resumed) opened the log: it trains from ``step + 1`` and rolls out from group
    ``start_group``."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["start"] = "start"
    step: int
    start_group: int


def rollout_record(
    rollout: Rollout,
    *,
    task_name: str | None,
    task_index: int | None,
    verify_metrics: dict[str, Any] | None,
    findings: list[Any] | None,
    harness: str | None = None,
    step: int | None = None,
    advantage: float | None = None,
    with_trace: bool = True,
) -> RolloutRecord:
    """The record of ``rollout`` (``step`` and ``advantage`` null: a completion line). Cheap: the trace is
    referenced, not copied or re-validated; it is serialised when the record is written, unless
    ``with_trace`` is false.

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
    phases = {str(k): float(v) for k, v in (metrics.get("phase_seconds") or {}).items()}
    metadata = [turn.metadata for turn in rollout.trace.turns] if rollout.trace is not None else []
    split = time_split(metadata, phases, rollout.seconds)
    dispatched = _versions(metadata, "dispatch_version")
    returned = _versions(metadata, "weight_version")
    return RolloutRecord(
        step=step,
        group=rollout.group,
        member=rollout.member,
        rollout_id=rollout.rollout_id,
        capture_session_id=rollout.capture_session_id,
        task_name=None if task_name is None else str(task_name),
        task_index=task_index,
        harness=harness,
        reward=rollout.reward,
        env_reward=outcome.env_reward if outcome is not None else None,
        advantage=advantage,
        unscorable=rollout.unscorable,
        timed_out=rollout.timed_out,
        seconds=rollout.seconds,
        llm_s=split.llm_s,
        env_s=split.env_s,
        other_s=split.other_s,
        policy_version=rollout.policy_version,
        dispatch_version_min=min(dispatched, default=None),
        dispatch_version_max=max(dispatched, default=None),
        return_version_min=min(returned, default=None),
        return_version_max=max(returned, default=None),
        tool_call_count=sum(calls_by_name.values()),
        tool_failure_count=failures,
        tool_calls_by_name=calls_by_name,
        phase_seconds=phases,
        sandbox_seconds=_number(metrics.get("sandbox_seconds")),
        snapshot=snapshot if isinstance(snapshot := metrics.get("snapshot"), str) else None,
        findings=[item if isinstance(item, dict | str) else str(item) for item in findings or []],
        agreement=verdict.get("status") if isinstance(verdict := metrics.get("agreement"), dict) else None,
        agreement_detail=verdict.get("first_difference") if isinstance(verdict, dict) else None,
        trace_logged=with_trace,
        trace=rollout.trace if with_trace else None,
    )


def member_record(
    group: Group, rollout: Rollout, *, step: int | None = None, with_trace: bool = True
) -> RolloutRecord:
    """:func:`rollout_record` of a member of ``group``: its task from the group's row, its verifier's
    metrics and findings from the rollout (what training's ``rollouts.jsonl`` and evaluation's samples
    record alike)."""
    return rollout_record(
        rollout, task_name=group.row.get("task_name"), task_index=group.row.get("task_index"),
        verify_metrics=rollout.verify_metrics, findings=rollout.findings, harness=group.harness, step=step,
        with_trace=with_trace,
    )  # fmt: skip


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _versions(metadata: Sequence[dict[str, Any]], key: str) -> list[int]:
    return [v for meta in metadata if isinstance(v := meta.get(key), int) and not isinstance(v, bool)]


def step_outcomes(
    step: int, dropped: Sequence[Group], taken: Sequence[Group], trained: dict[tuple[int, int], float]
) -> list[RolloutOutcome]:
    """What step ``step`` did with each rollout of the groups it took: ``dropped`` (left out whole) and
    ``taken`` (assembled), ``trained`` the advantage of each trained ``(group, member)``. Pure."""
    outcomes = []
    for group in dropped:
        scored_rewards = {r.reward for r in group.scored}
        reason = (
            FEW_SCORED if len(group.scored) < 2 else ZERO_VARIANCE if len(scored_rewards) == 1 else DROPPED
        )
        for rollout in group.rollouts:
            why = own_reason(rollout) or reason
            outcomes.append(
                RolloutOutcome(step=step, group=group.index, member=rollout.member, not_trained=why)
            )
    for group in taken:
        for rollout in group.rollouts:
            advantage = trained.get((group.index, rollout.member))
            why = None
            if advantage is None:
                has_tokens = any(row.n_targets for row in rollout.rows)
                why = own_reason(rollout) or (ZERO_ADVANTAGE if has_tokens else NO_TOKENS)
            outcomes.append(
                RolloutOutcome(
                    step=step, group=group.index, member=rollout.member, advantage=advantage, not_trained=why
                )
            )
    return outcomes


def own_reason(rollout: Rollout | RolloutRecord) -> str | None:
    """Why the rollout could not train whatever its group did (:data:`UNSCORABLE`: it failed;
    :data:`UNGRADED`: it has no reward), or None."""
    if rollout.unscorable is not None:
        return UNSCORABLE
    return UNGRADED if rollout.reward is None else None
