"""Where a rollout's wall time went: its model calls, its environment, and the rest. Pure, no torch.

:func:`time_split` splits the scheduler's wall time of one rollout (``Rollout.seconds``) three ways:

- ``llm_s``: the union of its model calls' ``[started_at, finished_at]`` (each trace turn's metadata, unix
  seconds stamped by the capture proxy), so calls in flight together count once. A turn missing either
  stamp, or ending before it starts, is left out. Only captured turns count: a call the engine failed, or
  that assembly discarded, is not a turn.
- ``env_s``: the environment's phases as the rollout server reports them (``phase_seconds``:
  :data:`ENV_PHASES`: sandbox start, agent install, test upload, verifier, cleanup, and a white-box
  episode's ``tools``: its tool calls, summed), plus the part of the black-box ``agent`` phase spent
  outside model calls (its tools and the harness in the sandbox). Without phases (a
  factory that reports none, a rollout that failed before any) it is 0: nothing says how much there was.
- ``other_s``: the rest of the wall time (the server's bookkeeping phases, queueing, transport, scoring),
  at least 0. The proxy's and the server's clocks are not the scheduler's, so the three parts add up to the
  wall time only approximately; ``other_s`` never goes negative to hide that.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ENV_PHASES = frozenset({"sandbox_start", "install", "upload", "verifier", "cleanup", "tools"})
"""Phases of the rollout server spent in the environment, not the model: a black-box rollout's
(``rollouts/server/run.py``) and a white-box environment's (``rollouts/server/environment.py``)."""
AGENT_PHASE = "agent"
"""The phase the agent runs in: its model calls and its tools."""


@dataclass(frozen=True)
class TimeSplit:
    llm_s: float
    env_s: float
    other_s: float


def time_split(
    turns_metadata: Iterable[Mapping[str, Any]], phase_seconds: Mapping[str, Any], wall_s: float
) -> TimeSplit:
    """The split of ``wall_s`` (rules in the module docstring); ``turns_metadata`` is each trace turn's
    ``metadata``, ``phase_seconds`` the rollout server's ``verify.metrics["phase_seconds"]`` (or empty)."""
    llm = union_seconds(_interval(meta) for meta in turns_metadata)
    phases = {str(name): float(value) for name, value in phase_seconds.items() if _is_number(value)}
    env = 0.0
    if phases:
        env = sum(seconds for name, seconds in phases.items() if name in ENV_PHASES)
        env += max(0.0, phases.get(AGENT_PHASE, 0.0) - llm)
    return TimeSplit(llm_s=llm, env_s=env, other_s=max(0.0, wall_s - llm - env))


def union_seconds(intervals: Iterable[tuple[float, float] | None]) -> float:
    """The length of the union of ``(start, end)`` intervals; None entries are skipped."""
    total, reach = 0.0, None
    for start, end in sorted(i for i in intervals if i is not None):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def _interval(metadata: Mapping[str, Any]) -> tuple[float, float] | None:
    start, end = metadata.get("started_at"), metadata.get("finished_at")
    if not (_is_number(start) and _is_number(end)) or end < start:
        return None
    return float(start), float(end)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
