"""AsyncGRPOConfig: defaults, refusals at construction, CLI flags and YAML."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import HfArgumentParser

from capture_proxy.sampling import SamplingPolicy
from harness_trainer.launch.harbor_run import resolve
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.config.loss import LossConfig
from harness_trainer.trainer.config.problems import ConfigProblems


def test_defaults_are_a_valid_config_with_a_temperature_only_policy() -> None:
    config = AsyncGRPOConfig()
    assert config.sampling == {"temperature": 1.0}
    assert config.loss.epsilon_high == config.loss.epsilon
    assert config.admission_limit == (config.max_staleness + 1) * config.groups_per_step
    assert config.loss.beta == 0.0 and config.loss.importance_sampling == "truncate"
    assert AsyncGRPOConfig(max_completion_length=64).sampling == {"temperature": 1.0, "max_tokens": 64}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_generations": 1}, "num_generations must be at least 2"),
        ({"server_capacity": 8, "max_concurrent_rollouts": 8}, "at least max_concurrent_rollouts + 1 = 9"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"temperature": 0.0}, "temperature"),
        ({"importance_sampling": "clip"}, "importance_sampling 'clip'"),
        ({"importance_sampling_cap": 1.0}, "importance_sampling_cap"),
        ({"report_to": "mlflow"}, "report_to ['mlflow']"),
        ({"engine": "dev", "vllm_server_base_url": None}, "needs vllm_server_base_url"),
        ({"engine": "sglang"}, "engine 'sglang'"),
        ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type"),
        ({"optim": "adafactor"}, "optim 'adafactor'"),
        ({"dtype": "float8"}, "dtype 'float8'"),
        ({"model_init_kwargs": "{not json"}, "model_init_kwargs is not JSON"),
    ],
)
def test_bad_combinations_are_refused_with_a_clear_message(overrides, message) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        AsyncGRPOConfig(**overrides)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ValueError) as raised:
        AsyncGRPOConfig(num_generations=1, beta=-1.0)
    assert "num_generations" in str(raised.value) and "beta" in str(raised.value)


def test_cli_flags_give_the_same_fields() -> None:
    flags = "--num_generations 4 --max_concurrent_rollouts 4 --report_to tensorboard --use_peft"
    flags += " --lora_target_modules q_proj v_proj --engine dev --vllm_server_base_url http://127.0.0.1:8000"
    argv = [*flags.split(), "--model_init_kwargs", '{"attn_implementation": "eager"}']
    (config,) = HfArgumentParser(AsyncGRPOConfig).parse_args_into_dataclasses(args=argv)  # as TRL's configs
    assert config.num_generations == 4 and config.use_peft
    assert config.report_to == ["tensorboard"]
    assert config.model_init_kwargs == {"attn_implementation": "eager"}
    assert config.lora_target_modules == ["q_proj", "v_proj"]


def test_yaml_gives_the_same_fields(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    trainer = "{num_generations: 6, max_steps: 3, report_to: [tensorboard, wandb], beta: 0.05}"
    path.write_text(f"run: {{model: m}}\ntrainer: {trainer}\n")
    config = resolve(["--config", str(path)])[1]  # a config file's trainer section
    assert (config.num_generations, config.max_steps, config.loss.beta) == (6, 3, 0.05)
    assert config.report_to == ["tensorboard", "wandb"]


def test_yaml_with_a_bad_combination_is_refused(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("run: {model: m}\ntrainer: {num_generations: 1}\n")
    with pytest.raises(ValueError, match="num_generations"):
        resolve(["--config", str(path)])


def test_the_loss_knobs_live_in_the_nested_loss_and_are_taken_flat_too() -> None:
    assert AsyncGRPOConfig(beta=0.04, loss_normalization="step").loss == LossConfig(
        beta=0.04, loss_normalization="step"
    )
    assert AsyncGRPOConfig(loss={"epsilon": 0.1}).loss.epsilon_high == 0.1  # a dict: YAML or JSON
    assert AsyncGRPOConfig(loss=LossConfig(beta=0.2), beta=0.3).loss.beta == 0.3  # flat over nested
    assert "beta" not in {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    with pytest.raises(ConfigProblems) as raised:
        AsyncGRPOConfig(num_generations=1, epsilon=1.5, loss_normalization="token")
    assert len(raised.value.problems) == 3 and "epsilon must be in [0, 1), got 1.5" in str(raised.value)
    with pytest.raises(ValueError, match="loss has no field is_mode"):
        AsyncGRPOConfig(loss={"is_mode": "mask"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"temperature": 0.0}, "temperature must be a finite positive number"),
        ({"temperature": 101.0}, "sampling policy: temperature Input should be less than or equal to 100"),
        ({"max_completion_length": 0}, "sampling policy: max_completion_length Input should be greater than"),
    ],
)
def test_a_sampling_policy_the_capture_proxy_refuses_is_refused_at_construction(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        AsyncGRPOConfig(**overrides)


def test_the_sampling_policy_is_the_capture_proxys_own_type() -> None:
    config = AsyncGRPOConfig(temperature=0.7, max_completion_length=256)
    assert config.sampling_policy == SamplingPolicy(temperature=0.7, max_tokens=256)
    assert SamplingPolicy(**config.sampling) == config.sampling_policy  # what the factories send
