"""``harness-trainer serve --config FILE``: the file's ``serve`` section holds any of serve's options, the
capture proxy's included, by their flag's name; a flag given wins; a bad file is one line and exit 2,
before anything starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from harness_trainer.launch.config_file import ConfigFileError, apply_config
from harness_trainer.launch.serve import add_serve_arguments, run_serve


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_serve_section_sets_any_option_and_a_flag_given_wins(tmp_path: Path) -> None:
    section = {"dataset": ["tasks", "org/more"], "port": 8300, "upstream": ["http://a:8000", "http://b:8000"]}
    section.update(proxy="in-process", max_sandbox_starts=4, idle_timeout=30, replicas=True)
    path = write(tmp_path, {"serve": section})
    args = apply_config(parsed("--config", str(path), "--port", "8400"))
    assert args.dataset == ["tasks", "org/more"] and args.port == 8400  # the flag given wins
    assert args.upstream == ["http://a:8000", "http://b:8000"] and args.proxy == "in-process"
    assert (args.max_sandbox_starts, args.idle_timeout, args.replicas) == (4, 30.0, True)
    assert args.host == "127.0.0.1" and args.capture_port == 8300  # the defaults, where neither says


def test_every_problem_of_a_file_is_named_and_a_trainer_section_is_not_serves(tmp_path: Path) -> None:
    path = write(tmp_path, {"serve": {"upstream": "u", "port": "high", "proxy": "thread", "colour": 1},
                            "trainer": {"max_steps": 1}})  # fmt: skip
    with pytest.raises(ConfigFileError) as raised:
        apply_config(parsed("--config", str(path)))
    keys = sorted(problem.split(": ")[1] for problem in raised.value.problems)
    assert keys == ["serve.colour", "serve.port", "serve.proxy", "trainer"]


def test_the_dataset_is_required_in_the_flags_or_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--dataset is required \(or serve.dataset in a --config file\)"):
        apply_config(parsed())
    path = write(tmp_path, {"serve": {"dataset": "x", "upstream": "http://e:8000"}})
    assert apply_config(parsed("--config", str(path))).dataset == ["x"]


def test_serve_says_a_bad_file_in_one_line_and_starts_nothing(tmp_path: Path, capsys) -> None:
    path = write(tmp_path, {"serve": {"dataset": "tasks", "port": "high"}})
    assert run_serve(parsed("--config", str(path))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "serve.port" in err[0]


def test_serve_refuses_a_split_to_prepare_that_no_dataset_has(capsys) -> None:
    from tests.rollouts.conftest import EXAMPLES

    args = parsed("--dataset", str(EXAMPLES), "--upstream", "http://127.0.0.1:9", "--prepare", "nope")
    assert run_serve(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --prepare: no split 'nope'")


def test_the_proxy_command_takes_a_proxy_section_too(tmp_path: Path, capsys) -> None:
    from harness_trainer.cli import build_parser, main

    path = write(tmp_path, {"proxy": {"upstream": "http://e:8000", "data_dir": str(tmp_path), "port": 9301}})
    args = apply_config(build_parser().parse_args(["proxy", "--config", str(path), "--replicas"]))
    assert (args.upstream, args.data_dir, args.port, args.replicas) == (
        ["http://e:8000"],
        tmp_path,
        9301,
        True,
    )
    assert args.upstream_attempts == 3  # the default, where neither says
    path = write(tmp_path, {"proxy": {"upstream": "http://e:8000", "data_dir": str(tmp_path), "prot": 1}})
    assert main(["proxy", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "proxy.prot: unknown key" in err[0]


def test_serves_run_id_labels_both_remote_backends_and_sizes_the_hf_pool() -> None:
    from harness_trainer.launch.serve import sandbox_options
    from harness_trainer.sandboxes import make_backend

    options = sandbox_options(argparse.Namespace(run_id="run-7", e2b_templates="build"), 12)
    assert options["e2b"]["run_id"] == options["hf"]["run_id"] == "run-7"
    hf = make_backend("hf", **options["hf"])  # the options are the backend's own keywords
    assert (hf.run_id, hf.concurrency) == ("run-7", 12)
