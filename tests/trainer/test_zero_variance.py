"""Groups whose rollouts all got one reward: dropped before the step, the step refilled, counted, bounded."""

from __future__ import annotations

import logging

import pytest

from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.trainer.feed.evaluation import read_eval
from harness_trainer.trainer.feed.rollout_log import read_rollout_log
from harness_trainer.trainer.step_groups import NoLearningSignal
from tests.trainer.handmade import HandmadeFactory
from tests.trainer.test_evaluation import split_builder
from tests.trainer.test_trainer import builder, config, metrics_lines


def solved_0_never_2(task: int, member: int) -> float:
    """Task 0: every member passes; task 2: none does; task 1: half of them."""
    return {0: 1.0, 2: 0.0}.get(task, float(member % 2))


def test_groups_with_equal_rewards_are_dropped_and_the_step_takes_the_next_groups(tmp_path, tiny_model_dir):
    factory = HandmadeFactory(reward=solved_0_never_2)
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), config(tmp_path, max_steps=2))
    trainer.train()
    # Rows cycle 0, 1, 2, 0, 1: step 1 drops group 0 (task 0), step 2 drops groups 2 and 3 (tasks 2, 0).
    assert trainer.trained_groups == [1, 4]
    lines = metrics_lines(tmp_path / "out")
    assert [line["rollout/zero_variance_dropped"] for line in lines] == [1, 2]
    assert [line["rollout/zero_variance_dropped_total"] for line in lines] == [1, 3]
    assert [line["rollout/dropped_groups_total"] for line in lines] == [0, 0]
    assert all(line["staleness/max"] <= 1 for line in lines)  # refills stay within max_staleness
    # The reward metrics cover the dropped groups too: step 1 saw four 1.0s and 0, 1, 0, 1.
    assert lines[0]["reward"] == pytest.approx(6 / 8)
    assert [line["frac_reward_zero_std"] for line in lines] == pytest.approx([1 / 2, 2 / 3])
    # Groups admitted past the last step finished too: in the record, taken by no step.
    records = [r for r in read_rollout_log(tmp_path / "out") if r.step is not None]
    assert [(r.step, r.group) for r in records] == [(1, 0)] * 4 + [(1, 1)] * 4 + [(2, 2)] * 4 + [
        (2, 3)
    ] * 4 + [(2, 4)] * 4
    dropped = [r for r in records if r.group in (0, 2, 3)]
    assert all(r.advantage is None and r.unscorable is None and r.reward is not None for r in dropped)
    assert {r.not_trained for r in dropped} == {"group dropped: every scored rollout had the same reward"}
    assert {r.reward for r in dropped if r.group == 0} == {1.0} and {
        r.reward for r in dropped if r.group == 2
    } == {0.0}
    assert all(r.advantage is not None for r in records if r.group in (1, 4))


def test_with_dropping_off_equal_reward_groups_are_trained_as_before(tmp_path, tiny_model_dir):
    factory = HandmadeFactory(reward=solved_0_never_2)
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(factory), config(tmp_path, max_steps=2, drop_zero_variance_groups=False)
    )
    trainer.train()
    assert trainer.trained_groups == [0, 1]
    lines = metrics_lines(tmp_path / "out")
    assert [line["rollout/zero_variance_dropped"] for line in lines] == [0, 0]
    assert lines[0]["frac_reward_zero_std"] == 1.0


def test_a_run_where_every_task_is_always_solved_ends_as_done_naming_why(tmp_path, tiny_model_dir, caplog):
    factory = HandmadeFactory(reward=lambda task, member: 1.0)
    settings = config(tmp_path, max_steps=2, max_zero_variance_groups_in_a_row=5)
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), settings)
    with caplog.at_level(logging.WARNING):
        output = trainer.train()
    assert trainer.stop_reason == "solved" and not trainer.stop_requested
    assert output.global_step == 0 and trainer.state.step == 0 and trainer.trained_groups == []
    assert "stopping at step 0 of 2: the training set is solved (5 groups in a row" in caplog.text
    assert "rewards [1.0]" in caplog.text
    assert not factory.live and factory.closed == len(factory.created) and factory.factory_closed


def test_a_run_where_no_task_is_ever_solved_stops_with_no_learning_signal(tmp_path, tiny_model_dir):
    factory = HandmadeFactory(reward=lambda task, member: 0.0)
    settings = config(tmp_path, max_steps=2, max_zero_variance_groups_in_a_row=5)
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), settings)
    with pytest.raises(
        NoLearningSignal, match=r"5 groups in a row .* same reward \(rewards seen: \[0\.0\]\)"
    ):
        trainer.train()
    assert trainer.stop_reason is None and trainer.state.step == 0 and trainer.trained_groups == []
    assert not factory.live and factory.closed == len(factory.created) and factory.factory_closed


def test_a_streak_with_a_failing_task_is_no_learning_signal_even_if_most_passed(tmp_path, tiny_model_dir):
    factory = HandmadeFactory(num_tasks=5, reward=lambda task, member: float(task != 3))
    settings = config(tmp_path, max_steps=2, max_zero_variance_groups_in_a_row=5)
    with pytest.raises(NoLearningSignal, match=r"rewards seen: \[0\.0, 1\.0\]"):
        HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), settings).train()


def test_a_run_solved_after_a_step_is_evaluated_at_its_last_step_and_checkpointed(tmp_path, tiny_model_dir):
    # Task 0's group varies and trains step 1; tasks 1-9 pass on every member.
    train = HandmadeFactory(num_tasks=10, reward=lambda task, member: float(task != 0 or member % 2))
    held_out = HandmadeFactory(num_tasks=1, reward=lambda task, member: 1.0)
    settings = config(
        tmp_path, max_steps=6, max_zero_variance_groups_in_a_row=5, eval_steps=4, eval_on_start=True,
        eval_split="test", eval_num_generations=1,
    )  # fmt: skip
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), split_builder(train, held_out, []), settings)
    trainer.train()
    assert trainer.stop_reason == "solved" and trainer.state.step == 1 and trainer.trained_groups == [0]
    assert [e["step"] for e in read_eval(tmp_path / "out")] == [0, 1]
    lines = {line["step"]: line for line in metrics_lines(tmp_path / "out")}
    assert lines[1]["eval/pass@1"] == 1.0 and lines[1]["eval/policy_version"] == 1
    assert (tmp_path / "out" / "checkpoint-1").is_dir()
    assert not train.live and train.closed == len(train.created) and held_out.factory_closed


def test_the_running_total_survives_a_resume(tmp_path, tiny_model_dir):
    first = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(HandmadeFactory(reward=solved_0_never_2)), config(tmp_path, max_steps=1)
    )
    first.train()
    resumed = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir),
        builder(HandmadeFactory(reward=solved_0_never_2)),
        config(tmp_path, max_steps=2, resume_from_checkpoint="latest"),
    )
    resumed.train()
    assert first.trained_groups + resumed.trained_groups == [1, 4]
    assert [line["rollout/zero_variance_dropped_total"] for line in metrics_lines(tmp_path / "out")] == [1, 3]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_zero_variance_groups_in_a_row": 0}, "max_zero_variance_groups_in_a_row must be at least 1"),
    ],
)
def test_a_bad_zero_variance_setting_is_refused(overrides, message) -> None:
    from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
    from harness_trainer.trainer.config.problems import ConfigProblems

    with pytest.raises(ConfigProblems, match=message):
        AsyncGRPOConfig(**overrides)
