"""``jobs submit``: the job spec, secrets that are never shown, volumes, and the call to ``run_job``."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import Volume

from harness_trainer.jobs import job_launcher, plan
from harness_trainer.jobs.submit import REDACTED, add_submit_arguments, run_submit
from tests.jobs.conftest import SECRETS, FakeHfApi

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ["--harness", "opencode", "--model", "Qwen/Qwen3-8B", "--split", "train", "--sandbox", "e2b"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_submit_arguments(parser)
    return parser.parse_args(list(argv))


def submit(*options: str, trainer: list[str] = TRAINER, api: Any = None) -> int:
    return run_submit(parse("--dataset", "org/tasks", *options, "--", *trainer), api=api)


@pytest.fixture(autouse=True)
def secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)


def no_secret_in(text: str) -> bool:
    return not any(value in text for value in SECRETS.values())


def test_the_dry_run_prints_the_spec_with_secrets_redacted_and_submits_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    api = FakeHfApi()
    assert submit("--dry-run", "--flavor", "h200x2", api=api) == 0
    out, err = capsys.readouterr()
    spec = json.loads(out)
    assert spec["secrets"] == {"HF_TOKEN": REDACTED, "E2B_API_KEY": REDACTED}
    assert spec["flavor"] == "h200x2" and spec["expose_public"] == [8300]
    assert spec["env"]["HT_SECRET_NAMES"] == "HF_TOKEN,E2B_API_KEY"
    assert no_secret_in(out + err)
    assert api.run_job_calls == [] and api.sync_calls == []


def test_submit_passes_the_secret_values_to_run_job_and_prints_only_the_job(
    capsys: pytest.CaptureFixture[str],
) -> None:
    api = FakeHfApi()
    assert submit("--secret", "WANDB_API_KEY", "--timeout", "12h", "--namespace", "org", api=api) == 0
    out, err = capsys.readouterr()
    assert (
        out.strip()
        == "submitted job 6a0000000000000000000001: https://huggingface.co/jobs/me/6a0000000000000000000001"
    )
    assert no_secret_in(out + err)
    (call,) = api.run_job_calls
    assert call["secrets"] == SECRETS
    assert no_secret_in(json.dumps({k: v for k, v in call.items() if k not in ("secrets", "volumes")}))
    assert (call["flavor"], call["timeout"], call["namespace"]) == ("h200x2", "12h", "org")
    assert call["expose_public"] == [plan.DEFAULT_CAPTURE_PORT]
    run_id = call["env"][plan.RUN_ID_ENV]
    assert call["labels"] == {plan.RUN_LABEL: run_id}
    assert call["env"][plan.NAMESPACE_ENV] == "org"
    assert call["env"][plan.SECRET_NAMES_ENV] == "HF_TOKEN,E2B_API_KEY,WANDB_API_KEY"


def test_the_jobs_command_runs_the_launcher_with_the_trainer_arguments_unchanged() -> None:
    api = FakeHfApi()
    trainer = [*TRAINER, "--temperature", "0.7", "--report-to", "trackio", "--output-dir", "/out/a b"]
    assert submit("--vllm-arg=--max-model-len=32768", api=api, trainer=trainer) == 0
    bash, flag, script = api.run_job_calls[0]["command"]
    assert (bash, flag) == ("bash", "-c")
    install, launch = script.split(" && exec ")
    assert install == "python3 -m pip install --no-cache-dir 'harness-trainer[e2b,train]'"
    argv = shlex.split(launch)
    assert argv[:3] == ["python3", "-m", "harness_trainer.jobs.job_launcher"]
    split = argv.index("--")
    assert argv[split + 1 :] == trainer
    options = job_launcher.build_parser().parse_args(argv[3:split])
    assert (options.dataset, options.capture_port, options.vllm_arg) == (
        "org/tasks",
        8300,
        ["--max-model-len=32768"],
    )


def test_the_jobs_launcher_command_plans_a_run_when_executed_here() -> None:
    api = FakeHfApi()
    assert submit(api=api) == 0
    launch = shlex.split(api.run_job_calls[0]["command"][2].split(" && exec ")[1])
    launch[0] = sys.executable
    launch.insert(launch.index("--"), "--dry-run")
    env = {"HT_RUN_ID": "run-1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(launch, capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["trainer"]["argv"][3:-4] == TRAINER
    assert plan["warm"] is not None


def test_a_missing_secret_is_one_error_line_naming_it_and_nothing_is_submitted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("E2B_API_KEY")
    api = FakeHfApi()
    assert submit(api=api) == 2
    assert submit("--dry-run", api=api) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "error: secret E2B_API_KEY is not set in this environment: export it"
    assert api.run_job_calls == []


@pytest.mark.parametrize(
    ("options", "trainer", "message"),
    [
        (["--flavor", "h300x9"], TRAINER, "--flavor 'h300x9' is not a Jobs flavor; known: cpu-basic"),
        (["--timeout", "soon"], TRAINER, "--timeout 'soon'"),
        (["--secret", "NOT-A-NAME"], TRAINER, "--secret 'NOT-A-NAME' is not an environment variable name"),
        ([], ["--harness", "opencode"], "the trainer arguments need --model"),
        ([], [*TRAINER, "--vllm-url", "http://x"], "the launcher sets --vllm-url"),
        (["--volume", "hf://org"], TRAINER, "--volume hf://org: Invalid HF URI"),
        (["--volume", "/no/such:/data"], TRAINER, "--volume /no/such:/data: /no/such is not a local folder"),
    ],
)
def test_bad_options_are_one_error_line_and_exit_2(
    options: list[str], trainer: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    api = FakeHfApi()
    assert submit(*options, trainer=trainer, api=api) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
    assert api.run_job_calls == []


def test_a_bucket_volume_is_mounted_and_a_local_folder_is_synced_at_submit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api = FakeHfApi()
    trainer = [*TRAINER, "--output-dir", "/outputs/run1"]
    volumes = ["--volume", "hf://buckets/org/runs:/outputs", "--volume", f"{tmp_path}:/opt/wheels"]
    assert submit(*volumes, trainer=trainer, api=api) == 0
    assert "warning" not in capsys.readouterr().err
    assert api.sync_calls == [{"source": str(tmp_path), "mount_path": "/opt/wheels", "read_only": True}]
    bucket, synced = api.run_job_calls[0]["volumes"]
    assert isinstance(bucket, Volume)
    assert bucket.to_dict() == {"type": "bucket", "source": "org/runs", "mountPath": "/outputs"}
    assert synced.to_dict()["mountPath"] == "/opt/wheels"


def test_outputs_off_a_writable_volume_are_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    read_only = ["--volume", "hf://buckets/org/runs:/outputs:ro"]
    assert submit(*read_only, "--dry-run", trainer=[*TRAINER, "--output-dir", "/outputs/run1"]) == 0
    assert "warning: --output-dir /outputs/run1 is not on a writable volume" in capsys.readouterr().err


def test_a_hub_failure_is_one_line_without_any_secret_value(capsys: pytest.CaptureFixture[str]) -> None:
    api = FakeHfApi(error=RuntimeError(f"403 Forbidden for token {SECRETS['HF_TOKEN']}"))
    assert submit(api=api) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"error: the job was not submitted: 403 Forbidden for token {REDACTED}"


def test_a_huggingface_hub_that_cannot_expose_a_port_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    class OldHfApi:
        def run_job(self, *, image: str, command: list[str], secrets: dict[str, Any] | None = None) -> None:
            raise AssertionError("must not be called")

    assert submit(api=OldHfApi()) == 1
    assert "cannot expose a job's port publicly" in capsys.readouterr().err


def test_the_thin_script_dry_runs_like_the_cli() -> None:
    result = subprocess.run(
        [sys.executable, "jobs/submit.py", "--dataset", "org/tasks", "--dry-run", "--", *TRAINER],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", **SECRETS},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["secrets"] == {"HF_TOKEN": REDACTED, "E2B_API_KEY": REDACTED}
    assert no_secret_in(result.stdout + result.stderr)


def test_importing_the_submission_loads_neither_huggingface_hub_nor_torch() -> None:
    program = (
        "import sys, harness_trainer.jobs.submit\n"
        "print([m for m in ('huggingface_hub', 'torch', 'transformers', 'aiohttp') if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr
