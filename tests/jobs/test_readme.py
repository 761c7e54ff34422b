"""Every command in ``docs/jobs.md`` runs: submissions against a fake ``HfApi`` (dry runs also as real
processes), the launcher's dry run as a real process."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from harness_trainer.jobs.submit import REDACTED, add_submit_arguments, run_submit
from tests.jobs.conftest import SECRETS, FakeHfApi

ROOT = Path(__file__).resolve().parents[2]
SUBMIT = ["harness-trainer", "jobs", "submit"]
LAUNCHER = ["python", "-m", "harness_trainer.jobs.job_launcher"]


def readme_commands() -> list[list[str]]:
    text = (ROOT / "docs/jobs.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [shlex.split(block.replace("\\\n", " ")) for block in blocks]


def env() -> dict[str, str]:
    return {**os.environ, **SECRETS}


def console_script() -> str:
    return shutil.which("harness-trainer") or str(Path(sys.executable).parent / "harness-trainer")


def cli_has_jobs() -> bool:
    """Whether ``harness-trainer jobs submit`` is in the CLI (``examples/jobs/submit.py`` always is)."""
    result = subprocess.run([console_script(), "jobs", "submit", "--help"], capture_output=True, timeout=60)
    return result.returncode == 0


def test_the_readme_has_only_commands_this_test_runs() -> None:
    commands = readme_commands()
    assert len(commands) == 5
    assert all(command[:3] == SUBMIT or command[:3] == LAUNCHER for command in commands)


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [c for c in readme_commands() if c[:3] == SUBMIT],
    ids=["dry-run", "submit", "several-gpus", "without-e2b"],
)
def test_each_readme_submission_runs(
    command: list[str],
    cached_build: Callable[[Path], Path],
    project_wheel: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    api = FakeHfApi()
    parser = argparse.ArgumentParser()
    add_submit_arguments(parser)
    assert run_submit(parser.parse_args(command[3:]), api=api, build=cached_build) == 0
    out = capsys.readouterr().out
    assert not any(value in out for value in SECRETS.values())
    if "--dry-run" in command:
        spec = json.loads(out)
        assert spec["secrets"]["HF_TOKEN"] == REDACTED
        assert api.run_job_calls == []
        if "--vllm-gpu-count" in command:  # the Several GPUs section's split, as it says
            assert spec["gpus"]["summary"] in (ROOT / "docs/jobs.md").read_text().replace("\n  ", " ")
        if command[command.index("--sandbox") + 1] == "hf":  # the Without E2B section's: the hub token alone
            assert spec["secrets"] == {"HF_TOKEN": REDACTED}
            assert spec["install"]["requirement"].startswith("harness-trainer[hf,train] @ ")
    else:
        assert out.startswith("submitted job ")
        (call,) = api.run_job_calls
        assert call["secrets"]["WANDB_API_KEY"] == SECRETS["WANDB_API_KEY"]
        wheel = f"file:///opt/harness-trainer/wheel/{project_wheel.name}"
        assert f"'harness-trainer[e2b,train,tracking] @ {wheel}'" in call["command"][2]
        assert list(api.uploads.values()) == [{project_wheel.name: project_wheel.read_bytes()}]


@pytest.mark.slow  # each process builds the wheel (seconds)
def test_the_readme_dry_run_runs_as_a_process_through_the_script_and_the_cli() -> None:
    dry_run = next(c for c in readme_commands() if c[:3] == SUBMIT and "--dry-run" in c)
    entries = [[sys.executable, "examples/jobs/submit.py"]]
    if cli_has_jobs():
        entries.append([console_script(), "jobs", "submit"])
    for entry in entries:
        result = subprocess.run(
            [*entry, *dry_run[3:]], capture_output=True, text=True, env=env(), timeout=60, cwd=ROOT
        )
        assert result.returncode == 0, result.stderr
        spec = json.loads(result.stdout)
        assert spec["flavor"] == "h200x2" and spec["install"]["source"] == "checkout"
        assert "building the wheel of" in result.stderr


def test_the_readme_launcher_dry_run_runs() -> None:
    (command,) = [c for c in readme_commands() if c[:3] == LAUNCHER]
    result = subprocess.run(
        [sys.executable, *command[1:]], capture_output=True, text=True, env=env(), timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["vllm"]["argv"][:3] == ["vllm", "serve", "Qwen/Qwen3-8B"]
    assert not any(value in result.stdout for value in SECRETS.values())


def test_the_readmes_trainer_arguments_are_the_trainer_launchers() -> None:
    from harness_trainer.launch.harbor_run import build_parser as trainer_parser

    for command in readme_commands():
        trainer_args = command[command.index("--") + 1 :]
        parsed = trainer_parser().parse_args(trainer_args)
        assert parsed.model == "Qwen/Qwen3-8B"
