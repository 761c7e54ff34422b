"""The pass-rate curriculum, pure: weights from pass rates, seeded draws, lagged choices, its saved state."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

import pytest

from harness_trainer.trainer.feed.curriculum import (
    CurriculumExhausted,
    CurriculumStateError,
    GroupResult,
    PassRateCurriculum,
    PassRateRule,
    TaskRecord,
    draw,
    fold,
    task_status,
    weights,
)
from harness_trainer.trainer.step.groups import Group, Rollout

Rewards = Callable[[int, int], list[float | None]]
"""(row, group index) -> the group's member rewards (None: unscorable)."""


def group(index: int, rewards: list[float | None]) -> Group:
    members = []
    for m, reward in enumerate(rewards):
        rollout = Rollout(index, m, reward=reward)
        rollout.unscorable = None if reward is not None else "sandbox"
        members.append(rollout)
    return Group(index, {}, index, members)


def drive(curriculum: PassRateCurriculum, rewards: Rewards, *, start: int, stop: int) -> list[int]:
    """Admit and take groups ``start``..``stop - 1`` as the scheduler would (at most ``lag`` in the system,
    each chosen at admission); the rows chosen, by group."""
    chosen: dict[int, int] = {}
    admitted = start
    for taken in range(start, stop):
        while admitted - taken < curriculum.lag and admitted < stop:
            chosen[admitted] = curriculum.choose(admitted)
            admitted += 1
        curriculum.taken(group(taken, rewards(chosen[taken], taken)))
    return [chosen[i] for i in range(start, stop)]


def by_task(solved: set[int], never: set[int]) -> Rewards:
    def rewards(row: int, index: int) -> list[float | None]:
        if row in solved:
            return [1.0] * 4
        if row in never:
            return [0.0] * 4
        return [0.0, 1.0, 0.0, 1.0]

    return rewards


RULE = PassRateRule(window=2, pass_reward=1.0, retire_threshold=1.0, retired_weight=0.0, unsolved_weight=0.25)


def test_a_task_is_retired_after_window_solved_groups_and_given_a_lower_weight_when_never_solved() -> None:
    tasks: dict[int, TaskRecord] = {}
    tasks = fold(tasks, GroupResult(row=0, passes=4, scored=4), RULE.window)
    tasks = fold(tasks, GroupResult(row=2, passes=0, scored=4), RULE.window)
    assert weights(tasks, 3, RULE) == [1.0, 1.0, 1.0]  # one group each: not yet judged
    tasks = fold(tasks, GroupResult(row=0, passes=4, scored=4), RULE.window)
    tasks = fold(tasks, GroupResult(row=2, passes=0, scored=4), RULE.window)
    tasks = fold(tasks, GroupResult(row=1, passes=2, scored=4), RULE.window)
    assert weights(tasks, 3, RULE) == [0.0, 1.0, 0.25]
    # A failure in its window brings a retired task back; one pass anywhere ends "never solved".
    tasks = fold(tasks, GroupResult(row=0, passes=3, scored=4), RULE.window)
    tasks = fold(tasks, GroupResult(row=2, passes=1, scored=4), RULE.window)
    assert weights(tasks, 3, RULE) == [1.0, 1.0, 1.0]


def test_a_pass_is_a_reward_at_or_above_pass_reward_and_unscored_members_do_not_count() -> None:
    tasks = fold({}, GroupResult(row=0, passes=0, scored=0), RULE.window)
    assert tasks == {}
    curriculum = PassRateCurriculum(1, RULE, seed=0, lag=1)
    curriculum.choose(0)
    curriculum.taken(group(0, [1.0, 0.5, None, 1.0]))
    assert curriculum.state_dict(1)["tail"] == [] and curriculum.state_dict(1)["tasks"] == {
        "0": {"recent": [[2, 3]], "groups": 1, "passes": 2}
    }


def test_sampling_shifts_away_from_solved_tasks_and_partly_away_from_never_solved_ones() -> None:
    before = Counter(draw([1.0, 1.0, 1.0], seed=5, index=i) for i in range(3000))
    assert all(900 < before[row] < 1100 for row in range(3))
    curriculum = PassRateCurriculum(3, RULE, seed=5, lag=1)
    rows = drive(curriculum, by_task(solved={0}, never={2}), start=0, stop=400)
    late = Counter(rows[100:])
    assert late[0] == 0
    assert late[2] > 0 and late[1] > 2.5 * late[2]
    summary = curriculum.summary()
    assert summary["curriculum/retired_tasks"] == 1 and summary["curriculum/unsolved_tasks"] == 1


def test_a_draw_depends_only_on_the_seed_the_group_index_and_the_weights() -> None:
    assert [draw([1, 2, 3], 7, i) for i in range(50)] == [draw([1, 2, 3], 7, i) for i in range(50)]
    assert [draw([1, 2, 3], 7, i) for i in range(50)] != [draw([1, 2, 3], 8, i) for i in range(50)]
    assert {draw([0, 1, 0], 7, i) for i in range(50)} == {1}


def test_a_choice_sees_exactly_the_groups_taken_before_index_minus_lag_plus_one() -> None:
    rule = PassRateRule(window=1)
    solved = by_task(solved={0, 1, 2}, never=set())
    ahead = PassRateCurriculum(3, rule, seed=1, lag=3)
    just_in_time = PassRateCurriculum(3, rule, seed=1, lag=3)
    for curriculum in (ahead, just_in_time):
        first = [curriculum.choose(i) for i in range(3)]
        curriculum.taken(group(0, solved(first[0], 0)))
    ahead.taken(group(1, solved(first[1], 1)))  # the trainer happens to be one group further
    assert ahead.choose(3) == just_in_time.choose(3) != first[0]  # group 0's task is retired for both
    with pytest.raises(RuntimeError, match="before the 3 groups it depends on"):
        just_in_time.choose(5)


def test_the_state_resumes_to_the_same_next_choices_even_from_before_the_last_groups_taken() -> None:
    rewards = by_task(solved={1}, never={3})
    straight = PassRateCurriculum(5, RULE, seed=3, lag=3)
    expected = drive(straight, rewards, start=0, stop=60)

    first = PassRateCurriculum(5, RULE, seed=3, lag=3)
    head = drive(first, rewards, start=0, stop=25)
    # The trainer checkpoints at 23 groups: the two after it were taken but not trained, so taken again.
    saved = json.loads(json.dumps(first.state_dict(23)))
    resumed = PassRateCurriculum(5, RULE, seed=3, lag=3, state=saved, start=23)
    assert head[:23] + drive(resumed, rewards, start=23, stop=60) == expected


def test_a_curriculum_that_retires_every_task_stops_with_an_error_saying_so() -> None:
    curriculum = PassRateCurriculum(2, PassRateRule(window=1), seed=0, lag=1)
    with pytest.raises(CurriculumExhausted, match="of 2 tasks, 2 are retired"):
        drive(curriculum, by_task(solved={0, 1}, never=set()), start=0, stop=50)
    given_up = PassRateCurriculum(2, PassRateRule(window=1, unsolved_weight=0.0), seed=0, lag=1)
    with pytest.raises(CurriculumExhausted, match=r"1 are retired .* and 1 never passed"):
        drive(given_up, by_task(solved={0}, never={1}), start=0, stop=50)


def test_a_saved_state_of_another_dataset_or_position_is_refused() -> None:
    curriculum = PassRateCurriculum(3, RULE, seed=0, lag=2)
    drive(curriculum, by_task(set(), set()), start=0, stop=4)
    saved = curriculum.state_dict(4)
    with pytest.raises(CurriculumStateError, match="dataset of 3 rows, this run has 4"):
        PassRateCurriculum(4, RULE, seed=0, lag=2, state=saved, start=4)
    with pytest.raises(CurriculumStateError, match="4 groups taken, the checkpoint 6"):
        PassRateCurriculum(3, RULE, seed=0, lag=2, state=saved, start=6)


def test_status_reads_only_the_last_window_groups() -> None:
    record = TaskRecord(recent=((0, 4), (4, 4), (4, 4)), groups=3, passes=8)
    assert task_status(record, PassRateRule(window=2)) == "retired"
    assert task_status(record, PassRateRule(window=3)) == "active"
    assert task_status(
        TaskRecord(recent=((3, 4),), groups=1, passes=3), PassRateRule(window=1, retire_threshold=0.75)
    ) == ("retired")


# -- with the scheduler and the trainer ------------------------------------------------------------------


def test_the_scheduler_rolls_out_the_rows_the_curriculum_chooses() -> None:
    from harness_trainer.trainer.feed.scheduling import RolloutScheduler, SchedulerConfig
    from tests.trainer.handmade import HandmadeFactory

    factory = HandmadeFactory(
        num_tasks=3, reward=lambda task, member: 1.0 if task == 0 else float(member % 2)
    )
    curriculum = PassRateCurriculum(3, PassRateRule(window=1), seed=4, lag=2)
    settings = SchedulerConfig(
        num_generations=2, max_concurrent_rollouts=4, admission_limit=2, rollout_timeout=30.0, seed=4
    )
    scheduler = RolloutScheduler(factory, factory.prompt_rows(), settings, row_chooser=curriculum)
    scheduler.start()
    try:
        groups = [scheduler.next_group(timeout=30) for _ in range(30)]
    finally:
        scheduler.stop()
    rows = [g.row["task_index"] for g in groups]
    first_solved = rows.index(0)
    assert 0 not in rows[first_solved + 2 :]  # chosen after group first_solved was taken: retired
    assert set(rows) == {0, 1, 2}
    expected = PassRateCurriculum(3, PassRateRule(window=1), seed=4, lag=2)
    rewards = factory.reward
    assert drive(expected, lambda row, i: [rewards(row, m) for m in range(2)], start=0, stop=30) == rows


def curriculum_config(tmp_path, **overrides):
    from tests.trainer.test_trainer import config

    return config(tmp_path, curriculum="pass_rate", curriculum_window=1, **overrides)


def solved_task_0(task: int, member: int) -> float:
    return 1.0 if task == 0 else float(member % 2)


def trained_rows(output_dir) -> dict[int, int]:
    from harness_trainer.trainer.feed.rollout_log import read_rollout_log

    return {r.group: r.task_index for r in read_rollout_log(output_dir)}


@pytest.mark.slow
def test_a_trainer_with_the_curriculum_stops_rolling_out_a_solved_task_and_resumes_to_the_same_rows(
    tmp_path, tiny_model_dir
):
    from harness_trainer import HarnessAsyncGRPOTrainer
    from tests.trainer.handmade import HandmadeFactory
    from tests.trainer.test_trainer import builder, metrics_lines

    straight_factory = HandmadeFactory(reward=solved_task_0)
    straight = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(straight_factory), curriculum_config(tmp_path / "a", max_steps=6)
    )
    straight.train()
    rows = trained_rows(tmp_path / "a" / "out")  # every group taken, dropped ones included
    solved_at = min(group for group, row in rows.items() if row == 0)
    assert [row for group, row in rows.items() if group > solved_at + 1 and row == 0] == []
    assert {row for _, row in rows.items()} == {0, 1, 2}
    assert metrics_lines(tmp_path / "a" / "out")[-1]["curriculum/retired_tasks"] == 1

    first = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir),
        builder(HandmadeFactory(reward=solved_task_0)),
        curriculum_config(tmp_path / "b", max_steps=3),
    )
    first.train()
    resumed = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir),
        builder(HandmadeFactory(reward=solved_task_0)),
        curriculum_config(tmp_path / "b", max_steps=6, resume_from_checkpoint="latest"),
    )
    resumed.train()
    assert first.trained_groups + resumed.trained_groups == straight.trained_groups
    assert trained_rows(tmp_path / "b" / "out") == rows


def test_a_trainer_whose_curriculum_retires_every_task_stops_saying_so(tmp_path, tiny_model_dir):
    from harness_trainer import HarnessAsyncGRPOTrainer
    from tests.trainer.handmade import HandmadeFactory
    from tests.trainer.test_trainer import builder

    factory = HandmadeFactory(reward=lambda task, member: 1.0)
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), curriculum_config(tmp_path))
    with pytest.raises(CurriculumExhausted, match="of 3 tasks, 3 are retired"):
        trainer.train()
    assert not factory.live and factory.closed == len(factory.created) and factory.factory_closed


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"curriculum": "easy_first"}, "curriculum 'easy_first' is not one of"),
        ({"curriculum": "pass_rate", "curriculum_window": 0}, "curriculum_window must be at least 1"),
        ({"curriculum": "pass_rate", "curriculum_retire_threshold": 0.0}, "every task is retired"),
        (
            {"curriculum": "pass_rate", "curriculum_unsolved_weight": 1.5},
            r"curriculum_unsolved_weight must be in \[0, 1\]",
        ),
        (
            {"curriculum": "pass_rate", "curriculum_retired_weight": -0.1},
            r"curriculum_retired_weight must be in",
        ),
        (
            {"curriculum": "pass_rate", "pass_reward": float("nan")},
            "pass_reward must be finite",
        ),
        (
            {"curriculum": "pass_rate", "dataset_shuffle": True},
            "dataset_shuffle does nothing with curriculum",
        ),
    ],
)
def test_a_bad_curriculum_setting_is_refused_with_a_clear_message(overrides, message) -> None:
    from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
    from harness_trainer.trainer.config.problems import ConfigProblems

    with pytest.raises(ConfigProblems, match=message):
        AsyncGRPOConfig(**overrides)


def test_the_curriculum_is_off_by_default_and_its_rule_has_the_configs_defaults() -> None:
    from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig

    config = AsyncGRPOConfig()
    assert config.curriculum == "none" and config.drop_zero_variance_groups
    fields = {
        name: getattr(config, name if name == "pass_reward" else f"curriculum_{name}")
        for name in PassRateRule.__dataclass_fields__
    }
    assert PassRateRule(**fields) == PassRateRule()
