"""A run that mixes harnesses, on the trainer's side: the scheduler tags each group with its factory's
harness, each step's metrics are split per harness (:mod:`harness_trainer.trainer.step.harness_metrics`),
and ``coverage.json`` counts tasks × harnesses, resumed from a checkpoint's state
(:mod:`harness_trainer.trainer.feed.coverage`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness_trainer.rollouts.client.contract import MixesHarnesses
from harness_trainer.rollouts.harness_mix import harness_mix
from harness_trainer.trace import load_trace
from harness_trainer.trainer.feed.coverage import COVERAGE_FILE, Coverage
from harness_trainer.trainer.feed.scheduling import RolloutScheduler, SchedulerConfig
from harness_trainer.trainer.step.groups import Group, Rollout
from harness_trainer.trainer.step.harness_metrics import harness_metrics, harness_names
from tests.trainer.handmade import HandmadeFactory, chain_trace
from tests.trainer.test_scheduling import make, take


@dataclass
class MixingFactory(HandmadeFactory):
    """Hand-made sessions, groups dealt round-robin to two harnesses."""

    def harness_for_group(self, group: int) -> str | None:
        return harness_mix(["toy", "mini-swe-agent"]).for_group(group)


def test_the_scheduler_tags_each_group_with_the_harness_its_factory_deals_it() -> None:
    factory = MixingFactory(num_tasks=2)
    assert isinstance(factory, MixesHarnesses) and not isinstance(HandmadeFactory(), MixesHarnesses)
    scheduler = make(factory, num_generations=2)
    try:
        groups = take(scheduler, 4)
    finally:
        scheduler.stop()
    assert [(g.index, g.harness) for g in groups] == [
        (0, "toy"), (1, "mini-swe-agent"), (2, "toy"), (3, "mini-swe-agent"),
    ]  # fmt: skip
    assert all(r.group == g.index for g in groups for r in g.rollouts)
    config = SchedulerConfig(num_generations=2, max_concurrent_rollouts=2, admission_limit=1,
                             rollout_timeout=30.0, seed=7, close_timeout_s=10.0)  # fmt: skip
    resumed = RolloutScheduler(factory, factory.prompt_rows(), config, start_group=3)
    resumed.start()
    try:  # a resumed run goes on with the schedule where it stopped
        assert [(g.index, g.harness) for g in take(resumed, 2)] == [(3, "mini-swe-agent"), (4, "toy")]
    finally:
        resumed.stop()
    single = make(HandmadeFactory(num_tasks=1), num_generations=2)
    try:
        assert take(single, 1)[0].harness is None  # one harness: nothing to split by
    finally:
        single.stop()


def group(index: int, harness: str | None, task: str, *rewards: float | None, failed: int = 0) -> Group:
    rollouts = []
    for member, reward in enumerate(rewards):
        rollout = Rollout(index, member, reward=reward)
        rollout.trace = load_trace(chain_trace(0, member, turns=member + 1))
        rollouts.append(rollout)
    rollouts += [Rollout(index, len(rewards) + m, unscorable="sandbox gone") for m in range(failed)]
    return Group(index, {"task_name": task, "task_index": 0}, index, rollouts, harness=harness)


def test_a_steps_metrics_are_split_per_harness_failures_and_traces_included() -> None:
    groups = [
        group(0, "toy", "a", 1.0, 0.0),
        group(1, "mini-swe-agent", "a", 1.0, 1.0, failed=1),
        group(2, "toy", "b", 0.0, 0.0),
    ]
    metrics = harness_metrics(groups)
    assert metrics["harness/toy/groups"] == 2 and metrics["harness/toy/rollouts"] == 4
    assert metrics["harness/toy/reward"] == 0.25
    assert metrics["harness/mini-swe-agent/reward"] == 1.0
    assert metrics["harness/mini-swe-agent/unscorable"] == 1 and metrics["harness/toy/unscorable"] == 0
    assert metrics["harness/toy/num_turns"] == 1.5  # members 0 and 1 have 1 and 2 turns
    assert metrics["harness/toy/completion_tokens"] == 4.5  # 3 ids a turn
    assert harness_names(metrics) == ["mini-swe-agent", "toy"]
    assert harness_metrics([group(0, None, "a", 1.0, 0.0)]) == {}  # a run of one harness: none
    # A harness whose every rollout failed logs its failures, and no reward it does not have.
    failed = harness_metrics([group(0, "codex", "a", failed=2)])
    assert failed["harness/codex/unscorable"] == 2 and "harness/codex/reward" not in failed


def test_coverage_counts_tasks_by_harness_and_continues_from_a_checkpoints_state(tmp_path: Path) -> None:
    coverage = Coverage()
    assert not coverage.add([group(0, None, "a", 1.0)]) and coverage.write(tmp_path) is None
    assert coverage.add([group(0, "toy", "a", 1.0, 0.0), group(1, "codex", "a", 1.0, failed=1)])
    assert coverage.add([group(2, "toy", "b", 1.0, None)])
    written = json.loads((coverage.write(tmp_path) or tmp_path).read_text())
    assert written == {
        "harnesses": ["codex", "toy"],
        "tasks": {
            "a": {
                "toy": {"groups": 1, "rollouts": 2, "scored": 2},
                "codex": {"groups": 1, "rollouts": 2, "scored": 1},
            },
            "b": {"toy": {"groups": 1, "rollouts": 2, "scored": 1}},
        },
    }
    resumed = Coverage(json.loads(json.dumps(coverage.state_dict())))  # through the checkpoint's JSON
    resumed.add([group(3, "codex", "b", 0.0, 0.0)])
    assert resumed.tasks["a"] == coverage.tasks["a"] and resumed.tasks["b"]["codex"]["groups"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [COVERAGE_FILE]  # no temporary file left
