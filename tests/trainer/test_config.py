"""AsyncGRPOConfig: defaults, refusals at construction, CLI flags and YAML."""

from __future__ import annotations

import pytest

from harness_trainer.trainer.config import AsyncGRPOConfig, parse_config


def test_defaults_are_a_valid_config_with_a_temperature_only_policy() -> None:
    config = AsyncGRPOConfig()
    assert config.sampling == {"temperature": 1.0}
    assert config.epsilon_high == config.epsilon
    assert config.admission_limit == (config.max_staleness + 1) * config.groups_per_step
    assert config.beta == 0.0 and config.importance_sampling == "truncate"
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
    config = parse_config([*flags.split(), "--model_init_kwargs", '{"attn_implementation": "eager"}'])
    assert config.num_generations == 4 and config.use_peft
    assert config.report_to == ["tensorboard"]
    assert config.model_init_kwargs == {"attn_implementation": "eager"}
    assert config.lora_target_modules == ["q_proj", "v_proj"]


def test_yaml_gives_the_same_fields(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("num_generations: 6\nmax_steps: 3\nreport_to: [tensorboard, wandb]\nbeta: 0.05\n")
    config = parse_config(yaml_file=str(path))
    assert (config.num_generations, config.max_steps, config.beta) == (6, 3, 0.05)
    assert config.report_to == ["tensorboard", "wandb"]


def test_yaml_with_a_bad_combination_is_refused(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("num_generations: 1\n")
    with pytest.raises(ValueError, match="num_generations"):
        parse_config(yaml_file=str(path))
