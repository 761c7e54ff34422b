"""rollouts.jsonl: every rollout as it finished, merged with what a step did with it, on the latest timeline;
files of the earlier format (a record per rollout of a trained step) read as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness_trainer.rollouts.client.session import VerifyResult
from harness_trainer.trace import load_trace
from harness_trainer.trainer.feed.rollout_log import ROLLOUTS_FILE, RolloutLog, latest_steps, read_rollout_log
from harness_trainer.trainer.feed.rollout_records import (
    FEW_SCORED,
    NO_TOKENS,
    NOT_TAKEN,
    NOT_TRAINED,
    UNGRADED,
    UNSCORABLE,
    ZERO_ADVANTAGE,
    ZERO_VARIANCE,
    RolloutOutcome,
    RunStart,
    rollout_record,
    step_outcomes,
)
from harness_trainer.trainer.feed.scheduling import RolloutScheduler, SchedulerConfig
from harness_trainer.trainer.step.batch import assemble
from harness_trainer.trainer.step.groups import Group, Rollout
from harness_trainer.trainer.step.outcome import build_outcome
from harness_trainer.trainer.step.rows import build_rows
from tests.trainer.handmade import HandmadeFactory, chain_trace


def finished(group: int, member: int, *, reward: float | None = 1.0, metrics: dict | None = None) -> Rollout:
    """A rollout as the scheduler leaves it after scoring a hand-made session."""
    trace = load_trace(chain_trace(group, member))
    verify = VerifyResult(env_reward=reward, metrics=metrics or {})
    outcome = build_outcome(trace, verify, timed_out=False)
    return Rollout(
        group, member, policy_version=3, reward=reward, outcome=outcome, trace=trace,
        rows=build_rows(trace), seconds=1.5,
    )  # fmt: skip


def record(rollout: Rollout, step: int = 1, **overrides):
    arguments = dict(
        step=step, task_name=f"t{rollout.group}", task_index=rollout.group, advantage=0.5,
        verify_metrics=None, findings=None,
    )  # fmt: skip
    arguments.update(overrides)
    return rollout_record(rollout, **arguments)


def test_a_record_round_trips_through_the_log_with_its_trace(tmp_path: Path) -> None:
    rollout = finished(0, 1, metrics={"phase_seconds": {"agent": 2.0, "verify": 0.5}})
    findings = [{"check": "tests", "passed": False}, "lint: 2 warnings"]
    with RolloutLog(tmp_path) as log:
        log.write(
            [record(rollout, step=4, findings=findings, verify_metrics={"phase_seconds": {"agent": 2}})]
        )
    [back] = read_rollout_log(tmp_path / ROLLOUTS_FILE)
    assert (back.step, back.group, back.member, back.task_name, back.task_index) == (4, 0, 1, "t0", 0)
    assert (back.reward, back.env_reward, back.advantage, back.policy_version) == (1.0, 1.0, 0.5, 3)
    assert back.unscorable is None and back.timed_out is False and back.seconds == 1.5
    assert back.tool_calls_by_name == {"bash": 2} and back.tool_call_count == 2
    assert back.phase_seconds == {"agent": 2.0}
    assert back.sandbox_seconds is None and back.snapshot is None  # not reported: null, not 0
    assert back.findings == findings
    assert back.trace == rollout.trace


def test_sandbox_seconds_and_the_groups_snapshot_are_logged_per_rollout(tmp_path: Path) -> None:
    rollout = finished(0, 2)
    metrics = {"sandbox_seconds": 41.5, "snapshot": "ht-snap-1", "phase_seconds": {"agent": 2}}
    with RolloutLog(tmp_path) as log:
        log.write([record(rollout, verify_metrics=metrics), record(finished(1, 0), verify_metrics={})])
    forked, cold = read_rollout_log(tmp_path)
    assert (forked.sandbox_seconds, forked.snapshot) == (41.5, "ht-snap-1")
    assert (cold.sandbox_seconds, cold.snapshot) == (None, None)


def test_traces_can_be_read_as_written_without_validating_them_again(tmp_path: Path) -> None:
    rollouts = [finished(0, 0), Rollout(0, 1, unscorable="gone")]
    with RolloutLog(tmp_path) as log:
        log.write([record(rollout) for rollout in rollouts])
    fast = read_rollout_log(tmp_path, validate_traces=False)
    assert fast == read_rollout_log(tmp_path)
    assert fast[0].trace is not None and fast[0].trace.turns[1].completion_token_ids == [100, 201, 300]
    assert fast[1].trace is None


def test_an_unscorable_rollout_is_logged_without_trace_reward_or_advantage(tmp_path: Path) -> None:
    rollout = Rollout(2, 0, unscorable="RolloutUnscorable: sandbox 3 would not start", seconds=0.2)
    with RolloutLog(tmp_path) as log:
        log.write([record(rollout, advantage=None)])
    [back] = read_rollout_log(tmp_path)
    assert back.unscorable == "RolloutUnscorable: sandbox 3 would not start"
    assert back.trace is None and back.reward is None and back.env_reward is None and back.advantage is None
    assert back.tool_call_count == 0 and back.tool_calls_by_name == {}


def test_rollout_and_capture_session_ids_travel_into_the_log_unscorable_rollouts_included(
    tmp_path: Path,
) -> None:
    from harness_trainer.rollouts.client.session import RolloutUnscorable

    # Session 1 fails after its capture session was minted, session 2 before any session existed.
    factory = HandmadeFactory(
        num_tasks=1,
        fail_wait=lambda n: RolloutUnscorable("sandbox died") if n == 1 else None,
        fail_start=lambda n: n == 2,
    )
    config = SchedulerConfig(num_generations=4, max_concurrent_rollouts=1, admission_limit=1,
                             rollout_timeout=30.0, seed=0, close_timeout_s=10.0)  # fmt: skip
    scheduler = RolloutScheduler(factory, factory.prompt_rows(), config)
    scheduler.start()
    try:
        group = scheduler.next_group(timeout=30)
    finally:
        scheduler.stop()
    assert group is not None
    with RolloutLog(tmp_path) as log:
        log.write(record(r, advantage=None) for r in group.rollouts)
    records = read_rollout_log(tmp_path)
    # One slot: members start in order, so session n is member n.
    assert [(r.rollout_id, r.capture_session_id, r.unscorable is None) for r in records] == [
        ("group0-member0", "cs-hand-0", True),
        ("group0-member1", "cs-hand-1", False),
        ("group0-member2", None, False),
        ("group0-member3", "cs-hand-3", True),
    ]
    # Group 1 may be admitted (and its first session created) between the take and the stop.
    created = [episode for _, _, episode in factory.created if episode.startswith("group0-")]
    assert created == [r.rollout_id for r in records]
    line = (tmp_path / ROLLOUTS_FILE).read_text().splitlines()[1]
    assert line.startswith(
        '{"step":1,"group":0,"member":1,"rollout_id":"group0-member1","capture_session_id":"cs-hand-1",'
    )


def test_a_record_written_before_the_ids_existed_reads_with_both_null(tmp_path: Path) -> None:
    (tmp_path / ROLLOUTS_FILE).write_text('{"step":1,"group":0,"member":0,"unscorable":"gone"}\n')
    [back] = read_rollout_log(tmp_path)
    assert back.rollout_id is None and back.capture_session_id is None


def test_tool_counts_come_from_the_outcome_else_from_the_verify_metrics() -> None:
    reported = {"tool_calls_by_name": {"edit": 3, "bash": 1}, "tool_failure_count": 2}
    from_outcome = record(finished(0, 0, metrics=reported), verify_metrics={"tool_calls_by_name": {"x": 9}})
    assert from_outcome.tool_calls_by_name == {"edit": 3, "bash": 1}
    assert (from_outcome.tool_call_count, from_outcome.tool_failure_count) == (4, 2)
    no_outcome = record(Rollout(0, 1, unscorable="reward function failed"), verify_metrics=reported)
    assert no_outcome.tool_calls_by_name == {"edit": 3, "bash": 1}
    assert (no_outcome.tool_call_count, no_outcome.tool_failure_count) == (4, 2)


def test_findings_that_are_neither_dicts_nor_strings_are_kept_as_text(tmp_path: Path) -> None:
    odd = record(finished(0, 0), findings=[Path("/tmp/report.txt"), 7, {"at": Path("a.py")}])
    assert odd.findings[:2] == ["/tmp/report.txt", "7"]
    with RolloutLog(tmp_path) as log:
        log.write([odd])
    assert read_rollout_log(tmp_path)[0].findings == ["/tmp/report.txt", "7", {"at": "a.py"}]


def test_each_step_is_on_disk_once_written_and_close_is_idempotent(tmp_path: Path) -> None:
    log = RolloutLog(tmp_path)
    log.write([record(finished(0, m), step=1) for m in range(2)])
    assert [r.member for r in read_rollout_log(tmp_path)] == [0, 1]
    log.write([record(finished(1, m), step=2) for m in range(2)])
    assert len(read_rollout_log(tmp_path)) == 4
    log.close()
    log.close()
    with pytest.raises(RuntimeError, match="after close"):
        log.write([record(finished(0, 0))])


def test_a_resumed_run_supersedes_the_steps_it_writes_again(tmp_path: Path) -> None:
    with RolloutLog(tmp_path) as log:
        for step in (1, 2, 3):
            log.write([record(finished(step, m), step=step, advantage=-1.0) for m in range(2)])
    with RolloutLog(tmp_path) as log:  # resumed from the checkpoint of step 1: steps 2 and 3 again
        log.write([record(finished(2, m), step=2, advantage=1.0) for m in range(2)])
    records = read_rollout_log(tmp_path)
    assert [(r.step, r.advantage) for r in records] == [(1, -1.0), (1, -1.0), (2, 1.0), (2, 1.0)]
    with RolloutLog(tmp_path) as log:  # and again from step 2: the same step, the same rollouts
        log.write([record(finished(2, m), step=2, advantage=2.0) for m in range(2)])
    assert [r.advantage for r in read_rollout_log(tmp_path) if r.step == 2] == [2.0, 2.0]


def test_a_resumed_log_drops_the_line_a_crash_cut_short(tmp_path: Path) -> None:
    with RolloutLog(tmp_path) as log:
        log.write([record(finished(0, 0), step=1)])
    path = tmp_path / ROLLOUTS_FILE
    complete = path.read_bytes()
    with open(path, "ab") as file:
        file.write(b'{"step":2,"group":1,"member":0,"trace":{"turns":[{"node_id":"n0","prompt_token_ids":[1,')
    with RolloutLog(tmp_path) as log:
        assert path.read_bytes() == complete
        log.write([record(finished(1, 0), step=2)])
    assert [(r.step, r.group) for r in read_rollout_log(path)] == [(1, 0), (2, 1)]


def test_only_the_last_steps_are_kept_when_asked() -> None:
    entries = [(step, member, f"{step}.{member}") for step in range(1, 6) for member in range(2)]
    assert list(latest_steps(entries, last=2).items()) == [(4, ["4.0", "4.1"]), (5, ["5.0", "5.1"])]
    metrics = [(1, None, "a"), (2, None, "b"), (2, None, "b again"), (3, None, "c")]
    assert latest_steps(metrics) == {1: ["a"], 2: ["b again"], 3: ["c"]}


def test_a_write_cut_short_is_skipped_but_a_malformed_line_names_the_file_and_line(tmp_path: Path) -> None:
    with RolloutLog(tmp_path) as log:
        log.write([record(finished(0, 0))])
    path = tmp_path / ROLLOUTS_FILE
    with open(path, "a") as file:
        file.write('{"step": 2, "group": 1, "member": 0, "trace": {"schema_ver')
    assert len(read_rollout_log(path)) == 1
    path.write_text(path.read_text() + "\n" + json.dumps({"step": 3}) + "\n")
    with pytest.raises(ValueError, match=rf"{ROLLOUTS_FILE}:2: not valid JSON"):
        read_rollout_log(path)
    path.write_text(json.dumps({"step": 3, "group": 0, "member": 0, "reward": "high"}) + "\n")
    with pytest.raises(ValueError, match=rf"{ROLLOUTS_FILE}:1: not a rollout record"):
        read_rollout_log(path)
    path.write_text(json.dumps({"step": 3}) + "\n")
    with pytest.raises(ValueError, match=rf"{ROLLOUTS_FILE}:1: .*integer step, group and member"):
        read_rollout_log(path)


def test_a_scheduled_step_logs_every_rollout_with_its_trained_advantage(tmp_path: Path) -> None:
    # Member 2 of each group is ungraded: it is logged, but has no advantage; group 1 has a single scored
    # member and is dropped: all of its rollouts are logged without one.
    def reward(task: int, member: int) -> float | None:
        return None if member == 2 or (task == 1 and member) else float(member % 2)

    factory = HandmadeFactory(num_tasks=2, reward=reward)
    config = SchedulerConfig(num_generations=3, max_concurrent_rollouts=3, admission_limit=2,
                             rollout_timeout=30.0, seed=0, close_timeout_s=10.0)  # fmt: skip
    scheduler = RolloutScheduler(factory, factory.prompt_rows(), config)
    scheduler.start()
    try:
        groups = [scheduler.next_group(timeout=30) for _ in range(2)]
    finally:
        scheduler.stop()
    batch = assemble(groups, advantage_epsilon=1e-4, keep_zero_advantage=False)
    advantages = {(r.group, r.member): batch.advantages[i] for i, r in enumerate(batch.rollouts)}
    with RolloutLog(tmp_path) as log:
        log.write(
            rollout_record(
                rollout,
                step=1,
                task_name=group.row["task_name"],
                task_index=group.row["task_index"],
                advantage=advantages.get((rollout.group, rollout.member)),
                verify_metrics=None,
                findings=None,
            )
            for group in groups
            for rollout in group.rollouts
        )
    records = read_rollout_log(tmp_path)
    assert [(r.group, r.member, r.task_name) for r in records] == [
        (0, 0, "t0"), (0, 1, "t0"), (0, 2, "t0"), (1, 0, "t1"), (1, 1, "t1"), (1, 2, "t1"),
    ]  # fmt: skip
    assert [r.reward for r in records] == [0.0, 1.0, None, 0.0, None, None]
    assert [r.advantage is not None for r in records] == [True, True, False, False, False, False]
    assert all(r.trace is not None and r.trace == rollout.trace for r, rollout in
               zip(records, [r for g in groups for r in g.rollouts], strict=True))  # fmt: skip


def done(rollout: Rollout, **overrides):
    """The line the trainer writes when ``rollout`` finishes: no step or advantage yet."""
    arguments = dict(
        task_name=f"t{rollout.group}", task_index=rollout.group, verify_metrics=None, findings=None
    )
    arguments.update(overrides)
    return rollout_record(rollout, **arguments)


def outcome(step: int, group: int, member: int, advantage: float | None = None, why: str | None = None):
    return RolloutOutcome(step=step, group=group, member=member, advantage=advantage, not_trained=why)


def test_a_finished_rollout_reads_merged_with_what_its_step_did_and_untaken_ones_say_so(
    tmp_path: Path,
) -> None:
    with RolloutLog(tmp_path) as log:
        log.write([RunStart(step=0, start_group=0)])
        log.write([done(finished(0, 0)), done(finished(1, 0)), done(finished(0, 1))])
        log.write([outcome(1, 0, 0, advantage=0.5), outcome(1, 0, 1, why=ZERO_ADVANTAGE)])
    first = (tmp_path / ROLLOUTS_FILE).read_text().splitlines()[1]
    assert first.startswith('{"step":null,"group":0,"member":0,"rollout_id":"group0-member0",')
    records = read_rollout_log(tmp_path)
    assert [(r.step, r.group, r.member, r.advantage, r.not_trained) for r in records] == [
        (1, 0, 0, 0.5, None), (1, 0, 1, None, ZERO_ADVANTAGE), (None, 1, 0, None, NOT_TAKEN),
    ]  # fmt: skip
    assert records[0].trace == finished(0, 0).trace and records[0].reward == 1.0
    assert read_rollout_log(tmp_path, validate_traces=False) == records
    assert [(r.step, r.group) for r in read_rollout_log(tmp_path, last_steps=1)] == [
        (1, 0),
        (1, 0),
        (None, 1),
    ]


def test_what_a_step_did_with_each_rollout_names_why_the_untrained_did_not_train() -> None:
    def member(group: int, m: int, reward: float | None, unscorable: str | None = None, rows: bool = True):
        r = finished(group, m, reward=reward)
        r.unscorable, r.rows = unscorable, r.rows if rows else []
        return r

    few = Group(0, {}, 0, [member(0, 0, 1.0), member(0, 1, None, "sandbox gone"), member(0, 2, None)])
    flat = Group(1, {}, 1, [member(1, 0, 1.0), member(1, 1, 1.0)])
    taken = Group(2, {}, 2, [member(2, 0, 1.0), member(2, 1, 0.0), member(2, 2, 0.0, rows=False),
                             member(2, 3, 0.5)])  # fmt: skip
    outcomes = step_outcomes(4, [few, flat], [taken], {(2, 0): 1.0, (2, 1): -1.0})
    assert all(o.step == 4 for o in outcomes)
    assert [(o.group, o.member, o.advantage, o.not_trained) for o in outcomes] == [
        (0, 0, None, FEW_SCORED), (0, 1, None, UNSCORABLE), (0, 2, None, UNGRADED),
        (1, 0, None, ZERO_VARIANCE), (1, 1, None, ZERO_VARIANCE),
        (2, 0, 1.0, None), (2, 1, -1.0, None), (2, 2, None, NO_TOKENS), (2, 3, None, ZERO_ADVANTAGE),
    ]  # fmt: skip


def test_a_resumed_run_supersedes_the_groups_it_rolls_out_again_and_the_steps_it_trains_again(
    tmp_path: Path,
) -> None:
    with RolloutLog(tmp_path) as log:  # the first run: steps 1 and 2 on groups 0 and 1, group 2 untaken
        log.write([RunStart(step=0, start_group=0)])
        for group in (0, 1, 2):
            log.write([done(finished(group, m)) for m in range(2)])
        log.write([outcome(1, 0, m, advantage=-1.0) for m in range(2)])
        log.write([outcome(2, 1, m, advantage=-1.0) for m in range(2)])
    with RolloutLog(tmp_path) as log:  # resumed from the checkpoint of step 1: groups 1 and on again
        log.write([RunStart(step=1, start_group=1)])
        log.write([done(finished(1, m, reward=0.0)) for m in range(2)])
    records = read_rollout_log(tmp_path)
    # Group 1 as re-run, not yet taken; group 2's earlier rollouts are gone (the resumed run redoes it).
    assert [(r.step, r.group, r.advantage, r.reward) for r in records] == [
        (1, 0, -1.0, 1.0), (1, 0, -1.0, 1.0), (None, 1, None, 0.0), (None, 1, None, 0.0),
    ]  # fmt: skip
    with RolloutLog(tmp_path) as log:
        log.write([outcome(2, 1, m, advantage=2.0) for m in range(2)])
    assert [(r.step, r.advantage) for r in read_rollout_log(tmp_path) if r.group == 1] == [(2, 2.0), (2, 2.0)]


def test_an_old_format_file_reads_with_reasons_derived_and_a_new_run_appended_supersedes_its_later_steps(
    tmp_path: Path,
) -> None:
    with RolloutLog(tmp_path) as log:  # the earlier format: a record per rollout of each trained step
        log.write([record(finished(0, 0), step=1), record(finished(0, 1), step=1, advantage=None)])
        log.write([record(Rollout(1, 0, unscorable="gone"), step=2, advantage=None)])
        log.write([record(finished(1, 1, reward=None), step=2, advantage=None)])
    old = read_rollout_log(tmp_path)
    assert [(r.step, r.not_trained) for r in old] == [
        (1, None),
        (1, NOT_TRAINED),
        (2, UNSCORABLE),
        (2, UNGRADED),
    ]
    assert old[0].llm_s == 0.0 and old[0].dispatch_version_min is None and old[0].trace_logged
    with RolloutLog(tmp_path) as log:  # this version resumes from step 1
        log.write([RunStart(step=1, start_group=1)])
        log.write([done(finished(1, 0))])
        log.write([outcome(2, 1, 0, advantage=0.25)])
    assert [(r.step, r.group, r.advantage) for r in read_rollout_log(tmp_path)] == [
        (1, 0, 0.5), (1, 0, None), (2, 1, 0.25),
    ]  # fmt: skip


def test_writes_from_many_threads_stay_whole_lines(tmp_path: Path) -> None:
    import threading

    with RolloutLog(tmp_path) as log:

        def write(group: int) -> None:
            for m in range(5):
                log.write([done(finished(group, m))])

        threads = [threading.Thread(target=write, args=(g,)) for g in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    records = read_rollout_log(tmp_path)
    assert sorted((r.group, r.member) for r in records) == [(g, m) for g in range(6) for m in range(5)]


def test_a_record_carries_its_time_split_and_the_versions_its_calls_were_sent_and_answered_at() -> None:
    rollout = finished(0, 0)
    rollout.seconds = 5.0
    for i, turn in enumerate(rollout.trace.turns):
        turn.metadata.update(
            started_at=10.0 + i, finished_at=11.5 + i, dispatch_version=2 + i, weight_version=3 + i
        )
    line = done(rollout, verify_metrics={"phase_seconds": {"install": 1.0, "agent": 3.0}}, with_trace=False)
    assert (line.llm_s, line.env_s, line.other_s) == pytest.approx((2.5, 1.5, 1.0))
    assert (line.dispatch_version_min, line.dispatch_version_max) == (2, 3)
    assert (line.return_version_min, line.return_version_max) == (3, 4)
    assert line.trace is None and not line.trace_logged
