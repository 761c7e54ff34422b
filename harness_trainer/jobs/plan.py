"""The job launcher's plan: which processes run, with which command line, environment and secrets. Pure.

Also the contract between ``jobs submit`` and the job: the ports, the environment variables the submitter
sets (:data:`RUN_ID_ENV`, :data:`SECRET_NAMES_ENV`, :data:`NAMESPACE_ENV`), the job's :data:`RUN_LABEL`,
and the engine options both command lines share (:func:`add_engine_arguments`).
"""

from __future__ import annotations

import argparse
import shlex
import typing
from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from harness_trainer.jobs.gpus import (
    TRAINER_MODULE,
    VLLM_PARALLEL_FLAGS,
    GpuSplit,
    attention_heads,
    split_gpus,
)
from harness_trainer.jobs.process_supervisor import LaunchError
from harness_trainer.sandboxes import capabilities, credential_variables

DEFAULT_VLLM_PORT = 8000
DEFAULT_SERVER_PORT = 8200
DEFAULT_CAPTURE_PORT = 8300
DEFAULT_GPUS = 2
"""GPUs the launcher assumes without ``--gpus`` (``jobs submit`` passes the flavor's)."""
RUN_ID_ENV = "HT_RUN_ID"
"""Set by ``jobs submit``: the value of the job's :data:`RUN_LABEL`, how the launcher finds its own job."""
SECRET_NAMES_ENV = "HT_SECRET_NAMES"
"""Set by ``jobs submit``: the comma-separated names (never the values) of the job's secrets."""
NAMESPACE_ENV = "HT_JOB_NAMESPACE"
RUN_LABEL = "harness-trainer-run"
HUB_ROUTES: dict[str, tuple[str, ...]] = {
    "HF_TOKEN": ("vllm", "serve", "trainer"),
    "HUGGING_FACE_HUB_TOKEN": ("vllm", "serve", "trainer"),
}
"""The Hub tokens' steps: vLLM and the trainer load from the Hub, the server reads the dataset."""
SANDBOX_STEPS = ("serve", "warm")
"""Where sandboxes start: the server, and the warm-up (only with its backend's own credentials)."""


def secret_routes() -> dict[str, tuple[str, ...]]:
    """:data:`HUB_ROUTES` with every sandbox backend's credentials (their classes' ``capabilities``) also
    routed to :data:`SANDBOX_STEPS`: a variable both lists name (``HF_TOKEN``, the hf backend's) reaches
    the steps of both."""
    routes = dict(HUB_ROUTES)
    for variable in credential_variables():
        routes[variable] = tuple(dict.fromkeys([*routes.get(variable, ()), *SANDBOX_STEPS]))
    return routes


SECRET_ROUTES: dict[str, tuple[str, ...]] = secret_routes()
"""Which steps receive which secret; a secret not listed goes to the trainer only. The warm-up gets only
the credentials of the run's own backend (:func:`build_plan`)."""
VLLM_FLAGS = (
    "--logprobs-mode",
    "processed_logprobs",
    "--return-tokens-as-token-ids",
    "--weight-transfer-config",
    '{"backend": "nccl"}',
    "--enable-auto-tool-choice",
)
"""``docs/gpu-checks.md``'s flags, plus automatic tool choice for the agents (the parser is an option)."""
LOOPBACK = "127.0.0.1"
_SET_BY_LAUNCHER = ("--server", "--vllm-url")


class TrainerSettings(BaseModel):
    """What the launcher reads from the trainer's arguments (which it passes on unchanged), resolved as the
    trainer launcher (:mod:`harness_trainer.launch.harbor_run`) resolves them, ``--config`` included."""

    model: str
    sandbox: str
    max_concurrent_rollouts: int
    lora: bool
    output_dir: str


def trainer_settings(argv: Sequence[str]) -> TrainerSettings:
    """:class:`TrainerSettings` from the trainer's arguments, the trainer's whole config checked; raises
    LaunchError when they cannot work."""
    from harness_trainer.launch.config_file import apply_config
    from harness_trainer.launch.harbor_run import build_config, build_parser

    given = [flag for flag in _SET_BY_LAUNCHER if any(a == flag or a.startswith(f"{flag}=") for a in argv)]
    if given:
        raise LaunchError(f"the launcher sets {', '.join(given)}: leave them out of the trainer arguments")
    parser = build_parser()

    def refuse(message: str) -> typing.NoReturn:
        raise LaunchError(f"trainer arguments: {message}")

    parser.error = refuse  # type: ignore[method-assign]  # argparse reports every bad argument through it
    try:
        args = apply_config(parser.parse_args(list(argv)))
        config = build_config(args)
    except ValueError as exc:
        raise LaunchError(f"trainer arguments: {exc}") from exc
    assert config.max_concurrent_rollouts is not None and config.output_dir is not None  # resolved
    return TrainerSettings(
        model=args.model,
        sandbox=args.sandbox,
        max_concurrent_rollouts=config.max_concurrent_rollouts,
        lora=config.use_peft,
        output_dir=config.output_dir,
    )


class Step(BaseModel):
    """One process the launcher runs: its command, what it adds to the environment, when it counts as up."""

    model_config = ConfigDict(extra="forbid")

    name: str
    argv: list[str]
    env: dict[str, str] = {}
    """Set for this process on top of the launcher's environment, from which every secret is removed."""
    secrets: list[str] = []
    """Names of the secrets this process gets back from the launcher's environment."""
    health: list[str] = []
    """URLs that must answer 200 before the next step starts."""
    ready_timeout_s: float = 0.0
    """How long the health URLs (or a one-shot step's run) may take."""
    stop_timeout_s: float = 30.0
    """SIGTERM to SIGKILL grace when stopping."""


class LaunchPlan(BaseModel):
    """Everything the launcher will run, in order; ``--dry-run`` prints it."""

    model_config = ConfigDict(extra="forbid")

    public_url: str | None
    """How sandboxes reach the capture proxy; None keeps it on loopback (local sandboxes)."""
    gpus: GpuSplit
    secret_names: list[str]
    vllm: Step
    serve: Step
    warm: Step | None
    trainer: Step


def secret_names(environ: Mapping[str, str]) -> list[str]:
    """The job's secret names: those in ``$HT_SECRET_NAMES``, plus the known ones that are set."""
    listed = [name.strip() for name in environ.get(SECRET_NAMES_ENV, "").split(",") if name.strip()]
    return list(dict.fromkeys([*listed, *(name for name in SECRET_ROUTES if name in environ)]))


def step_env(step: Step, environ: Mapping[str, str], secrets: Iterable[str]) -> dict[str, str]:
    """The full environment of ``step``: the launcher's without any secret, its own additions, its secrets."""
    hidden = {*secrets, *SECRET_ROUTES}
    env = {key: value for key, value in environ.items() if key not in hidden}
    env.update(step.env)
    env.update({name: environ[name] for name in step.secrets if name in environ})
    return env


def build_plan(
    options: argparse.Namespace,
    trainer_argv: Sequence[str],
    environ: Mapping[str, str],
    public_url: str | None,
) -> LaunchPlan:
    """The launch plan for the launcher's ``options`` and the trainer's arguments; raises LaunchError."""
    settings = trainer_settings(trainer_argv)
    needed = settings.max_concurrent_rollouts + 1
    capacity = options.max_concurrent_envs or needed
    if capacity < needed:
        raise LaunchError(f"--max-concurrent-envs {capacity} < --max-concurrent-rollouts + 1 = {needed}")
    try:
        backend = capabilities(settings.sandbox)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    remote = backend.remote
    if remote and not public_url:
        raise LaunchError(
            f"--sandbox {settings.sandbox} runs agents on another machine, so they need a public URL for the "
            f"capture proxy: run as a job submitted by `harness-trainer jobs submit` (${RUN_ID_ENV} set) "
            "or pass --public-url"
        )
    split = plan_gpus(options, settings)
    names = secret_names(environ)
    warm = None
    if remote:  # only a real remote sandbox can show that the public URL reaches the proxy
        warm_argv = [
            "--public-url",
            public_url,
            "--sandbox",
            settings.sandbox,
            "--template",
            options.warm_template,
            "--image",
            options.warm_image,
        ]
        warm = Step(
            name="warm",
            argv=[*shlex.split(options.warm_command), *warm_argv],
            env={"CUDA_VISIBLE_DEVICES": ""},
            secrets=[name for name in _secrets_for("warm", names) if name in backend.credentials],
            ready_timeout_s=options.warm_timeout,
            stop_timeout_s=options.stop_timeout,
        )
    urls = ["--server", _url(options.server_port), "--vllm-url", _url(options.vllm_port)]
    command = shlex.split(options.trainer_command)
    if split.trainer_sharding != "none":  # one rank per trainer GPU
        command = [*shlex.split(options.accelerate_command), *split.launch_args(), "-m", TRAINER_MODULE]
    trainer = Step(
        name="trainer",
        argv=[*command, *trainer_argv, *urls],
        env={"CUDA_VISIBLE_DEVICES": _devices(split.trainer)},
        secrets=_secrets_for("trainer", names),
        stop_timeout_s=options.trainer_stop_timeout,
    )
    return LaunchPlan(
        public_url=public_url,
        gpus=split,
        secret_names=names,
        vllm=_vllm_step(options, settings, names, split),
        serve=_serve_step(options, settings, names, capacity, public_url, environ.get(RUN_ID_ENV) or None),
        warm=warm,
        trainer=trainer,
    )


def plan_gpus(options: argparse.Namespace, settings: TrainerSettings, total: int | None = None) -> GpuSplit:
    """The GPU split of :func:`add_engine_arguments`' options on ``total`` GPUs (default ``options.gpus``),
    the tensor-parallel size checked against the model's heads where its config is on disk; raises
    :class:`~harness_trainer.jobs.gpus.GpuSplitError` (a LaunchError)."""
    heads = attention_heads(settings.model) if options.vllm_parallel == "tensor" else None
    return split_gpus(
        options.gpus if total is None else total,
        vllm_gpus=options.vllm_gpus,
        trainer_gpus=options.trainer_gpus,
        vllm_gpu_count=options.vllm_gpu_count,
        parallel=options.vllm_parallel,
        lora=settings.lora,
        heads=heads,
        model=settings.model,
    )


def _vllm_step(
    options: argparse.Namespace, settings: TrainerSettings, names: list[str], split: GpuSplit
) -> Step:
    argv = [*shlex.split(options.vllm_command), settings.model, "--host", LOOPBACK]
    argv += ["--port", str(options.vllm_port), *VLLM_FLAGS, "--tool-call-parser", options.tool_call_parser]
    argv += split.vllm_args()
    env = {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": _devices(split.vllm)}
    if settings.lora:
        argv += ["--enable-lora", "--max-lora-rank", str(options.max_lora_rank)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    return Step(
        name="vllm",
        argv=[*argv, *options.vllm_arg],
        env=env,
        secrets=_secrets_for("vllm", names),
        health=[f"{_url(options.vllm_port)}/health"],
        ready_timeout_s=options.vllm_ready_timeout,
        stop_timeout_s=options.stop_timeout,
    )


def _serve_step(
    options: argparse.Namespace,
    settings: TrainerSettings,
    names: list[str],
    capacity: int,
    public_url: str | None,
    run_id: str | None,
) -> Step:
    # Off loopback only when sandboxes elsewhere must reach it; serve then makes its own random admin key.
    capture_host = "0.0.0.0" if public_url else LOOPBACK
    capture_dir = options.capture_dir or f"{settings.output_dir.rstrip('/')}/capture"
    argv = [*shlex.split(options.serve_command), "--dataset", options.dataset]
    argv += ["--upstream", _url(options.vllm_port), "--host", LOOPBACK, "--port", str(options.server_port)]
    argv += ["--capture-host", capture_host, "--capture-port", str(options.capture_port)]
    argv += ["--data-dir", capture_dir, *(["--public-url", public_url] if public_url else [])]
    # The job's run id labels its remote sandboxes: a restarted job's server kills what a dead one left.
    argv += ["--run-id", run_id] if run_id else []
    return Step(
        name="serve",
        argv=argv,
        env={"MAX_CONCURRENT_ENVS": str(capacity), "CUDA_VISIBLE_DEVICES": ""},
        secrets=_secrets_for("serve", names),
        health=[f"{_url(options.server_port)}/health", f"{_url(options.capture_port)}/health"],
        ready_timeout_s=options.serve_ready_timeout,
        stop_timeout_s=options.stop_timeout,
    )


def _secrets_for(step: str, names: list[str]) -> list[str]:
    return [name for name in names if step in SECRET_ROUTES.get(name, ("trainer",))]


def _url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


def _devices(gpus: list[int]) -> str:
    return ",".join(map(str, gpus))


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPU split and vLLM options, shared with ``jobs submit`` (which passes them to the launcher)."""
    parser.add_argument(
        "--vllm-gpu-count",
        type=int,
        default=None,
        help="vLLM gets the first N GPUs (default 1), the trainer the rest",
    )
    parser.add_argument(
        "--vllm-gpus", default=None, help="vLLM's GPUs by id, e.g. 0,1 (instead of --vllm-gpu-count)"
    )
    parser.add_argument(
        "--vllm-parallel",
        choices=tuple(VLLM_PARALLEL_FLAGS),
        default="tensor",
        help="how vLLM uses several GPUs: one model split across them, or one copy on each",
    )
    parser.add_argument(
        "--trainer-gpus",
        default=None,
        help="the trainer's GPUs by id (default: those vLLM does not get); several: accelerate, FSDP2",
    )
    parser.add_argument(
        "--tool-call-parser", default="hermes", help="vLLM's parser of the model's tool calls"
    )
    parser.add_argument("--max-lora-rank", type=int, default=64, help="vLLM's --max-lora-rank, with --lora")
    parser.add_argument("--vllm-ready-timeout", type=float, default=1800.0, help="seconds (model download)")
    parser.add_argument(
        "--vllm-arg", action="append", default=[], help="extra vLLM flag: --vllm-arg=--max-model-len=32768"
    )


def engine_arguments(options: argparse.Namespace) -> list[str]:
    """The options of :func:`add_engine_arguments` as a command line again."""
    argv = [] if options.vllm_gpus is None else ["--vllm-gpus", options.vllm_gpus]
    argv += [] if options.vllm_gpu_count is None else ["--vllm-gpu-count", str(options.vllm_gpu_count)]
    argv += [] if options.trainer_gpus is None else ["--trainer-gpus", options.trainer_gpus]
    argv += [
        "--vllm-parallel",
        options.vllm_parallel,
        "--tool-call-parser",
        options.tool_call_parser,
        "--max-lora-rank",
        str(options.max_lora_rank),
    ]
    argv += ["--vllm-ready-timeout", f"{options.vllm_ready_timeout:g}"]
    return argv + [f"--vllm-arg={flag}" for flag in options.vllm_arg]
