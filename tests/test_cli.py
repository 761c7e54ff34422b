"""The ``harness-trainer`` console script, run as a user runs it: exit codes, stdout, and stderr errors."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness_trainer.net import free_port


def _console_script() -> str:
    beside = Path(sys.executable).parent / "harness-trainer"
    found = str(beside) if beside.exists() else shutil.which("harness-trainer")
    assert found, "the harness-trainer console script is not installed"
    return found


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_console_script(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")


def engine_processes_on(port: int) -> list[str]:
    """Command lines of live ``harness_trainer.cli engine`` processes serving ``port``."""
    listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [
        line
        for line in listing.splitlines()
        if "harness_trainer.cli engine" in line and f"--port {port} " in f"{line} "
    ]


@pytest.mark.parametrize("command", [[], ["tiny-model"], ["engine"], ["demo"], ["proxy"], ["proxy-trace"]])
def test_help_exits_zero_for_the_command_and_each_subcommand(command: list[str]) -> None:
    result = run_cli(*command, "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: harness-trainer {' '.join(command)}".rstrip())


def test_help_lists_train_first_among_the_subcommands() -> None:
    result = run_cli("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "{train," in result.stdout
    listed = re.findall(r"^    (\S+)", result.stdout, re.MULTILINE)  # each subcommand and its help
    assert listed[0] == "train" and {"serve", "dev", "jobs"} <= set(listed)


def test_tiny_model_prints_the_model_directory(tiny_model_dir: Path) -> None:
    result = run_cli("tiny-model")
    assert result.returncode == 0, result.stderr
    printed = Path(result.stdout.strip())
    assert printed.is_dir()
    assert (printed / "config.json").is_file()
    assert printed == tiny_model_dir


def test_tiny_model_refuses_a_non_empty_foreign_out_dir(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine\n")
    result = run_cli("tiny-model", "--out", str(tmp_path))
    assert result.returncode == 2
    assert_one_line_error(result)
    assert str(tmp_path) in result.stderr
    assert "not empty" in result.stderr
    assert result.stdout == ""


@pytest.mark.slow
def test_engine_with_a_missing_model_fails_with_a_one_line_error() -> None:
    result = run_cli("engine", "--model", "/nonexistent", "--port", str(free_port()))
    assert_one_line_error(result)
    assert "/nonexistent" in result.stderr


@pytest.mark.slow
def test_engine_with_a_malformed_script_fails_with_a_one_line_error(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "script.jsonl"
    script.write_text('{"content": "fine"}\nthis is not json\n')
    result = run_cli(
        "engine", "--model", str(tiny_model_dir), "--script", str(script), "--port", str(free_port())
    )
    assert_one_line_error(result)
    assert str(script) in result.stderr


@pytest.mark.slow
def test_demo_runs_a_tool_call_end_to_end_and_stops_its_engine(tiny_model_dir: Path) -> None:
    port = free_port()
    result = run_cli("demo", "--port", str(port), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "tool call: bash(" in result.stdout
    assert '"ok": true' in result.stdout
    assert f"127.0.0.1:{port}" in result.stdout
    assert engine_processes_on(port) == []
