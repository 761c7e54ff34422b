"""``--config run.yaml``: defaults < file < flags given, every trainer field reachable, one error for every
problem of a file, the shipped configs, and the resolved config written beside the run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness_trainer.devloop.run import add_dev_arguments, build_dev_config
from harness_trainer.jobs.submit import add_submit_arguments
from harness_trainer.launch.config_file import (
    RESOLVED_FILE,
    ConfigFileError,
    apply_config,
    write_resolved,
)
from harness_trainer.launch.harbor_run import resolve
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.config.loss import LossConfig

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted([*ROOT.glob("examples/**/*.yaml"), *ROOT.glob("jobs/**/*.yaml")])


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def dev_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dev_arguments(parser)
    return apply_config(parser.parse_args(list(argv)))


def test_flags_given_win_over_the_file_which_wins_over_the_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "run": {"model": "org/m", "sandbox": "local", "agent_step_limit": 7},
            "trainer": {"max_steps": 3, "temperature": 0.5, "loss": {"beta": 0.1, "epsilon": 0.1}},
        },
    )
    args, config = resolve(
        ["--config", str(path), "--sandbox", "docker", "--temperature", "0.9", "--beta", "0"]
    )
    assert (args.model, args.sandbox, args.agent_step_limit, args.harness) == (
        "org/m",
        "docker",
        7,
        "opencode",
    )
    assert (config.max_steps, config.temperature) == (3, 0.9)
    assert (config.loss.beta, config.loss.epsilon) == (0.0, 0.1)
    assert config.output_dir == "outputs/async_grpo_harbor"  # the launcher's default, in neither
    # A flag given before --config wins all the same.
    _, config = resolve(["--max-steps", "9", "--config", str(path)])
    assert config.max_steps == 9


def test_the_dev_loop_layers_the_same_way(tmp_path: Path) -> None:
    path = write(tmp_path, {"dev": {"harness": "toy", "warmup": False}, "trainer": {"use_peft": True}})
    args = dev_args("--config", str(path), "--lora-r", "4")
    config = build_dev_config(args)
    assert (args.harness, args.warmup, args.split) == ("toy", False, "train")
    assert (config.use_peft, config.lora_r, config.lora_alpha, config.learning_rate) == (True, 4, 8, 1.0)
    assert config.loss.loss_normalization == "step" and config.temperature == 0.7  # the dev loop's defaults


def test_an_unknown_key_and_a_wrong_type_are_one_error_naming_the_file_and_each_key(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "run": {"model": "m", "agent_timeout_sec": "soon", "sandboxes": "e2b"},
            "trainer": {"num_generation": 4, "temperature": "hot", "loss": {"beta": [1], "is_mode": "mask"}},
            "serve": {},
        },
    )
    with pytest.raises(ConfigFileError) as raised:
        resolve(["--config", str(path)])
    problems = raised.value.problems
    keys = ["run.agent_timeout_sec", "run.sandboxes", "trainer.num_generation", "trainer.temperature",
            "trainer.loss.beta", "trainer.loss.is_mode", "serve"]  # fmt: skip
    assert len(problems) == len(keys)
    for key in keys:
        assert any(problem.startswith(f"{path}: {key}: ") for problem in problems), (key, problems)
    assert "trainer.temperature: expected float, got str 'hot'" in str(raised.value)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("run: [1, 2\n", "cannot read it as YAML"),
        ("- a list\n", "expected a mapping of sections"),
        ("trainer: {engine: dev}\nrun: {model: m}\n", "trainer.engine: set by run.engine here"),
        ("trainer: {max_steps: 3}\n", "run.model: required (or --model)"),
    ],
)
def test_a_file_that_cannot_work_is_refused_naming_it(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigFileError, match=re.escape(message)) as raised:
        resolve(["--config", str(path)])
    assert str(raised.value).startswith(f"{path}: ")


def test_the_launcher_prints_a_bad_file_as_one_line_and_exits_2(tmp_path: Path, capsys) -> None:
    from harness_trainer.launch.harbor_run import main

    path = write(tmp_path, {"run": {"model": "m"}, "trainer": {"num_generations": "8", "nope": 1}})
    assert main(["--config", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "trainer.num_generations: expected int" in line and "trainer.nope: unknown key" in line


def other_value(f: dataclasses.Field[Any], default: Any) -> Any:
    """A valid value of a trainer field other than its default, as a YAML file would hold it."""
    special = {
        "dtype": "bfloat16", "optim": "sgd", "lr_scheduler_type": "constant_with_warmup", "engine": "dev",
        "weight_sync": "file", "vllm_pause_mode": "keep", "lora_sync": "merged", "lora_save": "merged",
        "report_to": ["tensorboard"],
        "lora_target_modules": ["q_proj"], "model_init_kwargs": {"attn_implementation": "eager"},
        "chat_template_kwargs": {"enable_thinking": False}, "resume_from_checkpoint": "latest",
        "importance_sampling": "mask", "loss_normalization": "step", "epsilon": 0.1, "fp16": False,
        "push_to_hub": False, "hub_model_id": "org/model", "warmup_steps": 2, "save_steps": 5,
        "logging_steps": 2, "max_steps": 10, "num_train_epochs": 2.0, "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1, "groups_per_step": 2, "num_generations": 4, "server_capacity": 99,
        # The curriculum refuses dataset_shuffle (it chooses every row itself).
        "curriculum": "pass_rate", "curriculum_retire_threshold": 0.5, "dataset_shuffle": False,
        "eval_strategy": "steps", "eval_steps": 2,
        "kv_cache_low_water": 0.5, "kv_cache_high_water": 0.7,  # 0 < low <= high <= 1
        "vllm_replica_urls": ["http://replica:8000"], "replica_proxy_url": "http://proxy:8300",
    }  # fmt: skip
    if f.name in special:
        return special[f.name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float) and default is not None:
        return default + 1 if isinstance(default, int) else default * 2 + 0.5
    hint = str(f.type)
    for kind, value in (("bool", True), ("int", 3), ("float", 0.5), ("str", "x")):
        if kind in hint:
            return value
    raise AssertionError(f"no value for {f.name}: {f.type}")


def test_every_trainer_field_and_loss_knob_is_reachable_from_the_file(tmp_path: Path) -> None:
    owned = {"engine", "vllm_server_base_url", "rollout_timeout"}  # set through the run section
    trainer: dict[str, Any] = {"loss": {}}
    for f in dataclasses.fields(LossConfig):
        trainer["loss"][f.name] = other_value(f, getattr(LossConfig(), f.name))
    defaults = AsyncGRPOConfig()
    for f in dataclasses.fields(AsyncGRPOConfig):
        if f.name not in owned and f.name != "loss":
            trainer[f.name] = other_value(f, getattr(defaults, f.name))
    path = write(tmp_path, {"run": {"model": "m"}, "trainer": trainer})
    _, config = resolve(["--config", str(path)])
    for name, value in trainer["loss"].items():
        assert getattr(config.loss, name) == value, name
    for name, value in trainer.items():
        if name != "loss":
            assert getattr(config, name) == value, name
    assert owned == {f.name for f in dataclasses.fields(AsyncGRPOConfig)} - set(trainer)


def test_every_trainer_field_has_a_flag_that_wins_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, {"run": {"model": "m"}, "trainer": {"lora_r": 4, "loss": {"beta": 0.5}}})
    _, config = resolve(["--config", str(path), "--lora-r", "6", "--beta", "0.25", "--epsilon-high", "none"])
    assert (config.lora_r, config.loss.beta, config.loss.epsilon_high) == (6, 0.25, config.loss.epsilon)


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(ROOT)) for p in SHIPPED])
def test_every_shipped_config_parses_and_builds_the_trainer_config(path: Path) -> None:
    sections = yaml.safe_load(path.read_text())
    if "job" in sections:  # a jobs config: its job options, then the run it submits
        parser = argparse.ArgumentParser()
        add_submit_arguments(parser)
        args = apply_config(parser.parse_args(["--config", str(path)]))
        assert args.dataset and args.config_sections["run"]["model"]
        run = path.parent / "run-only.yaml"
        try:
            run.write_text(yaml.safe_dump(args.config_sections))
            _, config = resolve(["--config", str(run)])
        finally:
            run.unlink()
    else:
        _, config = resolve(["--config", str(path)])
    assert isinstance(config, AsyncGRPOConfig)
    assert config.output_dir == sections["trainer"]["output_dir"]


def test_shipped_configs_are_found() -> None:
    names = {str(path.relative_to(ROOT)) for path in SHIPPED}
    assert {"examples/async_grpo_harbor/config.yaml", "examples/jobs/config.yaml"} <= names


def test_jobs_submit_takes_the_job_section_and_sends_the_run_sections_to_the_job(tmp_path: Path) -> None:
    from harness_trainer.jobs.submit import RUN_CONFIG_MOUNT, with_run_config, write_run_config

    path = write(
        tmp_path,
        {
            "job": {"dataset": "org/tasks", "flavor": "a100-large"},
            "run": {"model": "m"},
            "trainer": {"seed": 3},
        },
    )
    parser = argparse.ArgumentParser()
    add_submit_arguments(parser)
    args = apply_config(parser.parse_args(["--config", str(path), "--timeout", "2h", "--", "--seed", "4"]))
    assert (args.dataset, args.flavor, args.timeout, args.trainer_args) == (
        "org/tasks",
        "a100-large",
        "2h",
        ["--seed", "4"],
    )
    sent = write_run_config(args.config_sections, tmp_path / "job")
    assert sent is not None and json.loads(sent.read_text()) == {
        "run": {"model": "m"},
        "trainer": {"seed": 3},
    }
    _, config = resolve(with_run_config(args.trainer_args, str(sent)))
    assert config.seed == 4  # the trainer arguments after -- win over the file
    assert with_run_config(["--seed", "4"], f"{RUN_CONFIG_MOUNT}/run.yaml")[:2] == [
        "--config",
        f"{RUN_CONFIG_MOUNT}/run.yaml",
    ]


def test_the_resolved_config_is_written_as_json_a_config_file_reads_back(tmp_path: Path) -> None:
    path = write(tmp_path, {"run": {"model": "m"}, "trainer": {"loss": {"beta": 0.1}, "hub_token": "hf_x"}})
    args, config = resolve(["--config", str(path), "--output-dir", str(tmp_path / "out")])
    written = write_resolved(config.output_dir, {"run": {"model": args.model}, "trainer": config.to_dict()})
    assert written == tmp_path / "out" / RESOLVED_FILE
    saved = json.loads(written.read_text())
    assert saved["trainer"]["loss"]["beta"] == 0.1 and saved["trainer"]["hub_token"] == "<HUB_TOKEN>"
    saved["trainer"].pop("hub_token")
    again = AsyncGRPOConfig(**saved["trainer"])
    assert again.loss == config.loss and again.to_dict() == {**config.to_dict(), "hub_token": None}


@pytest.mark.slow
def test_the_dev_loop_writes_the_resolved_config_once_its_engine_is_up(tmp_path: Path, monkeypatch) -> None:
    import harness_trainer.devloop.run as run

    class Reached(Exception):
        pass

    def stop_at_the_trainer(*args: Any, **kwargs: Any) -> None:
        raise Reached

    monkeypatch.setattr("harness_trainer.HarnessAsyncGRPOTrainer", stop_at_the_trainer)
    out = tmp_path / "run"
    args = dev_args("--harness", "toy", "--no-warmup", "--output-dir", str(out), "--beta", "0.02")
    with pytest.raises(Reached):
        run.run_dev_loop(run.options_from(args), build_dev_config(args), {"dev": {"harness": "toy"}})
    saved = json.loads((out / RESOLVED_FILE).read_text())
    assert saved["dev"] == {"harness": "toy"} and saved["trainer"]["loss"]["beta"] == 0.02
    assert saved["trainer"]["vllm_server_base_url"].startswith("http://127.0.0.1:")
    assert saved["trainer"]["engine"] == "dev" and saved["trainer"]["output_dir"] == str(out)
