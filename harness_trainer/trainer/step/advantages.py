"""Group-relative advantages (GRPO): one value per rollout, from the rewards of its group. Pure, no torch.

``advantage = (r - mean) / (std + eps)`` over the group's scored members (reward not None), with the sample
standard deviation (ddof=1, as TRL's ``torch.std``). An unscored member (unscorable rollout, or a reward
function that declined to score it) stays None: it is left out of the baseline, never counted as a zero.
A group with fewer than two scored members has no baseline; the caller checks :func:`scored` and drops it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def scored(rewards: Sequence[float | None]) -> int:
    """How many members of the group have a reward."""
    return sum(reward is not None for reward in rewards)


def group_advantages(rewards: Sequence[float | None], eps: float = 1e-4) -> list[float | None]:
    """Each member's advantage, None where its reward is None; all 0.0 when the scored rewards are equal.

    Raises:
        ValueError: fewer than two members are scored, a reward is NaN or infinite (named by its index),
            or ``eps`` is not a finite positive number.
    """
    if not (math.isfinite(eps) and eps > 0):  # eps is what keeps a near-zero std from dividing by zero
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    for index, reward in enumerate(rewards):
        if reward is not None and not math.isfinite(reward):
            raise ValueError(f"reward of group member {index} is {reward!r}: rewards must be finite")
    values = [reward for reward in rewards if reward is not None]
    if len(values) < 2:
        raise ValueError(
            f"{len(values)} of {len(rewards)} group members are scored: a baseline needs at least two"
        )
    # Equal rewards carry no signal; exact zeros here, rather than the mean's rounding error over eps.
    if all(value == values[0] for value in values):
        return [None if reward is None else 0.0 for reward in rewards]
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((value - mean) ** 2 for value in values) / (len(values) - 1))
    return [None if reward is None else (reward - mean) / (std + eps) for reward in rewards]
