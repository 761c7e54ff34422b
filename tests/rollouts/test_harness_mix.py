"""Several harnesses in one run (:mod:`harness_trainer.rollouts.harness_mix`): the three shapes of the
value, the per-group schedule (pure, so a resumed run continues it), and every refusal."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness_trainer.rollouts.harness_mix import harness_mix, parse_harness_text


def test_one_name_is_a_single_harness_for_every_group() -> None:
    mix = harness_mix("opencode")
    assert not mix.mixed and mix.value() == "opencode" and str(mix) == "opencode"
    assert {mix.for_group(g) for g in range(10)} == {"opencode"}


def test_a_list_deals_groups_round_robin_and_a_one_name_list_is_a_single_harness() -> None:
    mix = harness_mix(["opencode", "mini-swe-agent", "codex"])
    assert mix.mixed and mix.value() == ["opencode", "mini-swe-agent", "codex"]
    assert [mix.for_group(g) for g in range(7)] == [
        "opencode", "mini-swe-agent", "codex", "opencode", "mini-swe-agent", "codex", "opencode",
    ]  # fmt: skip
    assert mix.for_group(None) == "opencode"  # an episode of no group: the first
    assert not harness_mix(["toy"]).mixed and harness_mix(["toy"]).value() == "toy"


def test_weights_interleave_groups_in_proportion() -> None:
    mix = harness_mix({"a": 2, "b": 1})
    assert "".join(mix.for_group(g) for g in range(9)) == "abaabaaba"
    assert mix.value() == {"a": 2.0, "b": 1.0} and "weighted" in str(mix)
    assert harness_mix({"a": 0.5, "b": 0.5}).for_group(3) == harness_mix(["a", "b"]).for_group(3)


@given(
    st.lists(st.integers(1, 9), min_size=2, max_size=4),
    st.integers(0, 300),
)
def test_every_prefix_of_a_weighted_schedule_is_within_one_group_of_each_share(weights, length) -> None:
    names = [f"h{i}" for i in range(len(weights))]
    mix = harness_mix(dict(zip(names, weights, strict=True)))
    dealt = [mix.for_group(g) for g in range(length)]
    total = sum(weights)
    for name, weight in zip(names, weights, strict=True):
        assert abs(dealt.count(name) - weight * length / total) < len(weights)
    # Asked out of order (a resumed run starts mid-way), each group gets the same harness.
    assert [mix.for_group(g) for g in reversed(range(length))] == dealt[::-1]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "an empty list names no harness"),
        (["a", "b", "a"], "a listed more than once"),
        (["a", ""], "a non-empty string"),
        (["a", 3], "a non-empty string"),
        ({"a": 1, "b": 0}, "the weight of 'b' must be positive"),
        ({"a": 1, "b": -2}, "the weight of 'b' must be positive"),
        ({"a": 1, "b": math.nan}, "the weight of 'b' must be a positive number"),
        ({"a": True, "b": 1}, "the weight of 'a' must be a positive number"),
        ({"a": "2", "b": 1}, "the weight of 'a' must be a positive number"),
        (7, "give a name, a list of names or a mapping of weights"),
    ],
)
def test_a_bad_value_is_refused_naming_what_is_wrong(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        harness_mix(value)


def test_the_flag_text_reads_as_the_three_shapes() -> None:
    assert parse_harness_text("opencode") == "opencode"
    assert parse_harness_text("opencode, mini-swe-agent") == ["opencode", "mini-swe-agent"]
    assert parse_harness_text("opencode=2,codex=0.5") == {"opencode": 2.0, "codex": 0.5}
    with pytest.raises(ValueError, match="every harness a weight"):
        parse_harness_text("opencode=2,codex")
    with pytest.raises(ValueError, match="the weight of 'codex' is not a number"):
        parse_harness_text("opencode=2,codex=lots")


def test_options_are_keyed_by_harness_in_a_mix_and_whole_for_one() -> None:
    single = harness_mix("mini-swe-agent")
    assert single.options_for({"agent_config": {"x": 1}}, "mini-swe-agent") == {"agent_config": {"x": 1}}
    assert single.options_problems({"agent_config": {}}) == []
    mix = harness_mix(["toy", "mini-swe-agent"])
    options = {"mini-swe-agent": {"agent_config": {"x": 1}}}
    assert mix.options_for(options, "mini-swe-agent") == {"agent_config": {"x": 1}}
    assert mix.options_for(options, "toy") == {}
    assert mix.options_problems(options) == []
    [problem] = mix.options_problems({"agent_config": {}})
    assert "give each its options under its name (toy, mini-swe-agent)" in problem
    [problem] = mix.options_problems({"toy": "fast"})
    assert problem.startswith("harness_options.toy: expected a mapping")


def test_a_harness_asked_for_by_name_runs_instead_of_the_groups_and_must_be_in_the_mix() -> None:
    mix = harness_mix({"opencode": 2, "mini-swe-agent": 1})
    assert [mix.chosen(None, g) for g in range(3)] == [mix.for_group(g) for g in range(3)]
    assert [mix.chosen("mini-swe-agent", g) for g in range(3)] == ["mini-swe-agent"] * 3
    assert mix.chosen(None, None) == "opencode"
    with pytest.raises(ValueError, match="'codex' is not one of this run's: opencode, mini-swe-agent"):
        mix.chosen("codex", 0)
    with pytest.raises(ValueError, match="not one of this run's: toy"):
        harness_mix("toy").chosen("opencode", 0)
