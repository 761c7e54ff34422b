"""A step's batch from finished groups: dropped groups, advantages on rows, per-rollout weights, metrics."""

from __future__ import annotations

import pytest

from harness_trainer.trace import load_trace
from harness_trainer.trainer.step.batch import assemble, rollout_metrics, token_staleness_median
from harness_trainer.trainer.step.groups import Group, Rollout
from harness_trainer.trainer.step.rows import build_rows
from tests.test_package_boundaries import modules_after
from tests.trainer.handmade import chain_trace


def rollout(group: int, member: int, reward: float | None, *, turns: int = 2, unscorable: str | None = None):
    trace = load_trace(chain_trace(group, member, turns=turns))
    r = Rollout(group, member, reward=reward, trace=trace, unscorable=unscorable)
    r.rows = [] if unscorable else build_rows(trace)
    return r


def test_groups_with_fewer_than_two_scored_members_are_dropped() -> None:
    lonely = Group(0, {}, 0, [rollout(0, 0, 1.0), rollout(0, 1, None, unscorable="sandbox")])
    fine = Group(1, {}, 1, [rollout(1, 0, 1.0), rollout(1, 1, 0.0), rollout(1, 2, None)])
    batch = assemble([lonely, fine], advantage_epsilon=1e-4, keep_zero_advantage=False)
    assert batch.dropped_groups == 1
    assert len(batch.rollouts) == 2
    assert batch.advantages[0] == pytest.approx(0.5 / (2**0.5 / 2 + 1e-4))
    assert batch.advantages[0] == pytest.approx(-batch.advantages[1])


def test_weights_make_every_rollout_count_once_however_many_tokens_it_has() -> None:
    group = Group(0, {}, 0, [rollout(0, 0, 1.0, turns=1), rollout(0, 1, 0.0, turns=3)])
    batch = assemble([group], advantage_epsilon=1e-4, keep_zero_advantage=False)
    per_rollout = {}
    for row in batch.rows:
        per_rollout[row.rollout] = (
            per_rollout.get(row.rollout, 0.0) + row.n_targets * batch.weights[row.rollout]
        )
    assert per_rollout == pytest.approx({0: 0.5, 1: 0.5})


def test_zero_advantage_rollouts_are_left_out_unless_a_kl_term_needs_them() -> None:
    group = Group(0, {}, 0, [rollout(0, 0, 1.0), rollout(0, 1, 1.0)])
    assert not assemble([group], advantage_epsilon=1e-4, keep_zero_advantage=False).rows
    kept = assemble([group], advantage_epsilon=1e-4, keep_zero_advantage=True)
    assert len(kept.rollouts) == 2 and set(kept.advantages.values()) == {0.0}


def test_metrics_count_failures_and_staleness() -> None:
    members = [rollout(0, 0, 1.0), rollout(0, 1, 0.0), rollout(0, 2, None, unscorable="x")]
    members[0].policy_version, members[1].policy_version = 3, 2
    members[1].timed_out = True
    metrics = rollout_metrics([Group(0, {}, 0, members)], policy_version=3, reward_name="fn")
    assert metrics["reward"] == 0.5 and metrics["rewards/fn"] == 0.5
    assert metrics["rollout/unscorable"] == 1.0
    assert metrics["rollout/timed_out_frac"] == pytest.approx(1 / 3)
    assert metrics["staleness/mean"] == 0.5 and metrics["staleness/max"] == 1.0  # scored members only
    assert metrics["completions/mean_length"] == 6.0


def test_each_phase_is_a_perf_metric_averaged_over_the_rollouts_that_report_it() -> None:
    members = [rollout(0, 0, 1.0), rollout(0, 1, 0.0), rollout(0, 2, None, unscorable="sandbox failed")]
    members[0].verify_metrics = {"phase_seconds": {"sandbox_start": 2.0, "install": 10.0, "agent": 30.0}}
    members[1].verify_metrics = {"phase_seconds": {"sandbox_start": 4.0, "install": 0.5, "agent": 50.0}}
    members[2].verify_metrics = {"phase_seconds": {"sandbox_start": 9.0, "bogus": "x"}}
    metrics = rollout_metrics([Group(0, {}, 0, members)], policy_version=0, reward_name="")
    assert metrics["perf/sandbox_start_s"] == 5.0  # a failed start took its time too
    assert metrics["perf/install_s"] == 5.25 and metrics["perf/agent_s"] == 40.0
    assert "perf/bogus_s" not in metrics
    no_phases = rollout_metrics([Group(0, {}, 0, members[:0])], policy_version=0, reward_name="")
    assert not [name for name in no_phases if name.startswith("perf/")]


def test_sandbox_seconds_per_rollout_is_the_mean_over_the_rollouts_that_report_them() -> None:
    members = [rollout(0, 0, 1.0), rollout(0, 1, 0.0), rollout(0, 2, None, unscorable="sandbox failed")]
    members[0].verify_metrics = {"sandbox_seconds": 40.0}  # the agent's sandbox and a verifier's, summed
    members[1].verify_metrics = {"sandbox_seconds": 20.0}
    members[2].verify_metrics = {"sandbox_seconds": 0.0}  # its sandbox never started: it cost nothing
    metrics = rollout_metrics([Group(0, {}, 0, members)], policy_version=0, reward_name="")
    assert metrics["sandbox/seconds_per_rollout"] == 20.0
    members[2].verify_metrics = {"sandbox_seconds": True}  # not a number of seconds
    metrics = rollout_metrics([Group(0, {}, 0, members)], policy_version=0, reward_name="")
    assert metrics["sandbox/seconds_per_rollout"] == 30.0
    for member in members:
        member.verify_metrics = {}  # an engine-side factory reports none
    assert "sandbox/seconds_per_rollout" not in rollout_metrics(
        [Group(0, {}, 0, members)], policy_version=0, reward_name=""
    )


def test_staleness_counts_from_the_earliest_dispatch_version_of_the_supervised_turns() -> None:
    members = [rollout(0, 0, 1.0, turns=3), rollout(0, 1, 0.0)]
    members[0].policy_version = members[1].policy_version = 5
    turns = members[0].trace.turns
    turns[0].metadata.update(dispatch_version=1)
    turns[0].loss_mask[len(turns[0].prompt_token_ids) :] = [0, 0, 0]  # context only: not what is trained
    turns[1].metadata.update(dispatch_version=3)
    turns[2].metadata.update(dispatch_version=4)
    metrics = rollout_metrics([Group(0, {}, 0, members)], policy_version=6, reward_name="")
    # member 0 trained on data sent at version 3 (staleness 3), member 1 has no dispatch stamps (6 - 5)
    assert metrics["staleness/max"] == 3.0 and metrics["staleness/mean"] == 2.0
    # Per sampled token, each turn at its own version: 3 tokens at 3, 3 at 2 (member 0's later turn), 6 at
    # 1 (member 1's two turns): the two middle tokens of 12 are at 1 and 2.
    assert metrics["staleness/tokens_median"] == 1.5
    assert token_staleness_median([members[1]], policy_version=6) == 1.0
    assert token_staleness_median([], policy_version=6) == 0.0


def test_the_rollouts_time_split_means_are_perf_metrics() -> None:
    members = [rollout(0, 0, 1.0, turns=2), rollout(0, 1, 0.0, turns=1), rollout(0, 2, None, unscorable="x")]
    for r, seconds in zip(members, (10.0, 6.0, 3.0), strict=True):
        r.seconds = seconds
    first = members[0].trace.turns
    first[0].metadata.update(started_at=100.0, finished_at=103.0)
    first[1].metadata.update(started_at=102.0, finished_at=104.0)  # overlaps the first: 4 s in all
    members[0].verify_metrics = {"phase_seconds": {"sandbox_start": 1.0, "agent": 7.0}}
    members[1].trace.turns[0].metadata.update(started_at=50.0, finished_at=52.0)
    metrics = rollout_metrics([Group(0, {}, 0, members)], policy_version=0, reward_name="")
    assert metrics["perf/rollout_llm_s"] == pytest.approx((4.0 + 2.0 + 0.0) / 3)
    assert metrics["perf/rollout_env_s"] == pytest.approx((1.0 + 3.0) / 3)
    assert metrics["perf/rollout_other_s"] == pytest.approx((10.0 - 8.0 + 6.0 - 2.0 + 3.0) / 3)


def test_step_normalization_weighs_every_token_alike_and_still_counts_a_split_rollout_once() -> None:
    group = Group(0, {}, 0, [rollout(0, 0, 1.0, turns=1), rollout(0, 1, 0.0, turns=3)])
    batch = assemble([group], advantage_epsilon=1e-4, keep_zero_advantage=False, normalization="step")
    assert batch.weights[0] == batch.weights[1]
    longest = max(sum(r.n_targets for r in batch.rows if r.rollout == i) for i in (0, 1))
    assert batch.weights[0] == pytest.approx(1 / (longest * 2))


def test_the_step_data_modules_do_not_import_the_threaded_scheduler() -> None:
    statement = "import harness_trainer.trainer.step.batch, harness_trainer.trainer.feed.rollout_log"
    assert modules_after(statement, ["harness_trainer.trainer.feed.scheduling", "torch"]) == []
