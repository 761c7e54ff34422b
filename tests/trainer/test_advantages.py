"""Group advantages: (r - mean) / (sample std + eps) over the scored members; None is not in the baseline."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from harness_trainer.trainer.step.advantages import group_advantages, scored


def test_hand_computed_group() -> None:
    # mean 2, sample std sqrt(((1-2)^2 + 0 + (3-2)^2) / 2) = 1
    assert group_advantages([1.0, 2.0, 3.0]) == pytest.approx([-1 / 1.0001, 0.0, 1 / 1.0001])
    assert group_advantages([1.0, 2.0, 3.0], eps=0.5) == pytest.approx([-1 / 1.5, 0.0, 1 / 1.5])


def test_uses_the_sample_standard_deviation() -> None:
    # mean 0.5; sample std sqrt(4 * 0.25 / 3) = sqrt(1/3), not the population std 0.5
    advantages = group_advantages([1.0, 0.0, 0.0, 1.0])

    expected = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert advantages == pytest.approx([expected, -expected, -expected, expected])


def test_unscored_members_stay_none_and_out_of_the_baseline() -> None:
    # scored: 1 and 3 -> mean 2, sample std sqrt(2)
    advantages = group_advantages([1.0, None, 3.0, None])

    assert advantages[1] is None and advantages[3] is None
    assert advantages[0] == pytest.approx(-1 / (math.sqrt(2) + 1e-4))
    assert advantages[2] == pytest.approx(1 / (math.sqrt(2) + 1e-4))


@pytest.mark.parametrize("rewards", [[], [None, None], [None, 1.0], [0.5]])
def test_fewer_than_two_scored_members_raise(rewards: list[float | None]) -> None:
    with pytest.raises(ValueError, match="at least two"):
        group_advantages(rewards)


def test_equal_rewards_give_exact_zeros() -> None:
    # 0.1 * 3 / 3 is not 0.1 in floats: the rounding error over eps would otherwise leak through.
    assert group_advantages([0.1, 0.1, None, 0.1]) == [0.0, 0.0, None, 0.0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_rejected_by_index(bad: float) -> None:
    with pytest.raises(ValueError, match="member 2"):
        group_advantages([1.0, None, bad])


@pytest.mark.parametrize("eps", [0.0, -1e-4, math.nan, math.inf])
def test_bad_eps_is_rejected(eps: float) -> None:
    with pytest.raises(ValueError, match="eps"):
        group_advantages([0.0, 1.0], eps=eps)


def test_scored_counts_members_with_a_reward() -> None:
    assert scored([None, 0.0, 1.0, None]) == 2
    assert scored([]) == 0


@given(st.lists(st.one_of(st.none(), st.floats(-1e6, 1e6)), min_size=2, max_size=16))
def test_scored_advantages_are_centred_and_scaled(rewards: list[float | None]) -> None:
    values = [reward for reward in rewards if reward is not None]
    assume(len(values) >= 2)

    advantages = group_advantages(rewards)

    assert [a is None for a in advantages] == [r is None for r in rewards]
    kept = [a for a in advantages if a is not None]
    assert math.fsum(kept) == pytest.approx(0.0, abs=1e-6)
    std = statistics.stdev(values)
    assert statistics.stdev(kept) == pytest.approx(std / (std + 1e-4), rel=1e-6, abs=1e-9)
