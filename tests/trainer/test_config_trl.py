"""AsyncGRPOConfig speaks TRL: every field of TRL's config classes is supported, refused or ignored, by
name, and each supported one does here what it does in TRL."""

from __future__ import annotations

import dataclasses
import logging
import typing
import warnings

import pytest
import torch

from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.launch.config_file import ConfigFileError
from harness_trainer.launch.harbor_run import resolve
from harness_trainer.trainer import rollout_feed
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.config.loss import LossConfig
from harness_trainer.trainer.config.trl_fields import TRL_IGNORED, TRL_REFUSED, TRL_SUPPORTED
from harness_trainer.trainer.feed.rollout_log import read_rollout_log
from harness_trainer.trainer.step.batch import StepBatch
from harness_trainer.trainer.step.groups import Rollout
from harness_trainer.trainer.step.outcome import HarnessRolloutOutcome
from harness_trainer.trainer.step_groups import completions_text
from tests.trainer.handmade import HandmadeFactory
from tests.trainer.test_trainer import builder, config, metrics_lines

REFUSED = {name for _, accepted in TRL_REFUSED for name in accepted}
IGNORED = {name for _, names in TRL_IGNORED for name in names}


def trl_config_classes() -> list[type]:
    """TRL's async GRPO config where this TRL has one, and its GRPOConfig."""
    trl = pytest.importorskip("trl", reason="the TRL comparison needs trl (the 'trl' extra)")
    classes = []
    try:
        with warnings.catch_warnings():  # TRL warns that trl.experimental may change: that is what we check
            warnings.simplefilter("ignore")
            from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig as TrlAsyncGRPOConfig
    except ImportError:
        pass
    else:
        classes.append(TrlAsyncGRPOConfig)
    return [*classes, trl.GRPOConfig]


def trl_fields() -> dict[str, dataclasses.Field]:
    fields: dict[str, dataclasses.Field] = {}
    for cls in trl_config_classes():
        for f in dataclasses.fields(cls):
            fields.setdefault(f.name, f)
    return fields


def default_of(f: dataclasses.Field) -> typing.Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def other_value(f: dataclasses.Field) -> typing.Any:
    """A value of the field's type other than its default (MISSING where none is obvious)."""
    value = default_of(f)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1 if isinstance(value, int) else value + 0.5
    if isinstance(value, str):
        return value + "_x"
    if value is None:
        args = typing.get_args(f.type)
        for kind, chosen in ((bool, True), (int, 2), (float, 0.5), (str, "x")):
            if kind in args:
                return chosen
    return dataclasses.MISSING


# -- the tables ----------------------------------------------------------------------------------------


def test_every_trl_field_is_supported_refused_or_ignored():
    ours = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    ours |= {f"loss.{f.name}" for f in dataclasses.fields(LossConfig)}
    for cls in trl_config_classes():
        names = {f.name for f in dataclasses.fields(cls)}
        unclassified = sorted(names - set(TRL_SUPPORTED) - REFUSED - IGNORED)
        assert not unclassified, f"{cls.__module__}.{cls.__name__}: {unclassified}"
        assert not (names & ours) - set(TRL_SUPPORTED), "a field of ours with TRL's name is not in the table"
    assert not set(TRL_SUPPORTED) & REFUSED and not set(TRL_SUPPORTED) & IGNORED and not REFUSED & IGNORED
    assert set(TRL_SUPPORTED.values()) <= ours
    assert set(TRL_SUPPORTED) | REFUSED | IGNORED <= set(trl_fields()), "a name TRL no longer has"


def test_any_trl_field_with_any_value_is_taken_or_refused_naming_it(caplog):
    caplog.set_level(logging.ERROR)  # the ignored ones log a warning each
    wrong = []
    for name, f in trl_fields().items():
        for value in (default_of(f), other_value(f)):
            if value is dataclasses.MISSING:
                continue
            try:
                AsyncGRPOConfig(**{name: value})
            except ValueError as exc:
                if name not in str(exc):
                    wrong.append(f"{name}={value!r}: {exc}")
            except Exception as exc:
                wrong.append(f"{name}={value!r}: {type(exc).__name__}: {exc}")
    assert not wrong, "\n".join(wrong)


def test_a_name_trl_does_not_have_stays_a_type_error():
    with pytest.raises(TypeError):
        AsyncGRPOConfig(top_p_typo=1.0)


@pytest.mark.parametrize(
    ("name", "kept", "refused"),
    [
        ("top_p", 1.0, 0.9),
        ("top_k", 0, 50),
        ("top_k", -1, 1),
        ("min_p", None, 0.05),
        ("repetition_penalty", 1.0, 1.1),
    ],
)
def test_sampling_knobs_are_refused_unless_they_leave_plain_temperature_sampling(name, kept, refused):
    AsyncGRPOConfig(**{name: kept})
    with pytest.raises(
        ValueError, match=rf"{name}={refused!r} not supported: the policy stays plain temperature"
    ):
        AsyncGRPOConfig(**{name: refused})


def test_ignored_trl_fields_are_logged_with_their_reason_and_no_value(caplog):
    AsyncGRPOConfig(dataloader_num_workers=4, hub_always_push="always-push-value")
    assert "dataloader_num_workers accepted and ignored: there is no DataLoader" in caplog.text
    assert "hub_always_push accepted and ignored" in caplog.text and "always-push-value" not in caplog.text


def test_refusals_of_several_groups_come_in_one_message():
    with pytest.raises(ValueError) as raised:
        AsyncGRPOConfig(top_p=0.5, adam_beta1=0.8, load_best_model_at_end=True, num_generations=1)
    message = str(raised.value)
    for part in ("top_p=0.5", "adam_beta1=0.8", "load_best_model_at_end=True", "num_generations"):
        assert part in message


# -- each supported field ------------------------------------------------------------------------------


def test_per_device_batch_and_accumulation_give_the_groups_per_step(monkeypatch):
    c = AsyncGRPOConfig(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert (c.groups_per_step, c.rollouts_per_step) == (2, 8)
    assert AsyncGRPOConfig().groups_per_step == 1  # TRL's default batch (8) is one group of 8
    assert AsyncGRPOConfig(per_device_train_batch_size=8, groups_per_step=1).groups_per_step == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    two = AsyncGRPOConfig(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert two.groups_per_step == 4
    two.check_processes(2)
    with pytest.raises(ValueError, match="resolved into groups_per_step for 2 process"):
        two.check_processes(1)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"per_device_train_batch_size": 6},
            "= 6 rollouts per step must be a positive multiple of num_generations",
        ),
        ({"per_device_train_batch_size": 16, "groups_per_step": 1}, "gives 2 groups per step"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps counts only with per_device"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be at least 1"),
    ],
)
def test_a_batch_that_is_not_whole_groups_is_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        AsyncGRPOConfig(**settings)


def test_max_inflight_tasks_is_max_concurrent_rollouts():
    assert AsyncGRPOConfig().max_concurrent_rollouts == 8
    assert AsyncGRPOConfig(max_inflight_tasks=16).max_concurrent_rollouts == 16
    auto = AsyncGRPOConfig(max_inflight_tasks=-1, max_staleness=3, num_generations=4, groups_per_step=2)
    assert auto.max_concurrent_rollouts == 3 * 2 * 4  # TRL: max(max_staleness, 1) × samples per step
    assert AsyncGRPOConfig(max_inflight_tasks=-1, max_staleness=0).max_concurrent_rollouts == 8
    with pytest.raises(ValueError, match=r"max_inflight_tasks .* gives 16 but max_concurrent_rollouts is 4"):
        AsyncGRPOConfig(max_inflight_tasks=16, max_concurrent_rollouts=4)
    with pytest.raises(ValueError, match=r"max_concurrent_rollouts \+ 1 = 17"):
        AsyncGRPOConfig(max_inflight_tasks=16, server_capacity=16)


def test_max_steps_wins_over_num_train_epochs():
    by_epochs = AsyncGRPOConfig()
    assert (by_epochs.max_steps, by_epochs.num_train_epochs) == (-1, 3.0)  # TRL's defaults
    assert not by_epochs.steps_done(10**6)
    assert not by_epochs.epochs_done(8, num_rows=3) and by_epochs.epochs_done(9, num_rows=3)
    assert AsyncGRPOConfig(num_train_epochs=0.5).epochs_done(2, num_rows=3)  # ⌈1.5⌉ groups
    by_steps = AsyncGRPOConfig(max_steps=5, num_train_epochs=1.0)
    assert by_steps.steps_done(5) and not by_steps.steps_done(4)
    assert not by_steps.epochs_done(100, num_rows=3)
    with pytest.raises(ValueError, match="the run needs an end"):
        AsyncGRPOConfig(num_train_epochs=0)
    with pytest.raises(ValueError, match="'cosine' decays over max_steps"):
        AsyncGRPOConfig(lr_scheduler_type="cosine")
    AsyncGRPOConfig(lr_scheduler_type="cosine", max_steps=10)


def test_step_counts_below_one_are_fractions_of_max_steps():
    c = AsyncGRPOConfig(max_steps=20, logging_steps=0.25, save_steps=0.5, warmup_steps=0.1)
    assert (c.save_interval, c.warmup_step_count) == (10, 2)
    assert [step for step in range(1, 21) if c.should_log(step)] == [5, 10, 15, 20]
    first = AsyncGRPOConfig(logging_steps=3, logging_first_step=True)
    assert [step for step in range(1, 8) if first.should_log(step)] == [1, 3, 6]
    assert AsyncGRPOConfig(save_steps=0).save_interval == 0
    with pytest.raises(ValueError, match=r"logging_steps=0\.5 is a fraction of max_steps: set max_steps"):
        AsyncGRPOConfig(logging_steps=0.5)
    with pytest.raises(ValueError, match="save_steps must be a whole number"):
        AsyncGRPOConfig(save_steps=2.5)


def test_bf16_and_fp16_choose_accelerates_mixed_precision():
    assert AsyncGRPOConfig().mixed_precision is None  # the launcher's setting stands
    assert AsyncGRPOConfig(bf16=True).mixed_precision == "bf16"
    assert AsyncGRPOConfig(fp16=True).mixed_precision == "fp16"
    with pytest.raises(ValueError, match="bf16 and fp16 exclude each other"):
        AsyncGRPOConfig(bf16=True, fp16=True)


def test_push_to_hub_needs_a_valid_repository_named_by_hub_model_id_or_output_dir():
    assert AsyncGRPOConfig(push_to_hub=True, hub_model_id="org/model").hub_model_id == "org/model"
    AsyncGRPOConfig(push_to_hub=True, output_dir="runs/grpo-1")  # TRL: the repository 'grpo-1'
    with pytest.raises(ValueError, match=r"repository '' \(output_dir's folder name .* set hub_model_id"):
        AsyncGRPOConfig(push_to_hub=True, output_dir="/")
    with pytest.raises(ValueError, match=r"repository 'org/my model' \(hub_model_id\) is not a valid"):
        AsyncGRPOConfig(hub_model_id="org/my model")
    AsyncGRPOConfig(push_to_hub=True, hub_strategy="end")
    with pytest.raises(ValueError, match="hub_strategy='every_save' not supported: push_to_hub uploads"):
        AsyncGRPOConfig(push_to_hub=True, hub_strategy="every_save")


def test_hub_token_is_kept_out_of_the_repr_and_the_saved_config():
    c = AsyncGRPOConfig(push_to_hub=True, hub_token="hf_secret_token")
    assert c.hub_token == "hf_secret_token"
    assert "hf_secret_token" not in repr(c) and c.to_dict()["hub_token"] == "<HUB_TOKEN>"
    assert AsyncGRPOConfig().to_dict()["hub_token"] is None


def test_chat_template_kwargs_are_kept_and_said_not_to_reach_the_engine(caplog):
    c = AsyncGRPOConfig(chat_template_kwargs='{"enable_thinking": false}')
    assert c.chat_template_kwargs == {"enable_thinking": False}
    assert c.to_dict()["chat_template_kwargs"] == {"enable_thinking": False}
    assert "['enable_thinking'] do not reach the engine" in caplog.text


@pytest.mark.parametrize(
    ("report_to", "expected"),
    [(None, ["none"]), ("none", ["none"]), ("all", ["all"]), ("tensorboard,wandb", ["tensorboard", "wandb"])],
)
def test_report_to_takes_trls_forms(report_to, expected):
    assert AsyncGRPOConfig(report_to=report_to).report_to == expected


def test_trl_names_reach_the_config_from_python_and_a_config_files_trainer_section(tmp_path, caplog):
    c = AsyncGRPOConfig(
        num_generations=4, per_device_train_batch_size=8, max_inflight_tasks=12, top_p=1.0,
        dataloader_num_workers=2, bf16=True, chat_template_kwargs={},
    )  # fmt: skip
    assert (c.groups_per_step, c.max_concurrent_rollouts, c.bf16) == (2, 12, True)
    assert "dataloader_num_workers accepted and ignored" in caplog.text
    with pytest.raises(ValueError, match="top_k=40 not supported"):
        AsyncGRPOConfig(top_k=40)
    path = tmp_path / "run.yaml"
    path.write_text("run: {model: m}\ntrainer:\n  no_such_flag: 1\n")
    unknown = r"trainer\.no_such_flag: unknown key \(not an AsyncGRPOConfig field, nor TRL's\)"
    with pytest.raises(ConfigFileError, match=unknown):
        resolve(["--config", str(path)])
    path.write_text(
        "run: {model: m}\ntrainer: {max_inflight_tasks: 6, top_k: 0, num_train_epochs: 2, logging_steps: 5}\n"
    )
    c = resolve(["--config", str(path)])[1]
    assert (c.max_concurrent_rollouts, c.num_train_epochs, c.logging_steps) == (6, 2, 5)
    path.write_text("run: {model: m}\ntrainer: {learning_rate: 1.0e-5, not_a_field: 1}\n")
    with pytest.raises(ValueError, match="not_a_field"):
        resolve(["--config", str(path)])


def test_log_completions_text_shows_each_trained_rollout_up_to_the_limit():
    def rollout(member: int, reply: str) -> Rollout:
        outcome = HarnessRolloutOutcome(
            env_reward=1.0, completion=[{"role": "assistant", "content": reply}], trace=[], tool_call_count=0,
            tool_failure_count=0, tool_calls_by_name={}, timed_out=False,
        )  # fmt: skip
        return Rollout(group=3, member=member, reward=float(member), outcome=outcome)

    batch = StepBatch(rollouts=[rollout(0, "no"), rollout(1, "x" * 300)], advantages={0: -0.5, 1: 0.5})
    text = completions_text(batch, step=7, limit=None)
    assert text.splitlines()[0] == "step 7: 2 of 2 trained rollouts"
    assert "group 3 member 0: reward 0.0, advantage -0.500, reply 'no'" in text
    assert "'" + "x" * 200 + "'" in text and "x" * 201 not in text
    assert completions_text(batch, step=7, limit=1).count("\n") == 1


# -- in a run --------------------------------------------------------------------------------------------


def test_an_epoch_bound_run_takes_trls_batch_and_logging_fields(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    reporters = []

    class Recording(rollout_feed.MetricsReporter):
        def __init__(self, *args, **kwargs):
            reporters.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(rollout_feed, "MetricsReporter", Recording)
    factory = HandmadeFactory(num_tasks=3)
    args = config(
        tmp_path, max_steps=-1, num_train_epochs=2, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, logging_steps=2, logging_first_step=True, save_steps=1,
        save_total_limit=1, log_completions=True, num_completions_to_print=3, seed=7, project="trl-names",
        run_name="epochs",
    )  # fmt: skip
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), args)
    output = trainer.train()
    # 2 epochs of 3 rows = 6 groups, 2 per step (4 × 2 rollouts, groups of 4): 3 steps.
    assert output.global_step == 3 and trainer.trained_groups == list(range(6))
    steps = [record.step for record in read_rollout_log(tmp_path / "out") if record.advantage is not None]
    assert steps == [1] * 8 + [2] * 8 + [3] * 8
    assert [line["step"] for line in metrics_lines(tmp_path / "out")] == [1, 2]
    assert [p.name for p in (tmp_path / "out").glob("checkpoint-*")] == ["checkpoint-3"]
    printed = capsys.readouterr().out
    assert "step 1: 3 of 8 trained rollouts" in printed and "step 2: 3 of 8" in printed
    assert "step 3:" not in printed
    seeds = sorted({seed for _, seed, _ in factory.created})  # groups admitted past the end included
    assert seeds == list(range(7, 7 + len(seeds))) and len(seeds) >= 6
    assert torch.initial_seed() == 7
    assert reporters[0]["project"] == "trl-names" and reporters[0]["run_name"] == "epochs"


def test_bf16_trains_under_autocast_on_cpu(tmp_path, tiny_model_dir, fresh_accelerate):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    dtypes = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
    trainer = HarnessAsyncGRPOTrainer(
        model, builder(HandmadeFactory()), config(tmp_path, max_steps=1, bf16=True)
    )
    trainer.train()
    assert trainer.accelerator.mixed_precision == "bf16"
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert next(model.parameters()).dtype == torch.float32  # the weights stay in dtype
    assert trainer.last_metrics["loss"] == trainer.last_metrics["loss"]  # finite, not NaN


def test_a_run_after_another_accelerator_s_bf16_in_the_same_process_is_refused_not_run_under_it(
    tmp_path, tiny_model_dir, fresh_accelerate
):
    from accelerate import Accelerator

    Accelerator(mixed_precision="bf16")  # as TRL's SFTTrainer leaves the process (its bf16 default)
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(HandmadeFactory()), config(tmp_path, max_steps=1)
    )
    with pytest.raises(
        ValueError, match=r"already runs accelerate with mixed_precision='bf16'.*asks for 'no'"
    ):
        trainer.train()

    matching = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(HandmadeFactory()), config(tmp_path / "b", max_steps=1, bf16=True)
    )
    matching.train()
    assert matching.accelerator.mixed_precision == "bf16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_fp16_is_refused_at_setup_on_cpu(tmp_path, tiny_model_dir, fresh_accelerate):
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(HandmadeFactory()), config(tmp_path, max_steps=1, fp16=True)
    )
    with pytest.raises(ValueError, match="fp16=True needs a GPU"):
        trainer.train()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp16_trains_with_loss_scaling_on_a_gpu(tmp_path, tiny_model_dir, fresh_accelerate):
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(HandmadeFactory()), config(tmp_path, max_steps=3, fp16=True)
    )
    assert trainer.train().global_step == 3
    assert trainer.accelerator.scaler is not None and trainer.accelerator.scaler.get_scale() > 0
