"""One home per run knob: :class:`RunOptions` is checked once, generates the flags and config keys of
``train``, ``dev`` and ``eval``, gives the factories their defaults, and the trainer's wait on a rollout
is derived from the one agent timeout, ``agent_timeout_sec``."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from harness_trainer.devloop.evaluate import add_eval_arguments
from harness_trainer.devloop.run import RUN_EXCLUDED, add_dev_arguments, build_dev_config, options_from
from harness_trainer.launch.config_file import ConfigFileError, apply_config, run_options_from
from harness_trainer.launch.harbor_run import build_config, build_parser, resolve
from harness_trainer.rollouts.client.factory import HarborSessionFactory
from harness_trainer.rollouts.client.local_factory import LocalSessionFactory
from harness_trainer.rollouts.client.local_whitebox import LocalWhiteBoxSessionFactory
from harness_trainer.rollouts.client.whitebox_session import WhiteBoxSession, WhiteBoxSessionFactory
from harness_trainer.rollouts.run_options import DEFAULT_RUN, WAIT_MARGIN_S, RunOptions

FIELDS = [f.name for f in dataclasses.fields(RunOptions)]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parser_with(add) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser


def test_every_problem_is_refused_at_once_naming_its_field() -> None:
    with pytest.raises(ValueError) as raised:
        RunOptions(mode="grey-box", agent_timeout_sec=0, agent_step_limit=-1, num_tasks=0, task_indices=[-2])
    for name in ("mode", "agent_timeout_sec", "agent_step_limit", "num_tasks", "task_indices"):
        assert f"{name} must" in str(raised.value), name


def test_the_trainers_wait_is_the_agents_timeout_plus_the_margin() -> None:
    assert RunOptions(agent_timeout_sec=90).rollout_wait_s == 90 + WAIT_MARGIN_S
    config = build_config(
        apply_config(build_parser().parse_args(["--model", "m", "--agent-timeout-sec", "90"]))
    )
    assert config.rollout_timeout == 90 + WAIT_MARGIN_S
    dev = parser_with(add_dev_arguments).parse_args(["--agent-timeout-sec", "30"])
    assert build_dev_config(apply_config(dev)).rollout_timeout == 30 + WAIT_MARGIN_S


@pytest.mark.parametrize(
    ("add", "excluded"),
    [
        (lambda p: build_parser(), ()),
        (add_dev_arguments, RUN_EXCLUDED),
        (add_eval_arguments, (*RUN_EXCLUDED, "mode")),
    ],
    ids=["train", "dev", "eval"],
)
def test_each_command_has_a_generated_flag_per_field_it_takes(add, excluded) -> None:
    parser = add(argparse.ArgumentParser()) or parser_with(add)
    options = {option: action for action in parser._actions for option in action.option_strings}
    for name in FIELDS:
        if name in excluded:
            assert flag(name) not in options, name
            continue
        field = next(f for f in dataclasses.fields(RunOptions) if f.name == name)
        if name not in ("sandbox", "harness"):  # these two: their registries' descriptions
            assert options[flag(name)].help.startswith(field.metadata["help"].replace("%", "%%")), name
        assert options[flag(name)].dest == name  # the command's own section holds it by field name


def test_list_and_mapping_flags_read_words_commas_and_json() -> None:
    parser = build_parser()
    words = apply_config(parser.parse_args(["--model", "m", "--task-indices", "3", "1"]))
    commas = apply_config(parser.parse_args(["--model", "m", "--task-indices", "3,1"]))
    assert run_options_from(words).task_indices == run_options_from(commas).task_indices == [3, 1]
    given = apply_config(parser.parse_args(["--model", "m", "--harness-options", '{"config": "mini.yaml"}']))
    assert run_options_from(given).harness_options == {"config": "mini.yaml"}
    for bad in (["--harness-options", "[1]"], ["--harness-options", "{"], ["--num-tasks", "0"]):
        with pytest.raises(SystemExit) as raised:
            parser.parse_args(["--model", "m", *bad])
        assert raised.value.code == 2


def test_the_config_file_holds_the_run_options_by_field_name(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    run = {
        "model": "m",
        "task_indices": [4, 2],
        "harness_options": {"config": "mini.yaml"},
        "mode": "white-box",
    }
    path.write_text(yaml.safe_dump({"run": {**run, "agent_timeout_sec": 45}}))
    args, config = resolve(["--config", str(path)])
    options = run_options_from(args)
    assert (options.task_indices, options.harness_options) == ([4, 2], {"config": "mini.yaml"})
    assert options.white_box and config.rollout_timeout == 45 + WAIT_MARGIN_S
    path.write_text(yaml.safe_dump({"run": {"model": "m", "task_indices": ["x"], "harness_options": [1]}}))
    with pytest.raises(ConfigFileError) as raised:
        resolve(["--config", str(path)])
    assert sorted(p.split(": ")[1] for p in raised.value.problems) == [
        "run.harness_options",
        "run.task_indices",
    ]


def test_several_harnesses_read_from_flags_and_config_files_in_each_shape(tmp_path: Path) -> None:
    parser = build_parser()
    flags = {
        "opencode": "opencode",
        "opencode,mini-swe-agent": ["opencode", "mini-swe-agent"],
        "opencode=3,codex=1": {"opencode": 3.0, "codex": 1.0},
    }
    for text, value in flags.items():
        options = run_options_from(apply_config(parser.parse_args(["--model", "m", "--harness", text])))
        assert options.harness == value
    path = tmp_path / "run.yaml"
    for value in (["opencode", "codex"], {"opencode": 2, "codex": 1}):
        path.write_text(yaml.safe_dump({"run": {"model": "m", "harness": value, "harness_options": {}}}))
        options = run_options_from(resolve(["--config", str(path)])[0])
        assert options.harness == value and options.harness_mix.mixed
    # Options keyed by harness in a mix; bad weights and options for no harness of the mix refused.
    keyed = {"codex": {"x": 1}}
    path.write_text(
        yaml.safe_dump({"run": {"model": "m", "harness": ["opencode", "codex"], "harness_options": keyed}})
    )
    assert run_options_from(resolve(["--config", str(path)])[0]).harness_options == keyed
    path.write_text(yaml.safe_dump({"run": {"model": "m", "harness": {"opencode": 0, "codex": 1}}}))
    with pytest.raises(ConfigFileError, match="the weight of 'opencode' must be positive"):
        resolve(["--config", str(path)])
    with pytest.raises(ValueError, match="'x' is not one of them"):
        RunOptions(harness=["opencode", "codex"], harness_options={"x": {}})
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--harness", "opencode=2,codex=lots"])
    # The dev loop takes only harnesses it can script, in a mix too.
    dev = parser_with(add_dev_arguments)
    assert options_from(apply_config(dev.parse_args(["--harness", "toy,mini-swe-agent"]))).run.harness == [
        "toy",
        "mini-swe-agent",
    ]
    with pytest.raises(SystemExit):
        dev.parse_args(["--harness", "toy,no-such-agent"])


@pytest.mark.parametrize("command", ["run", "dev"])
def test_the_trainers_wait_is_not_a_knob_of_its_own(tmp_path: Path, command: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({command: {"model": "m"} if command == "run" else {},
                                    "trainer": {"rollout_timeout": 5}}))  # fmt: skip
    with pytest.raises(ConfigFileError, match=r"trainer\.rollout_timeout: set by"):
        if command == "run":
            resolve(["--config", str(path)])
        else:
            build_dev_config(apply_config(parser_with(add_dev_arguments).parse_args(["--config", str(path)])))


def test_the_dev_loop_keeps_its_sandbox_and_its_own_defaults() -> None:
    options = options_from(apply_config(parser_with(add_dev_arguments).parse_args([])))
    assert (options.run.sandbox, options.run.harness, options.run.agent_step_limit) == (
        "local",
        "mini-swe-agent",
        4,
    )
    with pytest.raises(SystemExit):
        parser_with(add_dev_arguments).parse_args(["--harness", "no-such-agent"])  # not one it can script


@pytest.mark.parametrize(
    "made",
    [
        HarborSessionFactory.__init__,
        LocalSessionFactory.__init__,
        WhiteBoxSessionFactory.__init__,
        WhiteBoxSession.start,
        LocalWhiteBoxSessionFactory.__init__,
    ],
    ids=lambda made: made.__qualname__,
)
def test_the_factories_defaults_are_the_run_defaults(made) -> None:
    parameters = inspect.signature(made).parameters
    checked = 0
    for name in ("split", "harness", "sandbox"):
        if name not in parameters or (name == "sandbox" and made.__qualname__.startswith("Local")):
            continue  # a local factory's sandbox is local: what it is
        assert parameters[name].default == getattr(DEFAULT_RUN, name), name
        checked += 1
    assert checked >= 1
