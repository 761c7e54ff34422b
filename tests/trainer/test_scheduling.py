"""The rollout scheduler with hand-made sessions: order, concurrency, admission, faults, closing."""

from __future__ import annotations

import time

import pytest

from harness_trainer.trace import CaptureContractError
from harness_trainer.trainer.feed.scheduling import RolloutScheduler, SchedulerConfig, row_order
from tests.trainer.handmade import HandmadeFactory


def make(factory: HandmadeFactory, **overrides) -> RolloutScheduler:
    settings = dict(
        num_generations=4, max_concurrent_rollouts=3, admission_limit=2, rollout_timeout=30.0, seed=7,
        close_timeout_s=10.0,
    )  # fmt: skip
    settings.update(overrides)
    scheduler = RolloutScheduler(factory, factory.prompt_rows(), SchedulerConfig(**settings))
    scheduler.start()
    return scheduler


def take(scheduler: RolloutScheduler, n: int) -> list:
    groups = []
    for _ in range(n):
        group = scheduler.next_group(timeout=30)
        assert group is not None
        groups.append(group)
    return groups


def test_groups_come_in_admission_order_with_rows_cycled_and_one_seed_per_group() -> None:
    factory = HandmadeFactory(num_tasks=3)
    scheduler = make(factory)
    try:
        groups = take(scheduler, 5)
    finally:
        scheduler.stop()
    assert [g.index for g in groups] == [0, 1, 2, 3, 4]
    assert [g.row["task_index"] for g in groups] == [0, 1, 2, 0, 1]
    assert [g.seed for g in groups] == [7, 8, 9, 10, 11]
    for group in groups:
        assert len(group.rollouts) == 4 and len(group.scored) == 4
        assert [r.reward for r in group.rollouts] == [0.0, 1.0, 0.0, 1.0]
        assert all(len(r.rows) == 1 for r in group.rollouts)
    seeds_by_group = {}
    for task, seed, episode in factory.created:
        seeds_by_group.setdefault(episode.split("-")[0], set()).add((task, seed))
    assert all(len(pairs) == 1 for pairs in seeds_by_group.values())
    assert not factory.live and factory.closed == len(factory.created)


def test_shuffled_order_visits_every_row_once_per_pass() -> None:
    order = [row_order(5, g, seed=3, shuffle=True) for g in range(10)]
    assert sorted(order[:5]) == list(range(5)) and sorted(order[5:]) == list(range(5))
    assert order[:5] != list(range(5)) or order[5:] != list(range(5))


def test_live_sessions_never_exceed_the_concurrency_limit() -> None:
    factory = HandmadeFactory(delay_s=0.05)
    scheduler = make(factory, max_concurrent_rollouts=3, admission_limit=3)
    try:
        take(scheduler, 4)
    finally:
        scheduler.stop()
    assert 1 <= factory.max_live <= 3


def test_admission_stops_at_the_staleness_bound_until_groups_are_taken() -> None:
    factory = HandmadeFactory()
    scheduler = make(factory, admission_limit=2)
    try:
        time.sleep(1.0)
        assert len(factory.created) == 2 * 4  # two groups admitted, nothing taken yet
        take(scheduler, 1)
        time.sleep(1.0)
        assert len(factory.created) == 3 * 4
    finally:
        scheduler.stop()


def test_with_hold_taken_a_taken_group_keeps_its_place_until_it_is_released() -> None:
    factory = HandmadeFactory()
    scheduler = make(factory, admission_limit=2, max_concurrent_rollouts=8, hold_taken=True)
    try:
        time.sleep(1.0)
        assert len(factory.created) == 2 * 4
        take(scheduler, 1)
        time.sleep(1.0)
        assert len(factory.created) == 2 * 4, "taken but not released: its step has not pushed yet"
        scheduler.release()
        deadline = time.monotonic() + 10
        while len(factory.created) < 3 * 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(factory.created) == 3 * 4
        scheduler.release(5)  # no more than was taken is freed
        time.sleep(1.0)
        assert len(factory.created) == 3 * 4
    finally:
        scheduler.stop()


def test_failed_starts_shrink_the_group_and_timeouts_stay_scored() -> None:
    factory = HandmadeFactory(fail_start=lambda n: n % 4 == 0, time_out=lambda n: n % 4 == 1)
    scheduler = make(factory)
    try:
        (group,) = take(scheduler, 1)
    finally:
        scheduler.stop()
    unscorable = [r for r in group.rollouts if r.unscorable]
    assert len(unscorable) == 1 and "would not start" in unscorable[0].unscorable
    assert not unscorable[0].rows
    timed_out = [r for r in group.rollouts if r.timed_out]
    assert len(timed_out) == 1 and timed_out[0].scored and timed_out[0].rows
    assert len(group.scored) == 3
    assert not factory.live


def test_a_malformed_capture_stops_everything_and_is_raised() -> None:
    factory = HandmadeFactory(malformed=lambda n: n == 5, hang=lambda n: n >= 6)
    scheduler = make(factory, admission_limit=3, max_concurrent_rollouts=4)
    try:
        with pytest.raises(CaptureContractError) as raised:
            take(scheduler, 3)
    finally:
        scheduler.stop()
    assert raised.value.session_id == "hand-5"
    assert not factory.live and scheduler.live_sessions() == 0


def test_stop_closes_hanging_sessions_promptly() -> None:
    factory = HandmadeFactory(hang=lambda n: True)
    scheduler = make(factory, max_concurrent_rollouts=4)
    time.sleep(0.5)
    assert len(factory.live) == 4
    started = time.monotonic()
    scheduler.stop()
    assert time.monotonic() - started < 10
    assert not factory.live and factory.closed == len(factory.created)


def test_a_raising_reward_function_makes_the_rollout_unscorable() -> None:
    def picky(outcome):
        if outcome.env_reward == 1.0:
            raise KeyError("boom")
        return outcome.env_reward

    factory = HandmadeFactory()
    scheduler = RolloutScheduler(
        factory,
        factory.prompt_rows(),
        SchedulerConfig(
            num_generations=4, max_concurrent_rollouts=4, admission_limit=1, rollout_timeout=None, seed=0
        ),
        reward_fn=picky,
    )
    scheduler.start()
    try:
        (group,) = take(scheduler, 1)
    finally:
        scheduler.stop()
    assert [r.unscorable is not None for r in group.rollouts] == [False, True, False, True]
    assert "picky" in group.rollouts[1].unscorable


def test_each_finished_rollout_is_handed_over_failed_ones_included_before_its_group_can_be_taken() -> None:
    factory = HandmadeFactory(num_tasks=2, fail_start=lambda n: n == 1)
    seen: list[tuple[int, int, str | None]] = []
    config = SchedulerConfig(num_generations=2, max_concurrent_rollouts=2, admission_limit=1,
                             rollout_timeout=30.0, seed=0, close_timeout_s=10.0)  # fmt: skip
    scheduler = RolloutScheduler(
        factory, factory.prompt_rows(), config,
        on_rollout_done=lambda group, rollout: seen.append((group.index, rollout.member, rollout.unscorable)),
    )  # fmt: skip
    scheduler.start()
    try:
        (group,) = take(scheduler, 1)
        assert sorted(seen[:2], key=lambda s: s[1]) == [
            (0, m, r.unscorable) for m, r in enumerate(group.rollouts)
        ]  # both members, before next_group returned their group
        assert any(unscorable and "would not start" in unscorable for _, _, unscorable in seen[:2])
    finally:
        scheduler.stop()


def test_a_rollout_record_that_cannot_be_written_stops_the_scheduler() -> None:
    from harness_trainer.trainer.feed.scheduling import RolloutSchedulerError

    def full_disk(group, rollout) -> None:
        raise OSError(28, "No space left on device")

    factory = HandmadeFactory(num_tasks=1)
    config = SchedulerConfig(num_generations=2, max_concurrent_rollouts=2, admission_limit=1,
                             rollout_timeout=30.0, seed=0, close_timeout_s=10.0)  # fmt: skip
    scheduler = RolloutScheduler(factory, factory.prompt_rows(), config, on_rollout_done=full_disk)
    scheduler.start()
    try:
        with pytest.raises(RolloutSchedulerError, match="No space left on device"):
            scheduler.next_group(timeout=30)
    finally:
        scheduler.stop()
    assert not factory.live
