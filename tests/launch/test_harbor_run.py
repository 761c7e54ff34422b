"""The launcher's flags: how they become the session factory and the trainer config, the script's
``--help`` and PEP 723 header, and a refusal as a user sees it from the script."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harness_trainer.launch.harbor_run import (
    build_config,
    main,
    parse_args,
    session_builder,
)
from harness_trainer.net import free_port
from harness_trainer.rollouts.client.factory import HarborSessionFactory
from harness_trainer.rollouts.run_options import WAIT_MARGIN_S

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "async_grpo_harbor" / "train.py"
BRIEF_FLAGS = (
    "--server --vllm-url --model --split --harness --sandbox --reward-key --num-tasks --task-indices "
    "--num-generations --max-concurrent-rollouts --max-steps --learning-rate --temperature --max-staleness "
    "--agent-timeout-sec --agent-step-limit --lora --output-dir --report-to --resume --engine "
    "--preflight-only"
).split()


def parse(*argv: str):
    return parse_args(["--model", "m", *argv])


def test_flags_become_the_trainer_config() -> None:
    args = parse(
        *("--num-generations", "4", "--max-concurrent-rollouts", "3", "--max-steps", "7"),
        *("--learning-rate", "2e-5", "--temperature", "0.7", "--max-staleness", "2", "--lora"),
        *("--agent-timeout-sec", "300", "--output-dir", "/tmp/run", "--report-to", "tensorboard,trackio"),
        *("--vllm-url", "http://gpu:8000", "--engine", "dev", "--dtype", "bfloat16", "--save-steps", "5"),
    )
    config = build_config(args)
    assert (config.num_generations, config.max_concurrent_rollouts, config.max_steps) == (4, 3, 7)
    assert (config.learning_rate, config.temperature, config.max_staleness) == (2e-5, 0.7, 2)
    assert config.use_peft and config.dtype == "bfloat16" and config.save_steps == 5
    assert config.rollout_timeout == 300 + WAIT_MARGIN_S
    assert config.output_dir == "/tmp/run" and config.report_to == ["tensorboard", "trackio"]
    assert (config.engine, config.vllm_server_base_url) == ("dev", "http://gpu:8000")
    assert config.resume_from_checkpoint is None


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], None), (["--resume"], "latest"), (["--resume", "out/checkpoint-4"], "out/checkpoint-4")],
)
def test_resume_takes_the_latest_checkpoint_or_the_one_named(argv: list[str], expected: str | None) -> None:
    assert build_config(parse(*argv)).resume_from_checkpoint == expected


def test_flags_become_the_session_factory_builder() -> None:
    args = parse(
        *("--server", "http://rollouts:8200", "--split", "test", "--harness", "codex", "--sandbox", "local"),
        *("--agent-timeout-sec", "90", "--agent-step-limit", "12", "--reward-key", "pass"),
        *("--task-indices", "3,1", "--num-tasks", "1", "--vllm-url", "http://gpu:8000"),
        *("--harness-options", '{"config": "mini.yaml"}'),
    )
    builder = session_builder(args)  # built by the trainer, which adds its sampling policy
    assert builder.func is HarborSessionFactory and builder.args == ("http://rollouts:8200",)
    assert builder.keywords == {
        "split": "test", "harness": "codex", "harness_options": {"config": "mini.yaml"}, "sandbox": "local",
        "llm_url": "http://gpu:8000",
        "agent_timeout_sec": 90, "agent_step_limit": 12, "reward_key": "pass", "num_tasks": 1,
        "indices": [3, 1],
    }  # fmt: skip


@pytest.mark.parametrize("value", ["a,b", "-1", ""])
def test_bad_task_indices_are_refused_by_the_parser(value: str) -> None:
    with pytest.raises(SystemExit) as raised:
        parse("--task-indices", value)
    assert raised.value.code == 2


def test_a_config_the_trainer_refuses_is_one_line_before_any_request(capsys) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["--model", "m", "--num-generations", "1", "--server", dead, "--vllm-url", dead]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: invalid AsyncGRPOConfig: num_generations must be at least 2 (a group of 1 has no baseline)"
    ]


def run_script(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TRAIN), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def test_the_script_help_lists_every_flag() -> None:
    result = run_script("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: train.py")
    assert [flag for flag in BRIEF_FLAGS if flag not in result.stdout] == []


def test_the_script_refuses_an_unreachable_engine_in_one_line(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    result = run_script(
        *("--model", "m", "--vllm-url", dead, "--sandbox", "local", "--output-dir", str(tmp_path / "o"))
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"preflight: engine at {dead} unreachable (GET /weight_version): ConnectError")
    assert not (tmp_path / "o").exists()


def test_the_script_header_is_valid_pep_723_inline_metadata() -> None:
    # The reference regex of PEP 723.
    pattern = r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$"
    blocks = [m for m in re.finditer(pattern, TRAIN.read_text()) if m.group("type") == "script"]
    assert len(blocks) == 1
    content = "".join(line[2:] for line in blocks[0].group("content").splitlines(keepends=True))
    metadata = tomllib.loads(content)
    assert metadata["requires-python"] == ">=3.11"
    assert metadata["dependencies"][0].startswith("harness-trainer[")
    source = metadata["tool"]["uv"]["sources"]["harness-trainer"]
    assert (TRAIN.parent / source["path"] / "pyproject.toml").is_file()


def test_the_launcher_imports_no_torch_until_a_run_starts() -> None:
    program = (
        "import sys\nfrom harness_trainer.launch.harbor_run import build_parser\n"
        "build_parser().format_help()\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr
