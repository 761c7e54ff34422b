"""Evaluation during training: the pure scoring, and the trainer evaluating through an eval factory."""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.rollouts.client.servers import group_index
from harness_trainer.rollouts.client.session import VerifyResult
from harness_trainer.rollouts.harness_mix import HarnessMix, harness_mix
from harness_trainer.trace import TrainingTrace
from harness_trainer.trainer.feed.evaluation import (
    EVAL_ROLLOUTS_FILE,
    EVAL_SEED_OFFSET,
    HARNESS_PREFIX,
    Evaluator,
    TaskResult,
    harness_names,
    overlapping_tasks,
    pass_at_k,
    read_eval,
    read_eval_rollouts,
    summarize,
)
from tests.trainer.handmade import HandmadeFactory
from tests.trainer.test_trainer import config, metrics_lines


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [(4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 0, 4, 0.0), (4, 3, 2, 1.0), (1, 1, 1, 1.0), (2, 1, 5, 1.0)],
)
def test_pass_at_k_is_the_unbiased_estimate(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (2, 3, 1), (2, -1, 1), (2, 1, 0)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_unscorable_samples_are_left_out_of_the_pass_rates_and_counted():
    results = [
        TaskResult("a", 0, (1.0, 0.0, None), (None, None, "sandbox down")),
        TaskResult("b", 1, (0.0, 0.0, 0.0), (None, None, None)),
        TaskResult("c", 2, (None, None, None), ("x", "y", "z")),  # no scored sample: out of the means
    ]
    metrics = summarize(results, k=3, pass_reward=1.0)
    assert metrics["eval/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert metrics["eval/pass@k"] == pytest.approx((1.0 + 0.0) / 2)  # a: k capped at its 2 scored samples
    assert metrics["eval/reward"] == pytest.approx(1.0 / 5)
    assert metrics["eval/unscorable"] == 4
    assert metrics["eval/tasks"] == 3
    assert math.isnan(summarize([results[2]], k=1, pass_reward=1.0)["eval/pass@1"])


def test_pass_reward_sets_what_passes():
    result = [TaskResult("a", 0, (0.4, 0.6), (None, None))]
    assert summarize(result, k=1, pass_reward=0.5)["eval/pass@1"] == 0.5
    assert summarize(result, k=1, pass_reward=1.0)["eval/pass@1"] == 0.0


def test_overlapping_eval_tasks_are_named_by_instruction():
    train = [{"prompt": [{"role": "user", "content": "Do A "}], "task_name": "a"}, {"prompt": "Do B"}]
    held_out = [
        {
            "prompt": [{"role": "system", "content": "x"}, {"role": "user", "content": "Do A"}],
            "task_name": "a2",
        },
        {"prompt": "Do C", "task_name": "c"},
    ]
    assert overlapping_tasks(train, held_out) == ["a2"]
    assert overlapping_tasks(train, [{"prompt": "Do B"}]) == ["Do B"]


def split_builder(train: HandmadeFactory, held_out: HandmadeFactory, calls: list[dict]):
    """A factory builder with the trainer's keywords: split 'test' is the held-out factory."""

    def build(sampling=None, split=None):
        calls.append({"sampling": sampling, "split": split})
        factory = held_out if split == "test" else train
        factory.sampling = sampling
        return factory

    return build


def test_the_trainer_evaluates_on_start_and_every_eval_steps_at_the_weights_of_the_step(
    tmp_path, tiny_model_dir
):
    train = HandmadeFactory()
    # Task 0 passes on one of two samples, task 1 never: pass@1 0.25, pass@2 0.5 at every evaluation.
    held_out = HandmadeFactory(num_tasks=2, reward=lambda task, member: float(task == 0 and member % 2 == 1))
    calls: list[dict] = []
    args = config(
        tmp_path, max_steps=4, eval_steps=2, eval_on_start=True, eval_split="test", eval_num_generations=2,
        eval_temperature=0.5,
    )  # fmt: skip
    HarnessAsyncGRPOTrainer(str(tiny_model_dir), split_builder(train, held_out, calls), args).train()

    assert calls[0] == {"sampling": {"temperature": 1.0}, "split": None}
    assert calls[1] == {"sampling": {"temperature": 0.5}, "split": "test"}
    evals = read_eval(tmp_path / "out")
    assert [(e["step"], e["policy_version"], e["task_name"]) for e in evals] == [
        (step, step, name) for step in (0, 2, 4) for name in ("t0", "t1")
    ]
    assert evals[0]["rewards"] == [0.0, 1.0] and evals[0]["pass@1"] == 0.5 and evals[0]["pass@k"] == 1.0
    assert evals[1]["passed"] == 0 and evals[1]["k"] == 2 and evals[1]["temperature"] == 0.5
    lines = {line["step"]: line for line in metrics_lines(tmp_path / "out")}
    assert sorted(lines) == [0, 1, 2, 3, 4]
    assert set(lines[0]) == {"step", "time"} | {
        f"eval/{name}"
        for name in ("reward", "pass@1", "pass@k", "unscorable", "tasks", "policy_version", "wall_s")
    }
    for step in (0, 2, 4):
        assert lines[step]["eval/pass@1"] == 0.25 and lines[step]["eval/pass@k"] == 0.5
        assert lines[step]["eval/policy_version"] == step
    assert "eval/pass@1" not in lines[1] and "reward" in lines[2]
    # Every sample of every evaluation, with its trace: the one its session returned, validated as read.
    samples = read_eval_rollouts(tmp_path / "out")
    assert [(s.step, s.task_name, s.task_index, s.group) for s in samples] == [
        (step, f"t{task}", task, task) for step in (0, 2, 4) for task in (0, 1) for _ in range(2)
    ]
    for sample in samples:
        rewards = next(
            e["rewards"] for e in evals if (e["step"], e["task_index"]) == (sample.step, sample.task_index)
        )
        assert sample.reward == rewards[sample.member] and sample.unscorable is None
        assert sample.policy_version == sample.step and sample.advantage is None
        # The trace is the sample's own: its completion ids name the session that made it, whose reward it is.
        assert isinstance(sample.trace, TrainingTrace) and len(sample.trace.turns) == 2
        session_member = sample.trace.turns[0].completion_token_ids[0] - 100
        assert sample.reward == held_out.reward(sample.task_index, session_member)
    # Every evaluation rolls each task out with the same seeds; never the training groups' seeds.
    seeds = sorted({seed for _, seed, _ in held_out.created})
    assert seeds == [args.seed + EVAL_SEED_OFFSET, args.seed + EVAL_SEED_OFFSET + 1]
    assert len(held_out.created) == 3 * 2 * 2
    assert not held_out.live and held_out.closed == len(held_out.created) and held_out.factory_closed
    assert not train.live and train.closed == len(train.created)


def test_the_eval_dataset_is_evaluated_and_an_overlap_with_training_is_warned(
    tmp_path, caplog, tiny_model_dir
):
    train = HandmadeFactory()
    rows = train.prompt_rows()[:2]
    args = config(tmp_path, max_steps=1, eval_on_start=True, eval_num_generations=1)
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), split_builder(train, train, []), args, eval_dataset=rows
    )
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "2 eval task(s) have a training task's instruction" in caplog.text and "t0, t1" in caplog.text
    assert [e["task_name"] for e in read_eval(tmp_path / "out")] == ["t0", "t1"]


def test_an_unscorable_eval_sample_is_recorded_with_its_reason(tmp_path, tiny_model_dir):
    train = HandmadeFactory()
    held_out = HandmadeFactory(num_tasks=1, fail_start=lambda n: n == 0, reward=lambda task, member: 1.0)
    args = config(tmp_path, max_steps=1, eval_on_start=True, eval_split="test", eval_num_generations=2,
                  eval_temperature=0.7)  # fmt: skip
    HarnessAsyncGRPOTrainer(str(tiny_model_dir), split_builder(train, held_out, []), args).train()
    (record,) = read_eval(tmp_path / "out")
    assert record["rewards"].count(None) == 1 and record["rewards"].count(1.0) == 1
    assert [reason for reason in record["unscorable"] if reason] == [
        "RolloutUnscorable: sandbox 0 would not start"
    ]
    assert record["pass@1"] == 1.0
    samples = read_eval_rollouts(tmp_path / "out")
    assert [(s.step, s.task_name, s.reward, s.unscorable) for s in samples] == [
        (0, "t0", None if reason else 1.0, reason) for reason in record["unscorable"]
    ]
    (failed,) = [s for s in samples if s.unscorable]
    assert failed.trace is None
    line = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["eval/unscorable"] == 1


def test_a_stopped_evaluation_writes_neither_file(tmp_path):
    factory = HandmadeFactory(num_tasks=2, delay_s=0.2)
    evaluator = Evaluator(
        factory, factory.prompt_rows(), k=2, seed=0, temperature=1.0, pass_reward=1.0,
        max_concurrent_rollouts=4, rollout_timeout=None, vocab_size=None, reward_fn=None, output_dir=tmp_path,
        split="test",
    )  # fmt: skip
    stop = threading.Event()
    stop.set()
    assert evaluator.evaluate(step=3, policy_version=3, stop=stop) is None
    assert not (tmp_path / "eval.jsonl").exists() and not (tmp_path / EVAL_ROLLOUTS_FILE).exists()
    assert read_eval_rollouts(tmp_path) == []
    assert evaluator.evaluate(step=4, policy_version=4, stop=threading.Event()) is not None
    assert [(s.step, s.task_index, s.member) for s in read_eval_rollouts(tmp_path)] == [
        (4, task, member) for task in (0, 1) for member in (0, 1)
    ]


def test_eval_rollouts_skip_a_cut_short_last_line_and_name_a_bad_one(tmp_path):
    factory = HandmadeFactory(num_tasks=1)
    evaluator = Evaluator(
        factory, factory.prompt_rows(), k=1, seed=0, temperature=1.0, pass_reward=1.0,
        max_concurrent_rollouts=1, rollout_timeout=None, vocab_size=None, reward_fn=None, output_dir=tmp_path,
        split=None,
    )  # fmt: skip
    evaluator.evaluate(step=0, policy_version=0, stop=threading.Event())
    path = tmp_path / EVAL_ROLLOUTS_FILE
    with path.open("ab") as handle:
        handle.write(b'{"step": 1, "group": 0, "mem')
    assert [s.step for s in read_eval_rollouts(tmp_path, validate_traces=False)] == [0]
    sample = path.read_bytes().splitlines(keepends=True)[0]
    path.write_bytes(sample + b'{"step": 1}\n')
    with pytest.raises(ValueError, match=r"eval_rollouts\.jsonl:2: not a rollout record"):
        read_eval_rollouts(tmp_path)


@pytest.mark.parametrize("settings", [{"eval_steps": 2}, {"eval_on_start": True}])
def test_evaluation_with_nothing_to_evaluate_on_is_refused_at_construction(tmp_path, settings):
    with pytest.raises(ValueError, match=r"set eval_split .* or pass eval_dataset"):
        HarnessAsyncGRPOTrainer("unused", lambda **kw: HandmadeFactory(), config(tmp_path, **settings))


def test_eval_settings_are_checked_and_take_trls_names(tmp_path):
    with pytest.raises(ValueError, match="eval_strategy 'epoch' is not one of"):
        config(tmp_path, eval_strategy="epoch")
    with pytest.raises(ValueError, match="eval_steps=3 with eval_strategy 'no'"):
        config(tmp_path, eval_strategy="no", eval_steps=3)
    with pytest.raises(ValueError, match="eval_num_generations must be at least 1"):
        config(tmp_path, eval_num_generations=0)
    with pytest.raises(ValueError, match="eval_temperature must be"):
        config(tmp_path, eval_temperature=-1.0)
    assert config(tmp_path, num_generations_eval=3).eval_num_generations == 3
    steps = config(tmp_path, eval_strategy="steps", logging_steps=2, max_steps=6)
    assert steps.eval_steps == 2 and [s for s in range(1, 7) if steps.should_evaluate(s)] == [2, 4, 6]
    fraction = config(tmp_path, eval_steps=0.5, max_steps=6)
    assert [s for s in range(1, 7) if fraction.should_evaluate(s)] == [3, 6]
    assert not config(tmp_path).evaluates


@pytest.mark.parametrize("k", [1, 3])
def test_each_evaluation_is_one_info_line_naming_pass_at_1_and_pass_at_k(tmp_path, caplog, k):
    caplog.set_level(logging.INFO, logger="harness_trainer.trainer.feed.evaluation")
    factory = HandmadeFactory(num_tasks=2)
    evaluator = Evaluator(
        factory, factory.prompt_rows(), k=k, seed=0, temperature=1.0, pass_reward=1.0,
        max_concurrent_rollouts=2, rollout_timeout=None, vocab_size=None, reward_fn=None, output_dir=tmp_path,
        split="test",
    )  # fmt: skip
    evaluator.evaluate(step=5, policy_version=5, stop=threading.Event())
    (record,) = [r for r in caplog.records if r.message.startswith("eval at step 5")]
    assert record.levelno == logging.INFO
    assert record.message.count("pass@") == (2 if k > 1 else 1)  # with k = 1, pass@k is pass@1: said once
    assert record.message.count("pass@1 ") == 1 and f"pass@{k} " in record.message
    assert f"over 2 tasks of split 'test', {k} sample" in record.message


MIX = ("toy", "mini-swe-agent")
EVAL_LINE_KEYS = {
    "step", "policy_version", "split", "task_name", "task_index", "k", "temperature", "rewards", "unscorable",
    "passed", "pass@1", "pass@k",
}  # fmt: skip
"""An ``eval.jsonl`` line's keys in a run of one harness, as before runs could mix harnesses."""


@dataclass
class MixedFactory(HandmadeFactory):
    """A hand-made factory of two harnesses that runs the one ``create`` is asked for: the toy agent's
    samples all pass, mini-swe-agent's every other one (member 1 of each task)."""

    harness_mix: HarnessMix = field(default_factory=lambda: harness_mix(list(MIX)))
    ran: list[tuple[int, str, int | None, str | None]] = field(default_factory=list)

    def create(self, task: Any, seed=None, episode_id=None, *, harness: str | None = None) -> Any:
        chosen = self.harness_mix.chosen(harness, group_index(episode_id))
        session = super().create(task, seed, episode_id)
        with self.lock:
            self.ran.append((session.task, chosen, seed, episode_id))
        reward = 1.0 if chosen == "toy" else float(session.member % 2)
        session.verify = lambda *args, **kwargs: VerifyResult(env_reward=reward)
        return session


def mixed_evaluator(factory: HandmadeFactory, tmp_path, k: int = 2) -> Evaluator:
    return Evaluator(
        factory, factory.prompt_rows(), k=k, seed=0, temperature=1.0, pass_reward=1.0,
        max_concurrent_rollouts=3, rollout_timeout=None, vocab_size=None, reward_fn=None, output_dir=tmp_path,
        split="test",
    )  # fmt: skip


def test_in_a_mix_every_eval_task_is_rolled_out_k_times_under_every_harness_and_scored_per_harness(tmp_path):
    factory = MixedFactory(num_tasks=2)
    metrics, records = mixed_evaluator(factory, tmp_path).evaluate(1, 1, threading.Event())

    # k samples of each task under each harness, each run on the harness it was asked for.
    assert Counter((task, harness) for task, harness, _, _ in factory.ran) == {
        (task, harness): 2 for task in (0, 1) for harness in MIX
    }
    lines = read_eval(tmp_path)
    assert [(line["task_name"], line["harness"]) for line in lines] == [
        (f"t{task}", harness) for harness in MIX for task in (0, 1)
    ]
    assert [record.line() for record in records] == lines
    samples = read_eval_rollouts(tmp_path)
    ran = {episode: harness for _, harness, _, episode in factory.ran}
    assert all(s.harness == ran[s.rollout_id] for s in samples) and len(samples) == 8
    for line in lines:
        mine = [s for s in samples if (s.task_name, s.harness) == (line["task_name"], line["harness"])]
        assert sorted(s.member for s in mine) == [0, 1]
        assert line["rewards"] == [s.reward for s in sorted(mine, key=lambda s: s.member)]

    # Each harness's numbers from its own samples; the overall ones over every (task, harness).
    assert metrics[f"{HARNESS_PREFIX}toy/pass@1"] == 1.0 and metrics[f"{HARNESS_PREFIX}toy/pass@k"] == 1.0
    assert metrics[f"{HARNESS_PREFIX}mini-swe-agent/pass@1"] == 0.5
    assert metrics[f"{HARNESS_PREFIX}mini-swe-agent/pass@k"] == 1.0
    assert metrics[f"{HARNESS_PREFIX}mini-swe-agent/reward"] == 0.5
    assert metrics[f"{HARNESS_PREFIX}toy/tasks"] == metrics["eval/tasks"] == 2
    assert metrics["eval/pass@1"] == 0.75 and metrics["eval/pass@k"] == 1.0 and metrics["eval/reward"] == 0.75
    assert harness_names(metrics) == sorted(MIX)


def test_a_run_of_one_harness_writes_its_evaluation_as_before(tmp_path):
    factory = HandmadeFactory(num_tasks=2)
    metrics, _ = mixed_evaluator(factory, tmp_path).evaluate(1, 1, threading.Event())
    assert [set(line) for line in read_eval(tmp_path)] == [EVAL_LINE_KEYS] * 2
    assert set(metrics) == {
        f"eval/{name}" for name in ("reward", "pass@1", "pass@k", "unscorable", "tasks", "policy_version",
                                    "wall_s")
    }  # fmt: skip
    assert all(s.harness is None for s in read_eval_rollouts(tmp_path))
    assert len(factory.created) == 2 * 2


def test_the_trainer_logs_each_harnesses_eval_metrics_and_says_them_in_its_eval_line(
    tmp_path, tiny_model_dir, caplog
):
    caplog.set_level(logging.INFO, logger="harness_trainer.trainer.feed.evaluation")
    held_out = MixedFactory(num_tasks=2)
    args = config(tmp_path, max_steps=1, eval_on_start=True, eval_split="test", eval_num_generations=2)
    HarnessAsyncGRPOTrainer(str(tiny_model_dir), split_builder(HandmadeFactory(), held_out, []), args).train()
    (line,) = [line for line in metrics_lines(tmp_path / "out") if line["step"] == 0]
    assert {key for key in line if key.startswith(HARNESS_PREFIX)} == {
        f"{HARNESS_PREFIX}{harness}/{name}"
        for harness in MIX
        for name in ("reward", "pass@1", "pass@k", "unscorable", "tasks")
    }
    assert line[f"{HARNESS_PREFIX}toy/pass@1"] == 1.0
    assert line[f"{HARNESS_PREFIX}mini-swe-agent/pass@1"] == 0.5
    (said,) = [r.message for r in caplog.records if r.message.startswith("eval at step 0")]
    assert "pass@1 0.750, pass@2 1.000 over 2 tasks of split 'test' under each of 2 harnesses" in said
    assert said.endswith("; mini-swe-agent: pass@1 0.500, pass@2 1.000; toy: pass@1 1.000, pass@2 1.000")
