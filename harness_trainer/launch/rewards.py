"""The launcher's ``rollout_reward_fn``: the verifier's correctness, plus a small bonus for solving with
few tool calls. Pure (no I/O, no torch).

``reward = env_reward + TOOL_BONUS * max(0, 1 - tool_call_count / TOOL_CALL_BUDGET)`` when the task is
solved (``env_reward >= 1``), else ``env_reward`` unchanged; ``None`` (ungraded) stays ``None`` so the
rollout is left out of its group's baseline. The bonus only ever separates solved rollouts: an unsolved
rollout that happens to make no tool calls earns nothing for it, so the policy is never paid for giving
up early.
"""

from __future__ import annotations

from harness_trainer.trainer.step.outcome import HarnessRolloutOutcome

SOLVED = 1.0
"""A verifier reward at or above this means the task is solved (Harbor verifiers write 1 for a pass)."""
TOOL_BONUS = 0.1
"""The largest bonus, for a solve without tool calls; small next to the 1 a solve is worth."""
TOOL_CALL_BUDGET = 20
"""Tool calls at which the bonus reaches zero."""


def correctness_with_tool_efficiency(outcome: HarnessRolloutOutcome) -> float | None:
    """The verifier's reward, plus up to ``TOOL_BONUS`` for a solve with fewer than ``TOOL_CALL_BUDGET``
    tool calls; None when the verifier gave no reward."""
    if outcome.env_reward is None:
        return None
    reward = float(outcome.env_reward)
    if reward >= SOLVED:
        reward += TOOL_BONUS * max(0.0, 1.0 - outcome.tool_call_count / TOOL_CALL_BUDGET)
    return reward
