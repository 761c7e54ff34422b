"""``jobs submit``: the job spec, secrets that are never shown, volumes, and the call to ``run_job``."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import Volume, constants

from harness_trainer.jobs import job_launcher, plan
from harness_trainer.jobs.install import WHEEL_MOUNT, build_wheel
from harness_trainer.jobs.submit import REDACTED, add_submit_arguments, run_submit
from tests.jobs.conftest import SECRETS, FakeHfApi

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ["--harness", "opencode", "--model", "Qwen/Qwen3-8B", "--split", "train", "--sandbox", "e2b"]
HF_TRAINER = [*TRAINER[:-1], "hf"]
WHEEL_URL = f"file://{WHEEL_MOUNT}/"
GIT_URL = "git+https://github.com/org/harness-trainer@main"
Submit = Callable[..., int]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_submit_arguments(parser)
    return parser.parse_args(list(argv))


def must_not_build(wheel_dir: Path) -> Path:
    raise AssertionError("no wheel is built for this submission")


@pytest.fixture
def submit(cached_build: Callable[[Path], Path]) -> Submit:
    """``jobs submit --dataset org/tasks OPTIONS -- TRAINER``; the checkout's wheel is the session's build."""

    def run(
        *options: str,
        trainer: list[str] = TRAINER,
        api: Any = None,
        build: Callable[[Path], Path] = cached_build,
    ) -> int:
        return run_submit(parse("--dataset", "org/tasks", *options, "--", *trainer), api=api, build=build)

    return run


@pytest.fixture(autouse=True)
def secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)


def install_part(call: dict[str, Any]) -> str:
    """The job command's install step (what runs before ``exec`` of the launcher)."""
    bash, flag, script = call["command"]
    assert (bash, flag) == ("bash", "-c")
    return script.split(" && exec ")[0]


def no_secret_in(text: str) -> bool:
    return not any(value in text for value in SECRETS.values())


def test_the_dry_run_prints_the_spec_with_secrets_redacted_and_submits_nothing(
    submit: Submit, project_wheel: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api = FakeHfApi()
    assert submit("--dry-run", "--flavor", "h200x2", api=api) == 0
    out, err = capsys.readouterr()
    spec = json.loads(out)
    assert spec["secrets"] == {"HF_TOKEN": REDACTED, "E2B_API_KEY": REDACTED}
    assert spec["flavor"] == "h200x2" and spec["expose_public"] == [8300]
    assert spec["env"]["HT_SECRET_NAMES"] == "HF_TOKEN,E2B_API_KEY"
    install = spec["install"]
    assert (install["source"], install["wheel"]) == ("checkout", project_wheel.name)
    assert install["pip_command"] == (
        "python3 -m pip install --no-cache-dir "
        f"'harness-trainer[e2b,train] @ {WHEEL_URL}{project_wheel.name}'"
    )
    assert spec["command"][2].startswith(install["pip_command"] + " && exec ")
    assert no_secret_in(out + err)
    assert api.run_job_calls == [] and api.sync_calls == []


def test_submit_passes_the_secret_values_to_run_job_and_prints_only_the_job(
    submit: Submit, capsys: pytest.CaptureFixture[str]
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


def test_the_job_uploads_exactly_the_built_wheel_and_its_command_installs_it(
    submit: Submit, project_wheel: Path, tmp_path: Path
) -> None:
    api = FakeHfApi()
    assert submit("--namespace", "org", api=api) == 0
    digest = hashlib.sha256(project_wheel.read_bytes()).hexdigest()
    folder = f"harness-trainer-wheel-{digest[:16]}"
    assert api.uploads == {folder: {project_wheel.name: project_wheel.read_bytes()}}
    (sync,) = api.sync_calls
    assert (sync["mount_path"], sync["remote_name"]) == (WHEEL_MOUNT, folder)
    assert (sync["read_only"], sync["namespace"]) == (True, "org")
    (call,) = api.run_job_calls
    (volume,) = call["volumes"]
    assert (volume.type, volume.source, volume.path) == ("bucket", "org/jobs-artifacts", folder)
    assert (volume.mount_path, volume.read_only) == (WHEEL_MOUNT, True)
    # The job's own pip command, run here against the uploaded bytes mounted where the job mounts them.
    mount = tmp_path / "mount"
    mount.mkdir()
    for name, data in api.uploads[volume.path].items():
        (mount / name).write_bytes(data)
    install = shlex.split(install_part(call).replace(f"file://{WHEEL_MOUNT}", f"file://{mount}"))
    assert install[:5] == ["python3", "-m", "pip", "install", "--no-cache-dir"]
    checks = ["--dry-run", "--no-deps", "--no-index", "--ignore-installed", "--quiet", "--report", "-"]
    result = subprocess.run(
        [sys.executable, *install[1:4], *checks, *install[4:]],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert result.returncode == 0, result.stderr
    (installed,) = json.loads(result.stdout)["install"]
    assert installed["metadata"]["name"] == "harness-trainer"
    assert installed["download_info"]["url"] == f"file://{mount}/{project_wheel.name}"
    assert installed["download_info"]["archive_info"]["hashes"] == {"sha256": digest}
    assert installed["requested_extras"] == ["e2b", "train"]


def test_the_jobs_command_runs_the_launcher_with_the_trainer_arguments_unchanged(submit: Submit) -> None:
    api = FakeHfApi()
    trainer = [*TRAINER, "--temperature", "0.7", "--report-to", "trackio", "--output-dir", "/out/a b"]
    assert submit("--vllm-arg=--max-model-len=32768", api=api, trainer=trainer) == 0
    launch = api.run_job_calls[0]["command"][2].split(" && exec ")[1]
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


def test_the_jobs_launcher_command_plans_a_run_when_executed_here(submit: Submit) -> None:
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


@pytest.mark.parametrize(
    ("install", "requirement"),
    [
        (GIT_URL, f"harness-trainer[e2b,train] @ {GIT_URL}"),
        ("https://example.org/w/harness_trainer-0.2-py3-none-any.whl", "harness-trainer[e2b,train] @ https:"),
        (f"harness-trainer[e2b] @ {GIT_URL}", f"harness-trainer[e2b] @ {GIT_URL}"),
        ("harness-trainer==0.2.0", "harness-trainer==0.2.0"),
    ],
)
def test_an_explicit_install_skips_the_build_and_uploads_nothing(
    install: str, requirement: str, submit: Submit
) -> None:
    api = FakeHfApi()
    assert submit("--install", install, api=api, build=must_not_build) == 0
    (call,) = api.run_job_calls
    (pip_argv,) = [shlex.split(install_part(call))]
    assert pip_argv[:5] == ["python3", "-m", "pip", "install", "--no-cache-dir"]
    assert pip_argv[5].startswith(requirement) and len(pip_argv) == 6
    assert api.sync_calls == [] and call["volumes"] is None


def test_a_local_wheel_is_uploaded_as_it_is_with_the_extras_asked_for(
    submit: Submit, project_wheel: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api = FakeHfApi()
    extras = ["--extras", "e2b,train,tracking"]
    assert submit("--install", str(project_wheel), *extras, api=api, build=must_not_build) == 0
    (folder,) = api.uploads
    assert api.uploads[folder] == {project_wheel.name: project_wheel.read_bytes()}
    expected = f"'harness-trainer[e2b,train,tracking] @ {WHEEL_URL}{project_wheel.name}'"
    assert install_part(api.run_job_calls[0]).endswith(expected)
    capsys.readouterr()
    assert submit("--install", str(project_wheel), "--dry-run", build=must_not_build) == 0
    assert json.loads(capsys.readouterr().out)["install"]["source"] == "wheel"


def test_an_install_of_a_missing_local_wheel_is_an_error_before_anything_is_built_or_uploaded(
    submit: Submit, capsys: pytest.CaptureFixture[str]
) -> None:
    api = FakeHfApi()
    for dry_run in ([], ["--dry-run"]):
        assert submit("--install", "./dist/nope.whl", *dry_run, api=api, build=must_not_build) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0] == lines[1]
    assert lines[0].startswith("error: --install ./dist/nope.whl: no such file (a local wheel is uploaded")
    assert api.sync_calls == [] and api.run_job_calls == []


def test_a_failing_wheel_build_names_the_command_and_its_output_and_nothing_is_uploaded(
    submit: Submit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "harness-trainer"\nversion = "0.0.1"\n'
    )
    (broken / "setup.py").write_text('raise SystemExit("boom: this setup.py cannot build")\n')
    api = FakeHfApi()
    assert submit(api=api, build=lambda wheel_dir: build_wheel(broken, wheel_dir)) == 1
    err = capsys.readouterr().err
    failure = err[err.index("error: ") :]
    first = failure.splitlines()[0]
    assert first.startswith("error: building the wheel failed (exit 1): ")
    assert "-m pip wheel --no-deps" in first and first.endswith(f" {broken}")
    assert "boom: this setup.py cannot build" in failure
    assert api.sync_calls == [] and api.run_job_calls == []
    assert sorted(path.name for path in broken.iterdir()) == ["pyproject.toml", "setup.py"]


def test_a_local_sandbox_needs_no_e2b_key(
    submit: Submit, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("E2B_API_KEY")
    local = [*TRAINER[:-1], "local"]
    assert submit("--dry-run", trainer=local) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["secrets"] == {"HF_TOKEN": REDACTED}
    assert spec["env"]["HT_SECRET_NAMES"] == "HF_TOKEN"
    api = FakeHfApi()
    assert submit(trainer=local, api=api) == 0
    assert api.run_job_calls[0]["secrets"] == {"HF_TOKEN": SECRETS["HF_TOKEN"]}


def test_with_the_hf_sandbox_the_job_needs_only_the_hub_token_and_its_launcher_plans_hf_sandboxes(
    submit: Submit, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("E2B_API_KEY")
    assert submit("--dry-run", trainer=HF_TRAINER) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["secrets"] == {"HF_TOKEN": REDACTED} and spec["env"]["HT_SECRET_NAMES"] == "HF_TOKEN"
    assert spec["expose_public"] == [8300]  # the capture port: how HF sandboxes, jobs elsewhere, reach it
    api = FakeHfApi()
    assert submit(trainer=HF_TRAINER, api=api) == 0
    (call,) = api.run_job_calls
    assert call["secrets"] == {"HF_TOKEN": SECRETS["HF_TOKEN"]}
    # The job's launcher, run here as the job would run it (its environment and its one secret): its plan.
    launch = shlex.split(call["command"][2].split(" && exec ")[1])
    launch[0] = sys.executable
    launch.insert(launch.index("--"), "--dry-run")
    env = {"PATH": "/usr/bin:/bin", **call["env"], **call["secrets"]}
    result = subprocess.run(launch, capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    planned = json.loads(result.stdout)
    url = "https://<job id>--8300.hf.jobs"
    assert planned["public_url"] == url
    warm = planned["warm"]["argv"]
    assert (warm[warm.index("--sandbox") + 1], warm[warm.index("--public-url") + 1]) == ("hf", url)
    steps = ("vllm", "serve", "warm", "trainer")
    assert {step: planned[step]["secrets"] for step in steps} == {step: ["HF_TOKEN"] for step in steps}
    assert "E2B_API_KEY" not in result.stdout
    # It installs the hf backend's extra (huggingface_hub's sandboxes), not E2B's SDK.
    assert f"'harness-trainer[hf,train] @ {WHEEL_URL}" in install_part(call)


def test_a_token_stored_by_hf_auth_login_is_the_jobs_hf_token(
    submit: Submit, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # As `hf jobs run --secrets HF_TOKEN` does: a logged-in user need not export the token.
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "E2B_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    token_path = tmp_path / "hf-home" / "token"
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(token_path))
    api = FakeHfApi()
    assert submit(trainer=HF_TRAINER, api=api, build=must_not_build) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: secret HF_TOKEN is not set in this environment: export it (or store HF_TOKEN with "
        "`hf auth login`)"
    ]
    assert api.run_job_calls == [] and api.sync_calls == []
    token_path.parent.mkdir()
    token_path.write_text("hf_stored_by_login\n")
    assert submit(trainer=HF_TRAINER, api=api) == 0
    assert api.run_job_calls[0]["secrets"] == {"HF_TOKEN": "hf_stored_by_login"}
    assert "hf_stored_by_login" not in capsys.readouterr().out


def test_a_missing_secret_is_one_error_line_naming_it_and_nothing_is_submitted(
    submit: Submit, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("E2B_API_KEY")
    api = FakeHfApi()
    assert submit(api=api, build=must_not_build) == 2
    assert submit("--dry-run", api=api, build=must_not_build) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "error: secret E2B_API_KEY is not set in this environment: export it"
    assert api.run_job_calls == [] and api.sync_calls == []


@pytest.mark.parametrize(
    ("options", "trainer", "message"),
    [
        (["--flavor", "h300x9"], TRAINER, "--flavor 'h300x9' is not a Jobs flavor; known: cpu-basic"),
        (["--timeout", "soon"], TRAINER, "--timeout 'soon'"),
        (["--secret", "NOT-A-NAME"], TRAINER, "--secret 'NOT-A-NAME' is not an environment variable name"),
        ([], ["--harness", "opencode"], "trainer arguments: --model is required"),
        ([], [*TRAINER, "--vllm-url", "http://x"], "the launcher sets --vllm-url"),
        ([], [*TRAINER, "--sandbox", "moon"], "the trainer's --sandbox: unknown sandbox backend 'moon'"),
        (["--volume", "hf://org"], TRAINER, "--volume hf://org: Invalid HF URI"),
        (["--volume", "/no/such:/data"], TRAINER, "--volume /no/such:/data: /no/such is not a local folder"),
        (["--install", "torch==2.6"], TRAINER, "--install 'torch==2.6' is a requirement of another package"),
        (
            ["--install", "harness-trainer==0.2", "--extras", "e2b"],
            TRAINER,
            "--install 'harness-trainer==0.2'",
        ),
        (
            ["--install", "file:///tmp/x.whl"],
            TRAINER,
            "--install file:///tmp/x.whl: give a local wheel as a path",
        ),
        (["--extras", "e2b,no such"], TRAINER, "--extras 'no such' is not an extra's name"),
    ],
)
def test_bad_options_are_one_error_line_and_exit_2(
    options: list[str], trainer: list[str], message: str, submit: Submit, capsys: pytest.CaptureFixture[str]
) -> None:
    api = FakeHfApi()
    assert submit(*options, trainer=trainer, api=api, build=must_not_build) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
    assert api.run_job_calls == [] and api.sync_calls == []


def test_an_extra_the_wheel_does_not_provide_is_an_error_before_anything_is_uploaded(
    submit: Submit, project_wheel: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api = FakeHfApi()
    assert submit("--extras", "e2b,trian", api=api) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: --extras trian: {project_wheel.name} provides only ")
    assert "e2b" in line and "train" in line
    assert api.sync_calls == [] and api.run_job_calls == []


def test_a_bucket_volume_is_mounted_and_a_local_folder_is_synced_at_submit(
    submit: Submit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api = FakeHfApi()
    trainer = [*TRAINER, "--output-dir", "/outputs/run1"]
    volumes = ["--volume", "hf://buckets/org/runs:/outputs", "--volume", f"{tmp_path}:/opt/tasks"]
    assert submit(*volumes, "--install", GIT_URL, trainer=trainer, api=api) == 0
    assert "warning" not in capsys.readouterr().err
    assert api.sync_calls == [
        {
            "source": str(tmp_path),
            "mount_path": "/opt/tasks",
            "remote_name": None,
            "read_only": True,
            "namespace": None,
            "token": None,
        }
    ]
    bucket, synced = api.run_job_calls[0]["volumes"]
    assert isinstance(bucket, Volume)
    assert bucket.to_dict() == {"type": "bucket", "source": "org/runs", "mountPath": "/outputs"}
    assert synced.to_dict()["mountPath"] == "/opt/tasks"


def test_outputs_off_a_writable_volume_are_warned_about(
    submit: Submit, capsys: pytest.CaptureFixture[str]
) -> None:
    read_only = ["--volume", "hf://buckets/org/runs:/outputs:ro"]
    assert submit(*read_only, "--dry-run", trainer=[*TRAINER, "--output-dir", "/outputs/run1"]) == 0
    assert "warning: --output-dir /outputs/run1 is not on a writable volume" in capsys.readouterr().err


def test_a_hub_failure_is_one_line_without_any_secret_value(
    submit: Submit, capsys: pytest.CaptureFixture[str]
) -> None:
    api = FakeHfApi(error=RuntimeError(f"403 Forbidden for token {SECRETS['HF_TOKEN']}"))
    assert submit(api=api) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"error: the job was not submitted: 403 Forbidden for token {REDACTED}"


def test_a_huggingface_hub_that_cannot_expose_a_port_is_refused(
    submit: Submit, capsys: pytest.CaptureFixture[str]
) -> None:
    class OldHfApi:
        def run_job(self, *, image: str, command: list[str], secrets: dict[str, Any] | None = None) -> None:
            raise AssertionError("must not be called")

    assert submit(api=OldHfApi()) == 1
    assert "cannot expose a job's port publicly" in capsys.readouterr().err


def test_the_thin_script_dry_runs_like_the_cli(project_wheel: Path) -> None:
    options = ["--dataset", "org/tasks", "--install", str(project_wheel), "--dry-run"]
    result = subprocess.run(
        [sys.executable, "examples/jobs/submit.py", *options, "--", *TRAINER],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", **SECRETS},
    )
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)
    assert spec["secrets"] == {"HF_TOKEN": REDACTED, "E2B_API_KEY": REDACTED}
    assert (spec["install"]["source"], spec["install"]["wheel"]) == ("wheel", project_wheel.name)
    assert no_secret_in(result.stdout + result.stderr)


def test_importing_the_submission_loads_neither_huggingface_hub_nor_torch() -> None:
    program = (
        "import sys, harness_trainer.jobs.submit\n"
        "print([m for m in ('huggingface_hub', 'torch', 'transformers', 'aiohttp') if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr
