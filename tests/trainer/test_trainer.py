"""HarnessAsyncGRPOTrainer end to end on CPU with the tiny model and hand-made sessions."""

from __future__ import annotations

import json
import math
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from harness_trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer
from harness_trainer.trace import CaptureContractError
from harness_trainer.trainer.publish import WeightSyncError
from harness_trainer.trainer.step.outcome import RewardFunctionError
from tests.trainer.handmade import HandmadeFactory, chain_trace


def config(tmp_path: Path, **overrides) -> AsyncGRPOConfig:
    settings = dict(
        output_dir=str(tmp_path / "out"), engine="none", num_generations=4, max_concurrent_rollouts=4,
        max_steps=3, learning_rate=1e-3, disable_tqdm=True, seed=0, token_budget=64,
    )  # fmt: skip
    settings.update(overrides)
    return AsyncGRPOConfig(**settings)


def builder(factory: HandmadeFactory):
    def build(sampling=None):
        factory.sampling = sampling
        return factory

    return build


def metrics_lines(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_short_run_trains_logs_checkpoints_and_closes_every_session(tmp_path, tiny_model_dir):
    factory = HandmadeFactory()
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(factory), config(tmp_path, save_steps=2, temperature=0.7)
    )
    before = {
        n: p.detach().clone()
        for n, p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters()
    }
    output = trainer.train()
    assert output.global_step == 3
    assert factory.sampling == {"temperature": 0.7}
    assert not factory.live and factory.closed == len(factory.created) and factory.factory_closed
    lines = metrics_lines(tmp_path / "out")
    assert [line["step"] for line in lines] == [1, 2, 3]
    expected = (
        "reward", "reward_std", "loss", "entropy", "clip_ratio", "is/ratio_mean", "is/capped_frac",
        "tools/call_frequency", "completions/mean_length", "rows/per_rollout", "staleness/mean",
        "rollout/unscorable", "rollout/timed_out_frac", "perf/step_s", "perf/tokens_per_s",
    )  # fmt: skip
    for key in expected:
        assert key in lines[0], key
    assert lines[0]["reward"] == pytest.approx(0.5)
    assert lines[0]["tools/call_frequency"] == pytest.approx(2.0)
    assert lines[0]["rows/per_rollout"] == 1.0
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed


def trained_weights(trainer: HarnessAsyncGRPOTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_resume_continues_exactly_where_a_stopped_run_left(tmp_path, tiny_model_dir):
    straight = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(HandmadeFactory()), config(tmp_path / "a", max_steps=6)
    )
    straight.train()
    first = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(HandmadeFactory()), config(tmp_path / "b", max_steps=4)
    )
    first.train()
    resumed = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir),
        builder(HandmadeFactory()),
        config(tmp_path / "b", max_steps=6, resume_from_checkpoint="latest"),
    )
    resumed.train()
    assert straight.trained_groups == list(range(6))
    assert first.trained_groups + resumed.trained_groups == list(range(6))
    a, b = trained_weights(straight), trained_weights(resumed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)
    assert resumed.state.step == 6
    # The run's record reads as the straight run's: what the first run rolled out past its last checkpoint
    # (groups 4 and on, admitted but never taken) is superseded by what the resumed run did with them.
    from harness_trainer.trainer.feed.rollout_log import read_rollout_log

    def taken(run: Path) -> list[tuple]:
        records = read_rollout_log(run / "out")
        return [(r.step, r.group, r.member, r.reward, r.advantage) for r in records if r.step is not None]

    assert taken(tmp_path / "a") == taken(tmp_path / "b") and len(taken(tmp_path / "a")) == 6 * 4
    records = read_rollout_log(tmp_path / "b" / "out")
    assert all(r.group >= 6 for r in records if r.step is None)
    assert len({(r.group, r.member) for r in records}) == len(records)


def completion_logprob(model, prompt: list[int], completion: list[int]) -> list[float]:
    """Per-token logprobs of ``completion`` after ``prompt`` at temperature 1."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float().log_softmax(-1)
    picked = logits.gather(-1, ids[0, 1:, None])[:, 0]
    return picked[len(prompt) - 1 :].tolist()


def test_parameters_move_the_way_the_advantages_ask(tmp_path, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    def on_policy(task: int, member: int) -> dict:
        # Behaviour logprobs are the model's own, as an engine serving these weights would report them.
        trace = chain_trace(task, member, turns=1)
        turn = trace["turns"][0]
        turn["per_token_logps"] = completion_logprob(
            model, turn["prompt_token_ids"], turn["completion_token_ids"]
        )
        return trace

    factory = HandmadeFactory(num_tasks=1, reward=lambda task, member: float(member == 1), trace=on_policy)
    prompt, good, bad = [10, 11, 12], [101, 200, 301], [100, 200, 300]
    before = completion_logprob(model, prompt, good)[0], completion_logprob(model, prompt, bad)[0]
    trainer = HarnessAsyncGRPOTrainer(
        model, builder(factory), config(tmp_path, num_generations=2, max_steps=1, learning_rate=1e-4)
    )
    trainer.train()
    after = completion_logprob(model, prompt, good)[0], completion_logprob(model, prompt, bad)[0]
    assert after[0] > before[0] and after[1] < before[1]


def test_a_reward_function_that_raises_makes_rollouts_unscorable_and_counts_them(
    tmp_path, tiny_model_dir, caplog
):
    def flaky(outcome):
        if outcome.env_reward == 0.0 and outcome.trace[0]["completion_token_ids"][0] == 102:
            raise ValueError("flaky reward")
        return outcome.env_reward

    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir),
        builder(HandmadeFactory()),
        config(tmp_path, max_steps=2, max_unexpected_errors=100),
        rollout_reward_fn=flaky,
    )
    trainer.train()
    lines = metrics_lines(tmp_path / "out")
    assert all(line["rollout/unscorable"] == 1 for line in lines)
    assert lines[-1]["rollout/unscorable_total"] == 2
    assert "rewards/flaky" in lines[0]
    assert sum("Traceback" in record.getMessage() for record in caplog.records) == 1


def test_a_nan_reward_stops_training_with_an_error_naming_the_function(tmp_path, tiny_model_dir):
    factory = HandmadeFactory()

    def nan_reward(outcome):
        return math.nan

    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(factory), config(tmp_path), rollout_reward_fn=nan_reward
    )
    with pytest.raises(RewardFunctionError, match="nan_reward"):
        trainer.train()
    assert not factory.live and factory.factory_closed


def test_a_malformed_capture_stops_training_after_closing_every_session(tmp_path, tiny_model_dir):
    factory = HandmadeFactory(malformed=lambda n: n == 6, hang=lambda n: n > 6)
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), config(tmp_path, max_steps=5))
    with pytest.raises(CaptureContractError, match="hand-6"):
        trainer.train()
    assert not factory.live and factory.closed == len(factory.created)


@pytest.mark.slow
def test_an_engine_that_is_down_at_a_weight_push_stops_the_run_with_a_checkpoint(tmp_path, tiny_model_dir):
    from harness_trainer.net import free_port

    factory = HandmadeFactory()
    settings = config(
        tmp_path, engine="dev", vllm_server_base_url=f"http://127.0.0.1:{free_port()}", weight_sync_retries=2
    )
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), settings)
    with pytest.raises(WeightSyncError, match="checkpoint of step 1"):
        trainer.train()
    assert (tmp_path / "out" / "checkpoint-1" / "trainer_state.json").exists()
    assert not factory.live


def test_a_stop_in_the_middle_of_a_group_closes_everything_and_keeps_the_last_step(tmp_path, tiny_model_dir):
    factory = HandmadeFactory(hang=lambda n: n >= 10)
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), config(tmp_path, max_steps=50))
    runner = threading.Thread(target=trainer.train)
    runner.start()
    deadline = time.monotonic() + 120
    while not (trainer.state.step >= 2 and len(factory.live) >= 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    trainer.stop()
    runner.join(60)
    assert not runner.is_alive()
    assert trainer.state.step == 2
    assert not factory.live and factory.closed == len(factory.created)
    assert (tmp_path / "out" / "checkpoint-2").exists()


def test_sessions_from_openenv_models_are_accepted(tmp_path, tiny_model_dir):
    pytest.importorskip("openenv")
    factory = HandmadeFactory(openenv=True)
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), config(tmp_path, max_steps=1))
    trainer.train()
    assert metrics_lines(tmp_path / "out")[0]["reward"] == pytest.approx(0.5)


def test_lora_with_a_kl_term_trains_only_the_adapter(tmp_path, tiny_model_dir):
    pytest.importorskip("peft")
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir),
        builder(HandmadeFactory()),
        config(tmp_path, use_peft=True, beta=0.1, max_steps=2),
    )
    trainer.train()
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    saved = {p.name for p in (tmp_path / "out" / "checkpoint-2" / "model").iterdir()}
    assert "adapter_model.safetensors" in saved
    assert metrics_lines(tmp_path / "out")[-1]["kl"] >= 0.0


def test_partial_factory_builders_get_the_trainers_sampling_policy(tmp_path, tiny_model_dir):
    made = {}

    def make_factory(label, *, sampling):
        made.update(label=label, sampling=sampling)
        return HandmadeFactory(sampling=sampling)

    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), partial(make_factory, "x"), config(tmp_path, max_steps=1, temperature=0.9)
    )
    trainer.train()
    assert made == {"label": "x", "sampling": {"temperature": 0.9}}


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_closes_every_session_then_resume_continues(tmp_path, tiny_model_dir):
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.trainer.sigterm_run", str(tiny_model_dir), str(out)],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        time.sleep(1.0)  # the third group's sessions are hanging now
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert process.wait(timeout=60) == 0
        assert time.monotonic() - started < 30
    finally:
        if process.poll() is None:
            process.kill()
    summary = json.loads((out / "sessions.json").read_text())
    assert summary["step"] == 2
    assert summary["live"] == 0 and summary["closed"] == summary["created"] and summary["factory_closed"]
    assert (out / f"checkpoint-{summary['step']}" / "trainer_state.json").exists()
    resumed = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir),
        builder(HandmadeFactory()),
        config(tmp_path, max_steps=summary["step"] + 1, resume_from_checkpoint="latest"),
    )
    resumed.train()
    assert resumed.trained_groups == [summary["step"]]


def test_a_trace_with_an_out_of_vocabulary_id_stops_training_naming_it(tmp_path, tiny_model_dir):
    def too_big(task: int, member: int) -> dict:
        trace = chain_trace(task, member)
        trace["turns"][1]["completion_token_ids"][1] = 999_999
        return trace

    factory = HandmadeFactory(trace=too_big)
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), config(tmp_path))
    with pytest.raises(CaptureContractError, match="999999") as raised:
        trainer.train()
    assert raised.value.rules == ["out_of_vocabulary"] and raised.value.node_id == "n1"
    assert not factory.live and factory.factory_closed


def test_a_trace_sampled_at_another_temperature_stops_training_naming_both(tmp_path, tiny_model_dir):
    def sampled_at_half(task: int, member: int) -> dict:
        trace = chain_trace(task, member)
        for turn in trace["turns"]:
            turn["metadata"] = {"sampling": {"temperature": 0.5}}
        return trace

    factory = HandmadeFactory(trace=sampled_at_half)
    settings = config(tmp_path, temperature=1.0)
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), settings)
    with pytest.raises(CaptureContractError, match=r"temperature 0\.5 .* temperature 1\.0") as raised:
        trainer.train()
    assert raised.value.rules == ["temperature_mismatch"] and raised.value.node_id == "n0"
    assert not factory.live and factory.factory_closed


def test_metrics_reach_tensorboard_through_report_to(tmp_path, tiny_model_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir),
        builder(HandmadeFactory()),
        config(tmp_path, max_steps=2, report_to="tensorboard"),
    )
    trainer.train()
    (run,) = (tmp_path / "out" / "runs").iterdir()
    events = EventAccumulator(str(run))
    events.Reload()
    assert [event.step for event in events.Scalars("reward")] == [1, 2]


def test_every_rollout_of_every_step_goes_to_the_rollout_log(tmp_path, tiny_model_dir):
    from harness_trainer.trainer.feed.rollout_log import read_rollout_log
    from harness_trainer.trainer.feed.rollout_records import FEW_SCORED, NOT_TAKEN, UNSCORABLE

    factory = HandmadeFactory(fail_start=lambda n: n in (0, 1, 2))  # the first group is dropped
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), config(tmp_path, max_steps=2))
    trainer.train()
    records = read_rollout_log(tmp_path / "out")
    taken = [r for r in records if r.step is not None]
    assert [(r.step, r.group) for r in taken] == [(1, 0)] * 4 + [(1, 1)] * 4 + [(2, 2)] * 4
    assert [r.not_trained for r in taken[:4]] == [UNSCORABLE] * 3 + [FEW_SCORED]
    assert [r.unscorable is not None for r in taken[:4]] == [True, True, True, False]
    trained = [r for r in records if r.advantage is not None]
    assert len(trained) == 8 and all(r.trace is not None and r.not_trained is None for r in trained)
    # The groups admitted past the last step are kept too: no step took them.
    never = records[len(taken) :]
    assert never and all(r.step is None and r.not_trained == NOT_TAKEN and r.group > 2 for r in never)
    # Every session made is on record, failed starts included (and rollouts stopped before making one).
    assert {r.rollout_id for r in records} >= {episode for _, _, episode in factory.created}


def test_the_run_record_has_each_rollout_as_it_finished_why_it_did_not_train_and_its_time_split(
    tmp_path, tiny_model_dir
):
    from harness_trainer.trainer.feed.rollout_log import ROLLOUTS_FILE, read_rollout_log
    from harness_trainer.trainer.feed.rollout_records import UNSCORABLE

    def timed(task: int, member: int) -> dict:
        trace = chain_trace(task, member)
        for i, turn in enumerate(trace["turns"]):  # two calls of 0.5 s, 1 s apart, as the proxy stamps them
            turn["metadata"] = {"started_at": 1000.0 + i, "finished_at": 1000.5 + i, "dispatch_version": 0}
        return trace

    written: list[bool] = []
    factory = HandmadeFactory(fail_start=lambda n: n == 5, trace=timed, delay_s=0.05)
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(factory), config(tmp_path, max_steps=1, rollout_log_steps=2)
    )
    original = trainer._log_rollout

    def spy(group, rollout):
        original(group, rollout)
        # On disk as soon as it finished, before the trainer could take its group.
        head = f'{{"step":null,"group":{group.index},"member":{rollout.member},'.encode()
        on_disk = head in (tmp_path / "out" / ROLLOUTS_FILE).read_bytes()
        written.append(on_disk and trainer.scheduler.next_to_take <= group.index)

    trainer._log_rollout = spy
    trainer.train()

    lines = [json.loads(line) for line in (tmp_path / "out" / ROLLOUTS_FILE).read_text().splitlines()]
    assert lines[0] == {"kind": "start", "step": 0, "start_group": 0}
    assert len(written) >= len(factory.created) and all(written)  # stopped before a session: no create
    outcomes = [line for line in lines if line.get("kind") == "outcome"]
    assert [(o["step"], o["group"]) for o in outcomes] == [(1, 0)] * 4  # one step of one group of 4

    records = read_rollout_log(tmp_path / "out")
    first, rest = records[:4], records[4:]
    assert [(r.step, r.group) for r in first] == [(1, 0)] * 4
    assert all(r.advantage is not None for r in first)
    # Session 5 (group 1, member 1) failed to start: unscorable, its reason kept; group 1 was never taken.
    failed = next(r for r in rest if r.unscorable is not None and "would not start" in r.unscorable)
    assert (failed.group, failed.step, failed.trace, failed.llm_s) == (1, None, None, 0.0)
    assert all(r.step is None and r.not_trained for r in rest)
    assert UNSCORABLE not in {r.not_trained for r in rest}  # untaken: the reason is that no step took it
    # rollout_log_steps=2: group 0 would train at step 1, so its traces are left out; group 1's are kept.
    assert all(not r.trace_logged and r.trace is None for r in first)
    assert all(r.trace is not None for r in rest if r.group == 1 and r.unscorable is None)
    # The time split: 1 s of model calls, no environment phases reported, the rest other.
    assert all(r.llm_s == pytest.approx(1.0) and r.env_s == 0.0 for r in first)
    assert all(r.other_s == pytest.approx(max(0.0, r.seconds - 1.0)) for r in first)
    assert all((r.dispatch_version_min, r.dispatch_version_max) == (0, 0) for r in first)
    (line,) = metrics_lines(tmp_path / "out")
    assert line["perf/rollout_llm_s"] == pytest.approx(1.0) and line["perf/rollout_env_s"] == 0.0
    assert line["perf/rollout_other_s"] == pytest.approx(sum(r.other_s for r in first) / 4)


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_no_trained_rollout_lags_more_than_max_staleness_versions(tmp_path, tiny_model_dir, max_staleness):
    # Rollouts start the moment a place frees; were it freed at the take, the next group would sample on
    # the weights the taken one is trained from, and lag max_staleness + 1 versions when trained.
    factory = HandmadeFactory()
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(factory),
        config(tmp_path, max_staleness=max_staleness, max_steps=4, max_concurrent_rollouts=8),
    )  # fmt: skip
    trainer.train()
    lines = metrics_lines(tmp_path / "out")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert max(line["staleness/max"] for line in lines) <= max_staleness
    if max_staleness:  # asynchrony is used: later groups did sample while a step trained
        assert max(line["staleness/max"] for line in lines) == max_staleness
    assert not factory.live and factory.closed == len(factory.created)
