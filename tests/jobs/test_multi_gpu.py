"""Several GPUs: the split between vLLM and the trainer, its errors, the dry runs, and the launch examples
(rendered with ``DRY_RUN=1`` and checked argument by argument against the plan)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from huggingface_hub import JobHardware

from harness_trainer.jobs import job_launcher
from harness_trainer.jobs.gpus import (
    FSDP2_ENV,
    FSDP2_LAUNCH_FLAGS,
    TRAINER_MODULE,
    GpuSplit,
    GpuSplitError,
    attention_heads,
    flavor_gpus,
    split_gpus,
)
from harness_trainer.jobs.plan import VLLM_FLAGS, LaunchPlan, build_plan, trainer_settings
from harness_trainer.jobs.submit import add_submit_arguments, run_submit
from harness_trainer.launch.harbor_run import build_config, parse_args
from tests.jobs.conftest import alive, wait_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "launch"
ONE_NODE = EXAMPLES / "torchrun_one_node.sh"
SLURM = EXAMPLES / "slurm_multi_node.sbatch"
ACCELERATE = [*shlex.split(job_launcher.build_parser().get_default("accelerate_command"))]


def plan_for(*options: str, trainer: tuple[str, ...] = (), model: str = "org/model") -> LaunchPlan:
    parsed = job_launcher.build_parser().parse_args(["--dataset", "org/tasks", *options])
    return build_plan(parsed, ["--model", model, "--sandbox", "local", *trainer], {}, None)


def model_folder(tmp_path: Path, heads: int, *, nested: bool = False) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"text_config": {"num_attention_heads": heads}} if nested else {"num_attention_heads": heads}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


# -- flavors and splits ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flavor", "gpus"),
    [
        ("cpu-basic", 0),
        ("t4-small", 1),
        ("a100-large", 1),
        ("h200", 1),
        ("l4x1", 1),
        ("a10g-largex2", 2),
        ("h200x2", 2),
        ("l4x4", 4),
        ("l40sx4", 4),
        ("a100x4", 4),
        ("h200x4", 4),
        ("a100x8", 8),
        ("l40sx8", 8),
        ("h200x8", 8),
        ("rtx-pro-6000x8", 8),
    ],
)
def test_a_flavors_gpus_are_read_from_its_name(flavor: str, gpus: int) -> None:
    assert flavor in {hardware.value for hardware in JobHardware}  # a flavor the Hub knows
    assert flavor_gpus(flavor) == gpus


def test_on_four_gpus_vllm_takes_the_first_k_and_the_trainer_the_rest_with_fsdp2() -> None:
    split = split_gpus(4, vllm_gpu_count=2)
    assert (split.vllm, split.trainer, split.idle) == ([0, 1], [2, 3], [])
    assert split.vllm_args() == ["--tensor-parallel-size", "2"]
    assert split.trainer_sharding == "fsdp2"
    assert split.launch_args() == ["--num_processes", "2", "--num_machines", "1", *FSDP2_LAUNCH_FLAGS]
    assert (
        split.summary == "4 GPUs: vLLM on GPUs 0,1, tensor parallel 2; trainer on GPUs 2,3 (2 ranks, FSDP2)"
    )


def test_on_eight_gpus_vllm_may_run_data_parallel_and_lora_trains_with_ddp() -> None:
    split = split_gpus(8, vllm_gpu_count=4, parallel="data", lora=True)
    assert (split.vllm, split.trainer) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert split.vllm_args() == ["--data-parallel-size", "4"]
    # The trainer refuses LoRA under accelerate's FSDP (distributed.prepare): several ranks replicate it.
    assert split.launch_args() == ["--num_processes", "4", "--num_machines", "1", "--multi_gpu"]
    assert split.heads_check == "no tensor parallelism: nothing to check"
    assert (
        split.summary
        == "8 GPUs: vLLM on GPUs 0,1,2,3, data parallel 4; trainer on GPUs 4,5,6,7 (4 ranks, DDP)"
    )


def test_explicit_gpu_lists_may_leave_gpus_idle_and_one_trainer_gpu_is_one_process() -> None:
    split = split_gpus(8, vllm_gpus="6,7", trainer_gpus="0")
    assert (split.vllm, split.trainer, split.idle, split.trainer_sharding) == (
        [6, 7],
        [0],
        [1, 2, 3, 4, 5],
        "none",
    )
    assert split.launch_args() == []
    assert split.summary.endswith("trainer on GPU 0 (1 process); idle GPUs 1,2,3,4,5")
    assert split_gpus(2).vllm_args() == []  # one vLLM GPU: no parallel flag


@pytest.mark.parametrize(
    ("total", "options", "message"),
    [
        (1, {}, "vLLM and the trainer need a GPU each: this machine has 1 \\(at least 2\\)"),
        (0, {}, "this machine has 0"),
        (4, {"vllm_gpu_count": 0}, "--vllm-gpu-count 0: vLLM needs at least 1 of the 4 GPUs"),
        (4, {"vllm_gpu_count": 4}, "--vllm-gpu-count 4: .* so 1 to 3"),
        (4, {"vllm_gpus": "0,1", "vllm_gpu_count": 2}, "give --vllm-gpus or --vllm-gpu-count, not both"),
        (4, {"vllm_gpus": "0,1", "trainer_gpus": "1,2"}, "--vllm-gpus and --trainer-gpus share GPU 1"),
        (4, {"vllm_gpus": "0,1,2,3"}, "--trainer-gpus: empty"),
        (4, {"vllm_gpus": "", "trainer_gpus": "1"}, "--vllm-gpus: empty"),
        (
            4,
            {"vllm_gpus": "0", "trainer_gpus": "1,4"},
            "--trainer-gpus: GPU 4 is not on this machine, which has 4",
        ),
        (8, {"vllm_gpus": "8"}, "--vllm-gpus: GPU 8 is not on this machine, which has 8 \\(0 to 7\\)"),
        (4, {"vllm_gpus": "0,0"}, "--vllm-gpus '0,0': each GPU once"),
        (4, {"vllm_gpus": "gpu0"}, "--vllm-gpus 'gpu0': expected comma-separated GPU numbers"),
        (
            8,
            {"vllm_gpu_count": 3, "heads": 32, "model": "org/m"},
            "size 3 does not divide org/m's 32 attention",
        ),
    ],
)
def test_a_split_that_cannot_work_is_refused(total: int, options: dict, message: str) -> None:
    with pytest.raises(GpuSplitError, match=message):
        split_gpus(total, **options)


def test_tensor_parallel_is_checked_against_the_heads_of_a_local_model(tmp_path: Path) -> None:
    model = model_folder(tmp_path, 12)
    assert attention_heads(model) == 12
    with pytest.raises(GpuSplitError, match=f"tensor-parallel size 8 does not divide {model}'s 12 attention"):
        plan_for("--gpus", "16", "--vllm-gpu-count", "8", model=model)
    plan = plan_for("--gpus", "8", "--vllm-gpu-count", "4", model=model)
    assert plan.gpus.heads_check == f"tensor-parallel size 4 divides {model}'s 12 attention heads"
    # Data parallel copies the whole model on each GPU: the heads do not matter.
    assert plan_for("--gpus", "16", "--vllm-gpu-count", "8", "--vllm-parallel", "data", model=model)


def test_the_heads_of_a_cached_hub_model_are_read_and_an_unknown_model_is_said_unchecked(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"text_config": {"num_attention_heads": 40}}))
    (cache / "models--org--cached" / "refs").mkdir()
    (cache / "models--org--cached" / "refs" / "main").write_text("abc123")
    assert attention_heads("org/cached", cache_dir=cache) == 40
    assert attention_heads(model_folder(tmp_path, 8, nested=True)) == 8
    assert attention_heads("org/not-cached", cache_dir=cache) is None
    assert attention_heads("not a repo id!", cache_dir=cache) is None
    split = split_gpus(4, vllm_gpu_count=2, heads=None, model="org/not-cached")
    assert split.heads_check.startswith("not checked: org/not-cached's config.json is not a local folder's")


# -- the launcher's plan and dry run -----------------------------------------------------------------


def test_the_plan_gives_vllm_its_gpus_and_the_trainer_its_ranks_under_accelerate() -> None:
    plan = plan_for("--gpus", "8", "--vllm-gpu-count", "4", trainer=("--harness", "opencode"))
    assert plan.vllm.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert plan.vllm.argv[-2:] == ["--tensor-parallel-size", "4"]
    assert plan.trainer.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    launch = [*ACCELERATE, "--num_processes", "4", "--num_machines", "1", *FSDP2_LAUNCH_FLAGS]
    assert plan.trainer.argv[: len(launch) + 2] == [*launch, "-m", TRAINER_MODULE]
    assert plan.trainer.argv[len(launch) + 2 :] == [
        "--model",
        "org/model",
        "--sandbox",
        "local",
        "--harness",
        "opencode",
        "--server",
        "http://127.0.0.1:8200",
        "--vllm-url",
        "http://127.0.0.1:8000",
    ]
    assert plan.serve.env["CUDA_VISIBLE_DEVICES"] == ""


def test_one_trainer_gpu_keeps_the_one_process_trainer_command() -> None:
    plan = plan_for()
    assert plan.trainer.argv[:3] == shlex.split(job_launcher.build_parser().get_default("trainer_command"))
    assert plan.trainer.argv[1:3] == ["-m", TRAINER_MODULE]
    assert (plan.vllm.env["CUDA_VISIBLE_DEVICES"], plan.trainer.env["CUDA_VISIBLE_DEVICES"]) == ("0", "1")


def test_the_launchers_dry_run_shows_the_split(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--dataset", "org/tasks", "--gpus", "8", "--vllm-gpu-count", "2", "--dry-run"]
    assert job_launcher.main([*argv, "--", "--model", "org/m", "--sandbox", "local"]) == 0
    gpus = json.loads(capsys.readouterr().out)["gpus"]
    assert (
        gpus["summary"]
        == "8 GPUs: vLLM on GPUs 0,1, tensor parallel 2; trainer on GPUs 2,3,4,5,6,7 (6 ranks, FSDP2)"
    )
    assert (gpus["vllm"], gpus["trainer"], gpus["trainer_sharding"]) == ([0, 1], [2, 3, 4, 5, 6, 7], "fsdp2")
    assert gpus["heads_check"].startswith("not checked: org/m's config.json")


def test_a_bad_split_is_one_error_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--dataset",
        "d",
        "--gpus",
        "4",
        "--vllm-gpu-count",
        "4",
        "--",
        "--model",
        "m",
        "--sandbox",
        "local",
    ]
    assert job_launcher.main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --vllm-gpu-count 4: vLLM needs at least 1 of the 4 GPUs and the trainer the rest, so 1 to 3"
    ]


def test_fsdp2_env_is_what_accelerate_launch_sets_for_the_fsdp2_flags() -> None:
    # accelerate's own steps from its command line to the ranks' environment (launch_command's first two).
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    def launched_env(split: GpuSplit) -> dict[str, str]:
        args = launch_command_parser().parse_args(
            [*split.launch_args(), "-m", TRAINER_MODULE, "--model", "m"]
        )
        return prepare_multi_gpu_env(_validate_launch_command(args)[0])

    env = launched_env(split_gpus(4, vllm_gpu_count=2))
    assert {key: env[key] for key in FSDP2_ENV} == FSDP2_ENV
    assert "ACCELERATE_USE_FSDP" not in launched_env(split_gpus(4, vllm_gpu_count=2, lora=True))


# -- jobs submit ---------------------------------------------------------------------------------------


def submit(*options: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    add_submit_arguments(parser)
    trainer = ["--", "--model", "org/m", "--sandbox", "local"]
    args = parser.parse_args(
        ["--dataset", "org/tasks", "--install", "harness-trainer==0.2.0", *options, *trainer]
    )
    code = run_submit(args, api=object(), build=None)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_submit_splits_the_flavors_gpus_shows_it_and_passes_the_count_to_the_launcher(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    options = ("--flavor", "a100x8", "--vllm-gpu-count", "4", "--vllm-parallel", "data", "--dry-run")
    code, out, err = submit(*options, capsys=capsys)
    assert code == 0, err
    spec = json.loads(out)
    assert spec["gpus"]["summary"] == (
        "8 GPUs: vLLM on GPUs 0,1,2,3, data parallel 4; trainer on GPUs 4,5,6,7 (4 ranks, FSDP2)"
    )
    launcher = shlex.split(spec["command"][2].split(" && exec ")[1])
    options_part = launcher[: launcher.index("--")]
    assert options_part[options_part.index("--gpus") + 1] == "8"
    parsed = job_launcher.build_parser().parse_args(options_part[3:])
    assert (parsed.gpus, parsed.vllm_gpu_count, parsed.vllm_parallel, parsed.vllm_gpus) == (
        8,
        4,
        "data",
        None,
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ("--flavor", "l4x1"),
            "error: --flavor l4x1: vLLM and the trainer need a GPU each: this machine has 1",
        ),
        (("--flavor", "h200x4", "--vllm-gpu-count", "4"), "error: --flavor h200x4: --vllm-gpu-count 4:"),
        (
            ("--flavor", "h200x2", "--vllm-gpus", "0", "--trainer-gpus", "2"),
            "error: --flavor h200x2: --trainer-gpus: GPU 2",
        ),
    ],
)
def test_submit_refuses_a_split_the_flavor_cannot_hold(
    options: tuple[str, ...],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    code, _, err = submit(*options, "--dry-run", capsys=capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


# -- the launch examples -------------------------------------------------------------------------------


def render(script: Path, env: dict[str, str], *trainer_args: str) -> dict[str, list[str]]:
    """The script's commands, by name, as it prints them with ``DRY_RUN=1`` (after a syntax check)."""
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    full = {"PATH": os.environ["PATH"], "DRY_RUN": "1", "MODEL": "org/m", "DATASET": "org/tasks", **env}
    result = subprocess.run(
        ["bash", str(script), *trainer_args], env=full, capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    commands = {}
    for line in result.stdout.splitlines():
        name, _, command = line.partition(":")
        commands[name] = shlex.split(command)
    return commands


def environment(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """``env A=B ... COMMAND`` split into its variables and the command."""
    start = argv.index("env") + 1
    end = start
    while "=" in argv[end] and not argv[end].startswith("-"):
        end += 1
    return dict(word.split("=", 1) for word in argv[start:end]), argv[end:]


def after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize(("gpus", "k", "parallel"), [(4, 2, "tensor"), (8, 4, "data"), (8, 1, "tensor")])
def test_the_one_node_example_launches_what_the_plan_launches(gpus: int, k: int, parallel: str) -> None:
    trainer_args = ("--harness", "opencode", "--max-steps", "5")
    commands = render(
        ONE_NODE, {"GPUS": str(gpus), "VLLM_GPUS": str(k), "VLLM_PARALLEL": parallel}, *trainer_args
    )
    assert list(commands) == ["vllm", "serve", "trainer"]
    output = "outputs/torchrun-one-node"
    plan = plan_for(
        "--gpus",
        str(gpus),
        "--vllm-gpu-count",
        str(k),
        "--vllm-parallel",
        parallel,
        trainer=("--max-concurrent-rollouts", "8", "--output-dir", output, *trainer_args),
        model="org/m",
    )

    env, vllm = environment(commands["vllm"])
    assert env == {"CUDA_VISIBLE_DEVICES": plan.vllm.env["CUDA_VISIBLE_DEVICES"], "VLLM_SERVER_DEV_MODE": "1"}
    assert (
        vllm[:4] == ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model"] and vllm[4] == "org/m"
    )
    # Host, port, VLLM_FLAGS, the tool-call parser and the parallel flag: the plan's, in its order.
    assert vllm[vllm.index("--host") :] == plan.vllm.argv[plan.vllm.argv.index("--host") :]
    assert " ".join(VLLM_FLAGS) in " ".join(vllm)

    env, serve = environment(commands["serve"])
    assert env == {"CUDA_VISIBLE_DEVICES": "", "MAX_CONCURRENT_ENVS": plan.serve.env["MAX_CONCURRENT_ENVS"]}
    assert serve[:4] == ["python3", "-m", "harness_trainer.cli", "serve"]
    assert serve[4:] == plan.serve.argv[plan.serve.argv.index("--dataset") :]

    env, trainer = environment(commands["trainer"])
    assert env == {"CUDA_VISIBLE_DEVICES": plan.trainer.env["CUDA_VISIBLE_DEVICES"], **FSDP2_ENV}
    ranks = gpus - k
    assert trainer[:6] == ["torchrun", "--standalone", "--nproc_per_node", str(ranks), "-m", TRAINER_MODULE]
    assert len(plan.gpus.trainer) == ranks
    assert trainer[-4:] == plan.trainer.argv[-4:]  # --server and --vllm-url, the launcher's
    settings = trainer_settings(trainer[6:-4])  # what the trainer is given, checked by its own parser
    assert (settings.model, settings.sandbox, settings.max_concurrent_rollouts) == ("org/m", "local", 8)


def test_the_one_node_example_trains_lora_with_ddp_and_refuses_a_split_with_no_trainer_gpu() -> None:
    commands = render(ONE_NODE, {"GPUS": "4", "VLLM_GPUS": "2", "SHARDING": "ddp"}, "--lora")
    env, _ = environment(commands["trainer"])
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    for bad, message in [
        ({"GPUS": "4", "VLLM_GPUS": "4"}, "error: VLLM_GPUS=4: 1 to 3 of the 4 GPUs"),
        ({"GPUS": "1"}, "error: GPUS=1: vLLM and the trainer need a GPU each"),
        ({"GPUS": "4", "VLLM_PARALLEL": "pipeline"}, "error: VLLM_PARALLEL=pipeline: tensor or data"),
    ]:
        full = {"PATH": os.environ["PATH"], "DRY_RUN": "1", "MODEL": "m", "DATASET": "d", **bad}
        result = subprocess.run(["bash", str(ONE_NODE)], env=full, capture_output=True, text=True, timeout=30)
        assert (result.returncode, result.stderr.strip()) == (2, message)


def test_the_slurm_example_puts_replicas_on_some_nodes_and_trainer_ranks_on_the_others() -> None:
    hosts = {"NODE_HOSTS": "n1 n2 n3 n4", "VLLM_NODES": "2", "GPUS_PER_NODE": "8", "SLURM_JOB_ID": "77"}
    commands = render(SLURM, hosts, "--harness", "opencode")
    assert list(commands) == ["vllm@n1", "vllm@n2", "serve", "trainer"]
    plan = plan_for("--gpus", "16", "--vllm-gpu-count", "8", model="org/m")
    for host in ("n1", "n2"):
        argv = commands[f"vllm@{host}"]
        assert argv[: argv.index("env")] == [
            "srun",
            "--overlap",
            "--nodes=1",
            "--ntasks-per-node=1",
            f"--nodelist={host}",
        ]
        env, vllm = environment(argv)
        assert env == {"VLLM_SERVER_DEV_MODE": "1"}
        assert (
            after(vllm, "--model") == "org/m" and after(vllm, "--host") == "0.0.0.0"
        )  # reached from other nodes
        # From the port on (VLLM_FLAGS, parser, one replica tensor parallel over its node): the plan's.
        assert vllm[vllm.index("--port") :] == plan.vllm.argv[plan.vllm.argv.index("--port") :]

    argv = commands["serve"]
    assert after(argv, "--overlap") == "--nodes=1" and "--nodelist=n3" in argv  # the first trainer node
    env, serve = environment(argv)
    assert env == {"CUDA_VISIBLE_DEVICES": "", "MAX_CONCURRENT_ENVS": "9"}
    upstreams = [serve[i + 1] for i, word in enumerate(serve) if word == "--upstream"]
    assert upstreams == ["http://n1:8000", "http://n2:8000"] and "--replicas" in serve
    # The trainer's rank 0 drains a replica at the capture proxy, from another node, with the admin key
    # the script exported (on no command line).
    assert after(serve, "--capture-host") == "0.0.0.0" and "--capture-admin-key" not in serve

    argv = commands["trainer"]
    assert argv[: argv.index("env")] == [
        "srun",
        "--overlap",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--nodelist=n3,n4",
    ]
    env, trainer = environment(argv)
    assert env == FSDP2_ENV
    module = trainer.index("-m")
    torchrun = trainer[:module]
    assert torchrun[0] == "torchrun"
    assert (after(torchrun, "--nnodes"), after(torchrun, "--nproc_per_node")) == ("2", "8")
    assert (after(torchrun, "--rdzv_endpoint"), after(torchrun, "--rdzv_id")) == ("n3:29500", "77")
    assert trainer[module + 1] == TRAINER_MODULE
    assert trainer[-4:] == ["--server", "http://n3:8200", "--vllm-url", "http://n1:8000"]
    settings = trainer_settings(trainer[module + 2 : -4])
    assert (settings.model, settings.max_concurrent_rollouts) == ("org/m", 8)
    # Every replica gets each step's weights: the first by --vllm-url, the others as replicas.
    config = build_config(parse_args(trainer[module + 2 :]))
    assert config.vllm_server_base_url == "http://n1:8000" and config.vllm_replica_urls == ["http://n2:8000"]
    assert config.replica_proxy_url == "http://n3:8300"


def test_the_slurm_example_with_one_replica_needs_no_replica_routing_and_refuses_one_node() -> None:
    commands = render(SLURM, {"NODE_HOSTS": "a b", "GPUS_PER_NODE": "4", "VLLM_PARALLEL": "data"})
    _, vllm = environment(commands["vllm@a"])
    assert vllm[-2:] == ["--data-parallel-size", "4"]
    _, serve = environment(commands["serve"])
    assert "--replicas" not in serve and after(serve, "--upstream") == "http://a:8000"
    assert after(serve, "--capture-host") == "127.0.0.1"
    _, trainer = environment(commands["trainer"])
    assert "--vllm-replica-urls" not in trainer and "--replica-proxy-url" not in trainer
    full = {"PATH": os.environ["PATH"], "DRY_RUN": "1", "MODEL": "m", "DATASET": "d", "NODE_HOSTS": "solo"}
    result = subprocess.run(["bash", str(SLURM)], env=full, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "error: 1 node: vLLM and the trainer need a node each (sbatch --nodes=2 or more)"
    )


def fake_bin(folder: Path, **scripts: str) -> str:
    """A PATH whose first folder holds the given executables (bash bodies), then the system's."""
    folder.mkdir()
    for name, body in scripts.items():
        (folder / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (folder / name).chmod(0o755)
    return f"{folder}:{os.environ['PATH']}"


@pytest.mark.slow
def test_the_one_node_example_runs_the_trainer_in_the_foreground_and_stops_the_services_after(
    tmp_path: Path,
) -> None:
    pids, checks = tmp_path / "pids", tmp_path / "checks"
    # The n-th health check answers once the n-th service runs (has written its pid), as a real one would:
    # the script may not start the trainer, nor stop the services, before each one is up.
    answer_once_up = (
        f'n=$(( $(cat {checks} 2>/dev/null || echo 0) + 1 )); echo "$n" > {checks}; '
        f'for _ in $(seq 100); do [ "$(cat {pids} 2>/dev/null | wc -l)" -ge "$n" ] && exit 0; sleep 0.1; done'
    )
    path = fake_bin(
        tmp_path / "bin",
        curl=answer_once_up,
        # vLLM and serve: services that stay up, in a sleep no other test looks for among all processes.
        fakepython=f"echo $$ >> {pids}; exec sleep 3600",
        torchrun='echo "trainer $CUDA_VISIBLE_DEVICES $FSDP_VERSION $*"; exit 7',
    )
    env = {"PATH": path, "MODEL": "m", "DATASET": "d", "GPUS": "4", "VLLM_GPUS": "2", "PYTHON": "fakepython"}
    result = subprocess.run(
        ["bash", str(ONE_NODE), "--seed", "3"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 7  # the trainer's
    assert result.stdout.startswith(f"trainer 2,3 2 --standalone --nproc_per_node 2 -m {TRAINER_MODULE} ")
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 2
    assert all(wait_until(lambda pid=pid: not alive(pid), 10) for pid in started)  # the script's exit trap


def test_the_one_node_example_stops_when_a_service_dies_before_it_answers(tmp_path: Path) -> None:
    path = fake_bin(tmp_path / "bin", curl="exit 7", fakepython="exit 1")
    env = {"PATH": path, "MODEL": "m", "DATASET": "d", "GPUS": "2", "PYTHON": "fakepython"}
    result = subprocess.run(["bash", str(ONE_NODE)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "error: a process exited before http://127.0.0.1:8000/health answered" in result.stderr
