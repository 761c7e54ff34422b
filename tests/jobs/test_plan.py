"""The job launcher's plan, built without starting anything: flags, GPU split, secrets, the public URL."""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import HfApi

from harness_trainer.jobs.job_launcher import build_parser, discover_public_url
from harness_trainer.jobs.plan import (
    SECRET_ROUTES,
    LaunchPlan,
    build_plan,
    secret_names,
    step_env,
    trainer_settings,
)
from harness_trainer.jobs.process_supervisor import LaunchError
from harness_trainer.sandboxes import capabilities
from tests.jobs.conftest import SECRETS, FakeHfApi

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = [sys.executable, "-m", "harness_trainer.jobs.job_launcher"]


def plan_for(
    *trainer_args: str, options: tuple[str, ...] = (), environ: dict[str, str] | None = None, url=None
) -> LaunchPlan:
    """The plan for local sandboxes (unless ``trainer_args`` say otherwise: the last flag wins)."""
    parsed = build_parser().parse_args(["--dataset", "org/tasks", *options])
    return build_plan(
        parsed, ["--model", "org/model", "--sandbox", "local", *trainer_args], environ or {}, url
    )


def test_trainer_settings_read_what_the_launcher_needs_and_default_like_the_trainer() -> None:
    settings = trainer_settings(["--harness", "opencode", "--model=org/m", "--max-concurrent-rollouts", "16"])
    assert (settings.model, settings.max_concurrent_rollouts, settings.lora) == ("org/m", 16, False)
    assert trainer_settings(["--model", "m", "--lora", "--sandbox", "local"]).lora


def test_trainer_settings_are_the_trainer_launchers_resolved_options(tmp_path) -> None:
    from harness_trainer.launch.harbor_run import resolve

    args, config = resolve(["--model", "m"])
    settings = trainer_settings(["--model", "m"])
    assert settings.sandbox == args.sandbox == "e2b"
    assert settings.max_concurrent_rollouts == config.max_concurrent_rollouts
    assert settings.lora is config.use_peft is False
    assert settings.output_dir == config.output_dir
    run = tmp_path / "run.yaml"
    run.write_text(
        "run: {model: org/m, sandbox: local}\ntrainer: {use_peft: true, max_concurrent_rollouts: 3}\n"
    )
    from_file = trainer_settings(["--config", str(run), "--max-concurrent-rollouts", "5"])
    assert (from_file.model, from_file.sandbox, from_file.lora, from_file.max_concurrent_rollouts) == (
        "org/m",
        "local",
        True,
        5,
    )


def test_trainer_arguments_without_a_model_are_refused() -> None:
    with pytest.raises(LaunchError, match="--model is required"):
        trainer_settings(["--harness", "opencode"])


def test_trainer_arguments_the_trainer_refuses_are_refused_before_the_job() -> None:
    with pytest.raises(LaunchError, match="unrecognized arguments: --no-such-flag"):
        trainer_settings(["--model", "m", "--no-such-flag"])
    with pytest.raises(LaunchError, match="num_generations must be at least 2"):
        trainer_settings(["--model", "m", "--num-generations", "1"])


@pytest.mark.parametrize("flag", ["--server", "--vllm-url"])
def test_trainer_arguments_may_not_set_what_the_launcher_sets(flag: str) -> None:
    with pytest.raises(LaunchError, match=f"launcher sets {flag}"):
        trainer_settings(["--model", "m", flag, "http://elsewhere"])


def test_vllm_is_started_with_every_flag_and_setting_of_the_gpu_checks_doc() -> None:
    doc = (ROOT / "docs/gpu-checks.md").read_text()
    block = re.search(r"## Start vLLM\n\n```bash\n(.*?)```", doc, re.S)
    assert block is not None
    words = shlex.split(block.group(1).replace("\\\n", " "))
    plan = plan_for("--lora")
    argv = plan.vllm.argv
    flags = {word for word in words if word.startswith("--")} - {"--dtype"}  # the run's choice: --vllm-arg
    assert flags <= set(argv)
    for flag in ("--logprobs-mode", "--weight-transfer-config"):
        assert argv[argv.index(flag) + 1] == words[words.index(flag) + 1]
    for setting in (word for word in words if word.startswith("VLLM_")):
        key, value = setting.split("=")
        assert plan.vllm.env[key] == value
    assert argv[argv.index("--host") + 1] == "127.0.0.1"  # dev-mode routes replace weights: never exposed


def test_without_lora_vllm_gets_no_lora_flags() -> None:
    plan = plan_for()
    assert "--enable-lora" not in plan.vllm.argv
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plan.vllm.env


def test_the_gpus_are_split_between_vllm_and_the_trainer() -> None:
    plan = plan_for(options=("--gpus", "4", "--vllm-gpus", "0,1", "--trainer-gpus", "2,3"))
    assert plan.vllm.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert plan.vllm.argv[plan.vllm.argv.index("--tensor-parallel-size") + 1] == "2"
    assert plan.trainer.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert plan.serve.env["CUDA_VISIBLE_DEVICES"] == ""
    assert "--tensor-parallel-size" not in plan_for().vllm.argv


def test_the_server_holds_one_session_more_than_the_trainers_concurrency() -> None:
    assert plan_for("--max-concurrent-rollouts", "32").serve.env["MAX_CONCURRENT_ENVS"] == "33"
    assert plan_for(options=("--max-concurrent-envs", "50")).serve.env["MAX_CONCURRENT_ENVS"] == "50"
    with pytest.raises(LaunchError, match="< --max-concurrent-rollouts \\+ 1 = 9"):
        plan_for(options=("--max-concurrent-envs", "8"))


def test_capture_journals_go_under_the_trainers_output_dir() -> None:
    argv = plan_for("--output-dir", "/outputs/run1").serve.argv
    assert argv[argv.index("--data-dir") + 1] == "/outputs/run1/capture"


def test_remote_sandboxes_need_a_public_url_and_get_a_warm_up_of_their_own_backend() -> None:
    with pytest.raises(
        LaunchError, match="--sandbox e2b runs agents on another machine, so they need a public URL"
    ):
        plan_for("--sandbox", "e2b")
    plan = plan_for("--sandbox", "e2b", url="https://abc--8300.hf.jobs")
    assert plan.warm is not None and "https://abc--8300.hf.jobs" in plan.warm.argv
    assert plan.warm.argv[plan.warm.argv.index("--sandbox") + 1] == "e2b"
    assert plan_for().warm is None


def test_an_unknown_sandbox_is_a_launch_error_naming_the_known_ones() -> None:
    with pytest.raises(LaunchError, match="unknown sandbox backend 'docker2'; known: docker, e2b, hf, local"):
        plan_for("--sandbox", "docker2")


def test_the_capture_proxy_binds_all_interfaces_only_when_it_has_a_public_url() -> None:
    def capture_host(plan) -> str:
        return plan.serve.argv[plan.serve.argv.index("--capture-host") + 1]

    assert capture_host(plan_for()) == "127.0.0.1"
    assert capture_host(plan_for(url="https://abc--8300.hf.jobs")) == "0.0.0.0"


def test_secrets_are_routed_by_name_and_scrubbed_from_every_other_process() -> None:
    environ = {**SECRETS, "HT_SECRET_NAMES": "HF_TOKEN,E2B_API_KEY,WANDB_API_KEY", "PATH": "/bin"}
    plan = plan_for("--sandbox", "e2b", environ=environ, url="https://x")
    assert plan.secret_names == ["HF_TOKEN", "E2B_API_KEY", "WANDB_API_KEY"]
    assert plan.warm is not None
    routes = {step.name: set(step.secrets) for step in (plan.vllm, plan.serve, plan.warm, plan.trainer)}
    assert routes == {
        "vllm": {"HF_TOKEN"},
        "serve": {"HF_TOKEN", "E2B_API_KEY"},
        "warm": {"E2B_API_KEY"},
        "trainer": {"HF_TOKEN", "WANDB_API_KEY"},
    }
    env = step_env(plan.vllm, environ, plan.secret_names)
    assert env["PATH"] == "/bin" and env["HF_TOKEN"] == SECRETS["HF_TOKEN"]
    assert "E2B_API_KEY" not in env and "WANDB_API_KEY" not in env


def test_a_hub_token_that_is_also_a_sandbox_credential_keeps_every_route() -> None:
    # HF_TOKEN is the hf backend's credential too: that adds the steps where sandboxes start, and takes
    # none of the Hub's away (vLLM and the trainer load from the Hub).
    assert "HF_TOKEN" in capabilities("hf").credentials
    assert set(SECRET_ROUTES["HF_TOKEN"]) == {"vllm", "serve", "trainer", "warm"}
    environ = {**SECRETS, "HT_SECRET_NAMES": "HF_TOKEN,E2B_API_KEY,WANDB_API_KEY"}
    plan = plan_for("--sandbox", "hf", environ=environ, url="https://x")
    assert plan.warm is not None
    assert plan.warm.argv[plan.warm.argv.index("--sandbox") + 1] == "hf"
    routes = {step.name: set(step.secrets) for step in (plan.vllm, plan.serve, plan.warm, plan.trainer)}
    assert routes == {
        "vllm": {"HF_TOKEN"},
        "serve": {"HF_TOKEN", "E2B_API_KEY"},
        "warm": {"HF_TOKEN"},  # its own backend's credential only
        "trainer": {"HF_TOKEN", "WANDB_API_KEY"},
    }
    for step in (plan.vllm, plan.trainer):
        assert step_env(step, environ, plan.secret_names)["HF_TOKEN"] == SECRETS["HF_TOKEN"]


def test_known_secrets_are_scrubbed_even_when_not_listed() -> None:
    assert secret_names({"E2B_API_KEY": "k"}) == ["E2B_API_KEY"]
    plan = plan_for(environ={"E2B_API_KEY": "k"})
    assert "E2B_API_KEY" not in step_env(plan.trainer, {"E2B_API_KEY": "k"}, plan.secret_names)


def test_the_fakes_signatures_are_the_installed_huggingface_hubs() -> None:
    def shape(function: object) -> list[tuple[str, object, object]]:
        parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
        return [(p.name, p.kind, p.default) for p in parameters]

    for method in ("run_job", "sync_job_volume", "list_jobs"):
        assert shape(getattr(FakeHfApi, method)) == shape(getattr(HfApi, method)), method


def _job(job_id: str, run_id: str, urls: list[str] | None) -> SimpleNamespace:
    status = SimpleNamespace(stage="RUNNING", expose_urls=urls)
    return SimpleNamespace(id=job_id, labels={"harness-trainer-run": run_id}, status=status)


def test_the_public_url_is_the_one_the_jobs_api_lists_for_the_capture_port() -> None:
    api = FakeHfApi(
        jobs=[
            _job("other", "run-2", ["https://other--8300.hf.jobs"]),
            _job("abc", "run-1", ["https://abc--8000.hf.jobs", "https://abc--8300.hf.jobs/"]),
        ]
    )
    assert discover_public_url("run-1", 8300, namespace="org", api=api) == "https://abc--8300.hf.jobs"
    (call,) = api.list_calls
    assert (call["labels"], call["namespace"]) == ({"harness-trainer-run": "run-1"}, "org")


def test_a_job_that_lists_no_url_yet_gets_the_jobs_proxy_name_for_the_port() -> None:
    api = FakeHfApi(jobs=[_job("abc", "run-1", None)])
    assert discover_public_url("run-1", 8300, api=api) == "https://abc--8300.hf.jobs"


def test_no_job_with_the_run_label_is_a_clear_error_after_bounded_tries() -> None:
    api = FakeHfApi()
    with pytest.raises(LaunchError, match=r"no job labelled harness-trainer-run=run-9 .*--public-url"):
        discover_public_url("run-9", 8300, api=api, attempts=3, delay_s=0)
    assert len(api.list_calls) == 3


def test_the_dry_run_prints_the_plan_with_secret_names_and_no_values() -> None:
    env = {**os.environ, **SECRETS, "HT_SECRET_NAMES": ",".join(SECRETS), "HT_RUN_ID": "run-1"}
    result = subprocess.run(
        [*LAUNCHER, "--dataset", "org/tasks", "--dry-run", "--", "--model", "org/m", "--sandbox", "e2b"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["public_url"] == "https://<job id>--8300.hf.jobs"
    assert plan["warm"]["secrets"] == ["E2B_API_KEY"]
    assert not any(value in result.stdout + result.stderr for value in SECRETS.values())


def test_the_dry_run_for_hf_sandboxes_plans_their_warm_up_with_the_hub_token_alone() -> None:
    # A job `jobs submit` made for --sandbox hf: its one secret is HF_TOKEN, no E2B key anywhere.
    env = {
        key: value for key, value in os.environ.items() if key not in SECRETS and not key.startswith("HT_")
    }
    env |= {"HF_TOKEN": SECRETS["HF_TOKEN"], "HT_SECRET_NAMES": "HF_TOKEN", "HT_RUN_ID": "run-1"}
    argv = [*LAUNCHER, "--dataset", "org/tasks", "--warm-image", "org/probe:1", "--dry-run"]
    result = subprocess.run(
        [*argv, "--", "--model", "org/m", "--sandbox", "hf"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    url = "https://<job id>--8300.hf.jobs"
    assert plan["public_url"] == url and plan["secret_names"] == ["HF_TOKEN"]
    assert plan["warm"]["argv"][-8:] == [
        *("--public-url", url, "--sandbox", "hf"),
        *("--template", "base", "--image", "org/probe:1"),  # each backend takes its own of the two
    ]
    steps = ("vllm", "serve", "warm", "trainer")
    assert {step: plan[step]["secrets"] for step in steps} == {step: ["HF_TOKEN"] for step in steps}
    serve = plan["serve"]["argv"]
    assert serve[serve.index("--public-url") + 1] == url and serve[serve.index("--run-id") + 1] == "run-1"
    assert serve[serve.index("--capture-host") + 1] == "0.0.0.0"
    assert "E2B_API_KEY" not in result.stdout and SECRETS["HF_TOKEN"] not in result.stdout


def test_bad_trainer_arguments_are_one_error_line_and_exit_2() -> None:
    result = subprocess.run(
        [*LAUNCHER, "--dataset", "d", "--", "--harness", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: trainer arguments: --model is required (or run.model in a --config file)"
    ]


@pytest.mark.parametrize(
    ("option", "usage"),
    [
        ("--serve-command", "harness-trainer serve"),
        ("--trainer-command", "Async GRPO on Harbor tasks"),
        ("--accelerate-command", "--use_fsdp"),
        ("--warm-command", "The job's warm-up"),
    ],
)
def test_the_default_commands_run_what_they_name(option: str, usage: str) -> None:
    command = build_parser().get_default(option[2:].replace("-", "_"))
    result = subprocess.run([*shlex.split(command), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert usage in result.stdout
