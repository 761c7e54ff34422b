"""Submit a training run to Hugging Face Jobs: ``harness-trainer jobs submit [options] -- TRAINER_ARGS``.

It uses ``HfApi.run_job`` (an image and a command), not ``run_uv_job``: the run needs vLLM and a CUDA
torch that match each other and the GPU, which an image ships ready (default ``vllm/vllm-openai``), where
a uv script would resolve and download several GB of wheels at every start; and the job is a tree of
long-lived processes (vLLM, the rollout server, the trainer), not one script. The command installs this
package and execs :mod:`harness_trainer.jobs.job_launcher` with the trainer arguments, which it passes to
the trainer launcher unchanged. The package has no PyPI release: by default the wheel of this checkout is
built here and uploaded with the job; ``--install`` gives a local wheel, a git or wheel URL, or a
requirement instead, ``--extras`` the extras (:mod:`.install` says how, and where the wheel goes).

Secrets (``--secret NAME``, repeatable, added to ``HF_TOKEN`` and the credentials of the trainer's
``--sandbox`` backend, e.g. ``E2B_API_KEY`` for ``e2b``, none more for ``hf`` or ``local``): the values are
read from the local environment (``HF_TOKEN``, when unset there, is the token ``hf auth login`` stored,
as ``hf jobs run`` takes it) and go straight into ``run_job(secrets=...)``; they never enter the
:class:`JobSpec`, are never printed or logged (a dry run shows the names with the values redacted), and a
missing one is one error line naming it (exit 2). In the job, only their names travel as plain
environment (``HT_SECRET_NAMES``), so the launcher knows what to keep from processes that do not need it.

Volumes (``--volume``, repeatable, the syntax of ``hf jobs run -v``): ``hf://buckets/ORG/NAME[/PATH]:/MOUNT``
mounts a bucket read-write (where outputs go: ``--output-dir /outputs/run1`` after ``--volume
hf://buckets/ORG/NAME:/outputs``); ``hf://[datasets/|spaces/]ID:/MOUNT`` mounts a repo read-only; and
``LOCAL_DIR:/MOUNT[:ro|:rw]`` syncs a local folder to the namespace's ``jobs-artifacts`` bucket at submit
(``HfApi.sync_job_volume``; a dry run syncs nothing) and mounts it, e.g. a folder of tasks for
``--dataset``. The wheel of this package travels the same way, and so does the run's config: with
``--config job.yaml`` (sections ``job``, these options; ``run`` and ``trainer``, the trainer launcher's),
the ``run`` and ``trainer`` sections are checked here, mounted at :data:`RUN_CONFIG_MOUNT` and passed to
the trainer as ``--config`` before the trainer arguments, which still win over them.

The job exposes the capture proxy's port publicly (``expose_public``) and is labelled
``harness-trainer-run=<run id>`` so the launcher can find its own public URL; the job launcher's docstring
says why. ``--flavor`` is checked against the flavors the installed ``huggingface_hub`` knows
(``JobHardware``), and the GPU split (``--vllm-gpu-count``, ``--vllm-gpus``, ``--vllm-parallel``,
``--trainer-gpus``) against its GPUs (:mod:`.gpus`); the launcher gets their count as ``--gpus``, and the
dry run shows the split.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shlex
import sys
import tempfile
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from harness_trainer.jobs.gpus import GpuSplit, flavor_gpus
from harness_trainer.jobs.install import (
    DEFAULT_EXTRAS,
    WHEEL_MOUNT,
    InstallError,
    InstallRequest,
    InstallSpec,
    WheelBuilder,
    WheelBuildError,
    default_extras,
    install_request,
    prepare_install,
)
from harness_trainer.jobs.plan import (
    DEFAULT_CAPTURE_PORT,
    NAMESPACE_ENV,
    RUN_ID_ENV,
    RUN_LABEL,
    SECRET_NAMES_ENV,
    TrainerSettings,
    add_engine_arguments,
    engine_arguments,
    plan_gpus,
    trainer_settings,
)
from harness_trainer.jobs.process_supervisor import LaunchError
from harness_trainer.launch.config_file import TRAINER, apply_config, configurable
from harness_trainer.sandboxes import capabilities

DEFAULT_IMAGE = "vllm/vllm-openai:v0.32.0"
DEFAULT_FLAVOR = "h200x2"
DEFAULT_TIMEOUT = "8h"
HUB_SECRET = "HF_TOKEN"
"""Always sent, with the ``--sandbox`` backend's credentials (its class's ``capabilities``)."""
REDACTED = "<redacted>"
JOB_SECTION = "job"
"""A jobs config file's section of these options; its ``run`` and ``trainer`` sections go to the job."""
RUN_SECTION = "run"
RUN_CONFIG_MOUNT = "/harness-trainer-run"
RUN_CONFIG_NAME = "run.yaml"
_SECRET_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TIMEOUT = re.compile(r"\d+(\.\d+)?[smhd]?")


class SubmitError(ValueError):
    """Submission options that cannot work; the message names the option."""


class VolumeSpec(BaseModel):
    """One volume of the job: a Hub bucket or repo, or a local folder synced to a bucket at submit."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["bucket", "model", "dataset", "space", "local"]
    source: str
    """The bucket or repo id, or the local folder."""
    mount_path: str
    read_only: bool | None = None
    """None: the Hub's default (buckets read-write, repos read-only); local folders default to read-only."""
    path: str | None = None
    """A subfolder of the bucket or repo."""
    revision: str | None = None
    remote_name: str | None = None
    """A local folder's folder in the ``jobs-artifacts`` bucket (None: ``huggingface_hub`` names it)."""

    @property
    def writable(self) -> bool:
        if self.type == "bucket":
            return self.read_only is not True
        return self.type == "local" and self.read_only is False


class JobSpec(BaseModel):
    """What is submitted, all but the secrets' values (which never enter this model)."""

    model_config = ConfigDict(extra="forbid")

    image: str
    install: InstallSpec
    """How the command's first part installs this package."""
    command: list[str]
    flavor: str
    gpus: GpuSplit
    """The flavor's GPUs as the job's launcher will split them."""
    timeout: str
    env: dict[str, str]
    secrets: list[str]
    """Names only; the values are read from the environment at submit."""
    volumes: list[VolumeSpec]
    expose_public: list[int]
    labels: dict[str, str]
    name: str
    namespace: str | None

    def redacted(self) -> dict[str, Any]:
        """The spec as the dry run prints it: each secret's name with its value redacted."""
        return {**self.model_dump(), "secrets": {name: REDACTED for name in self.secrets}}


def parse_volume(spec: str) -> VolumeSpec:
    """``hf://[TYPE/]SOURCE[/PATH]:/MOUNT[:ro|:rw]`` or ``LOCAL_DIR:/MOUNT[:ro|:rw]``; raises SubmitError."""
    if spec.startswith("hf://"):
        from huggingface_hub.utils import parse_hf_mount

        try:
            mount = parse_hf_mount(spec)
        except ValueError as exc:
            raise SubmitError(f"--volume {spec}: {exc}") from exc
        return VolumeSpec(
            type=mount.source.type,
            source=mount.source.id,
            mount_path=mount.mount_path,
            read_only=mount.read_only,
            path=mount.source.path_in_repo or None,
            revision=mount.source.revision or None,
        )
    body, read_only = spec, None
    if body.endswith((":ro", ":rw")):
        body, read_only = body[:-3], body.endswith(":ro")
    source, sep, mount_path = body.partition(":/")
    if not sep or not source:
        raise SubmitError(f"--volume {spec}: expected hf://…:/MOUNT or LOCAL_DIR:/MOUNT[:ro|:rw]")
    if not Path(source).expanduser().is_dir():
        raise SubmitError(f"--volume {spec}: {source} is not a local folder (a Hub volume starts with hf://)")
    return VolumeSpec(type="local", source=source, mount_path="/" + mount_path, read_only=read_only)


def check_options(
    args: argparse.Namespace, trainer_args: Sequence[str]
) -> tuple[TrainerSettings, list[str], GpuSplit]:
    """The trainer's settings, the job's secret names and its GPU split, once every option (see
    :func:`add_submit_arguments`) is checked, ``--install`` and ``--volume`` included; pure but for looking
    at local paths. Raises SubmitError. Called before anything is built, so a bad option never waits for a
    wheel."""
    from huggingface_hub import JobHardware

    flavors = [flavor.value for flavor in JobHardware]
    if args.flavor not in flavors:
        raise SubmitError(f"--flavor {args.flavor!r} is not a Jobs flavor; known: {', '.join(flavors)}")
    if not _TIMEOUT.fullmatch(args.timeout):
        raise SubmitError(f"--timeout {args.timeout!r}: a number and an optional unit s, m, h, d (e.g. 8h)")
    try:
        settings = trainer_settings(trainer_args)
    except LaunchError as exc:
        raise SubmitError(str(exc)) from exc
    gpus = flavor_gpus(args.flavor)
    try:
        split = plan_gpus(args, settings, total=gpus)
    except LaunchError as exc:
        raise SubmitError(f"--flavor {args.flavor}: {exc}") from exc
    secrets = job_secret_names(settings.sandbox, args.secret)
    for volume in args.volume:
        parse_volume(volume)
    install_options(args, settings.sandbox)
    return settings, secrets, split


def install_options(args: argparse.Namespace, sandbox: str) -> InstallRequest:
    """``--install`` and ``--extras`` checked (see :func:`.install.install_request`), the extras by default
    those of the trainer's ``sandbox`` (:func:`.install.default_extras`); raises SubmitError."""
    try:
        return install_request(args.install, args.extras, default_extras(capabilities(sandbox).extra))
    except InstallError as exc:
        raise SubmitError(str(exc)) from exc


def write_run_config(sections: Mapping[str, Any], folder: Path) -> Path | None:
    """Write the ``run`` and ``trainer`` sections of a jobs config file (the trainer launcher's) to
    ``folder/run-config/run.yaml``, which the job gets as a volume; None when the file has neither.
    Raises SubmitError for ``trainer.hub_token``: a secret travels as one (``--secret HF_TOKEN``)."""
    run = {name: sections[name] for name in (RUN_SECTION, TRAINER) if name in sections}
    if not run:
        return None
    if "hub_token" in run.get(TRAINER, {}):
        raise SubmitError(
            "trainer.hub_token: a secret goes with the job's secrets (HF_TOKEN), not its config"
        )
    path = folder / "run-config" / RUN_CONFIG_NAME
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(run, indent=2) + "\n")  # JSON is YAML
    return path


def with_run_config(trainer_args: Sequence[str], run_config: str | None) -> list[str]:
    """The trainer's arguments reading ``run_config`` first: its flags given still win over the file."""
    return [*(["--config", run_config] if run_config else []), *trainer_args]


def build_job_spec(
    args: argparse.Namespace,
    trainer_args: Sequence[str],
    *,
    run_id: str,
    install: InstallSpec,
    run_config: Path | None = None,
) -> tuple[JobSpec, TrainerSettings]:
    """The job for ``args``, the trainer's arguments and ``install`` (:func:`.install.prepare_install`);
    ``run_config`` (:func:`write_run_config`) is mounted at :data:`RUN_CONFIG_MOUNT` and read by the
    trainer. Pure but for reading local files and the folders of ``--volume``. Raises SubmitError."""
    settings, secrets, split = check_options(
        args, with_run_config(trainer_args, run_config and str(run_config))
    )
    in_job = f"{RUN_CONFIG_MOUNT}/{RUN_CONFIG_NAME}" if run_config else None
    launcher = ["python3", "-m", "harness_trainer.jobs.job_launcher", "--dataset", args.dataset]
    launcher += ["--capture-port", str(DEFAULT_CAPTURE_PORT), "--gpus", str(split.total)]
    launcher += engine_arguments(args)
    launcher += ["--", *with_run_config(trainer_args, in_job)]
    script = f"{install.pip_command} && exec {shlex.join(launcher)}"
    env = {RUN_ID_ENV: run_id, SECRET_NAMES_ENV: ",".join(secrets), "PYTHONUNBUFFERED": "1"}
    if args.namespace:
        env[NAMESPACE_ENV] = args.namespace
    volumes = [parse_volume(volume) for volume in args.volume]
    if run_config is not None:
        volumes.append(
            VolumeSpec(
                type="local", source=str(run_config.parent), mount_path=RUN_CONFIG_MOUNT, read_only=True
            )
        )
    if install.upload_dir is not None:
        volumes.append(
            VolumeSpec(
                type="local",
                source=install.upload_dir,
                mount_path=WHEEL_MOUNT,
                read_only=True,
                remote_name=install.remote_name,
            )
        )
    spec = JobSpec(
        image=args.image,
        install=install,
        command=["bash", "-c", script],
        flavor=args.flavor,
        gpus=split,
        timeout=args.timeout,
        env=env,
        secrets=secrets,
        volumes=volumes,
        expose_public=[DEFAULT_CAPTURE_PORT],
        labels={RUN_LABEL: run_id},
        name=f"harness-trainer-{run_id[:8]}",
        namespace=args.namespace,
    )
    return spec, settings


def job_secret_names(sandbox: str, extra: Sequence[str]) -> list[str]:
    """``HF_TOKEN``, the credentials of backend ``sandbox``, then ``extra``, in order, once each; raises
    SubmitError for an unknown backend or a name no shell could set."""
    try:
        credentials = capabilities(sandbox).credentials
    except ValueError as exc:
        raise SubmitError(f"the trainer's --sandbox: {exc}") from None
    names = list(dict.fromkeys([HUB_SECRET, *credentials, *extra]))
    bad = [name for name in names if not _SECRET_NAME.fullmatch(name)]
    if bad:
        raise SubmitError(f"--secret {bad[0]!r} is not an environment variable name")
    return names


def secret_values(names: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The value of each secret of ``names`` that is set (non-empty) in ``environ``; :data:`HUB_SECRET`,
    when it is not, is the token ``hf auth login`` stored, as ``hf jobs run --secrets HF_TOKEN`` takes it
    (and as ``HfApi``, which submits the job, authenticates)."""
    values = {name: environ[name] for name in names if environ.get(name)}
    if HUB_SECRET in names and HUB_SECRET not in values:
        from huggingface_hub import get_token

        if token := get_token():
            values[HUB_SECRET] = token
    return values


def output_warning(spec: JobSpec, settings: TrainerSettings) -> str | None:
    """A warning when the trainer's ``--output-dir`` is not on a writable volume (lost with the job)."""
    out = PurePosixPath(settings.output_dir)
    if out.is_absolute() and any(v.writable and out.is_relative_to(v.mount_path) for v in spec.volumes):
        return None
    return (
        f"warning: --output-dir {settings.output_dir} is not on a writable volume, so checkpoints and "
        "metrics end with the job: add --volume hf://buckets/ORG/NAME:/outputs and --output-dir /outputs/RUN"
    )


def submit(spec: JobSpec, secrets: Mapping[str, str], api: Any) -> Any:
    """Sync local volumes, then ``api.run_job`` the spec with ``secrets``; returns the ``JobInfo``."""
    from huggingface_hub import Volume

    volumes = []
    for volume in spec.volumes:
        if volume.type == "local":
            read_only = True if volume.read_only is None else volume.read_only
            synced = api.sync_job_volume(
                volume.source,
                volume.mount_path,
                remote_name=volume.remote_name,
                read_only=read_only,
                namespace=spec.namespace,
            )
            volumes.append(synced)
        else:
            fields = volume.model_dump(exclude_none=True, exclude={"remote_name"})
            volumes.append(Volume(**fields))
    return api.run_job(
        image=spec.image,
        command=spec.command,
        env=spec.env,
        secrets=dict(secrets),
        flavor=spec.flavor,
        timeout=spec.timeout,
        name=spec.name,
        labels=spec.labels,
        volumes=volumes or None,
        expose_public=spec.expose_public,
        namespace=spec.namespace,
    )


def add_submit_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``jobs submit``'s options, and the trainer arguments after ``--``, to ``parser``."""
    parser.add_argument(
        "--flavor", default=DEFAULT_FLAVOR, help="Jobs hardware, 2 GPUs or more (h200x2, h200x8, a100x4, ...)"
    )
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="Docker image with vLLM and CUDA torch")
    parser.add_argument("--timeout", default=DEFAULT_TIMEOUT, help="the job's limit, e.g. 90m, 8h, 2d")
    parser.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME",
        help=f"a secret taken from this environment (repeatable; always {HUB_SECRET} and the --sandbox "
        "backend's credentials, e.g. E2B_API_KEY for e2b)",
    )
    parser.add_argument(
        "--volume",
        action="append",
        default=[],
        help="hf://buckets/ORG/NAME:/MOUNT (outputs), hf://[datasets/]ID:/MOUNT, LOCAL_DIR:/MOUNT[:ro|:rw]",
    )
    parser.add_argument("--namespace", default=None, help="user or org running the job (default: yours)")
    parser.add_argument("--dataset", required=True, help="task folder (on a volume) or Hub dataset id")
    parser.add_argument(
        "--install",
        default=None,
        help="how the job gets this package: a local wheel (uploaded), a git+https:// or wheel URL, or a "
        "requirement naming harness-trainer (default: build this checkout's wheel and upload it)",
    )
    parser.add_argument(
        "--extras",
        default=None,
        help="comma-separated extras installed with the wheel or URL (default: the trainer's --sandbox "
        f"backend's and train: {','.join(DEFAULT_EXTRAS)} for e2b, hf,train for hf)",
    )
    add_engine_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the job spec as JSON, submit nothing")
    parser.add_argument("trainer_args", nargs="*", help="after --: the trainer launcher's arguments")
    from harness_trainer.launch.harbor_run import build_parser as trainer_parser

    configurable(parser, JOB_SECTION, others={RUN_SECTION: trainer_parser()})


def run_submit(args: argparse.Namespace, api: Any = None, build: WheelBuilder | None = None) -> int:
    """Submit (with ``--dry-run``: print) the job; returns the exit status. ``api``: default ``HfApi()``;
    ``build``: what makes this checkout's wheel (default :func:`.install.build_wheel`). Every option and
    secret is checked before the wheel is built, and the wheel is built before anything is uploaded."""
    run_id = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="harness-trainer-submit-") as folder:
        try:
            args = apply_config(args)
            run_config = write_run_config(args.config_sections, Path(folder))
            settings, secret_names, _ = check_options(
                args, with_run_config(args.trainer_args, run_config and str(run_config))
            )
        except ValueError as exc:  # SubmitError, or a config file's problems
            print(f"error: {exc}", file=sys.stderr)
            return 2
        secrets = secret_values(secret_names, os.environ)
        if missing := [name for name in secret_names if name not in secrets]:
            login = f" (or store {HUB_SECRET} with `hf auth login`)" if HUB_SECRET in missing else ""
            print(
                f"error: secret {', '.join(missing)} is not set in this environment: export it{login}",
                file=sys.stderr,
            )
            return 2
        try:
            install = prepare_install(install_options(args, settings.sandbox), Path(folder), build)
            spec, settings = build_job_spec(
                args, args.trainer_args, run_id=run_id, install=install, run_config=run_config
            )
        except WheelBuildError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except (SubmitError, InstallError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        warning = output_warning(spec, settings)
        if warning:
            print(warning, file=sys.stderr)
        if args.dry_run:
            print(json.dumps(spec.redacted(), indent=2))
            return 0
        return _submit_now(spec, secrets, api)


def _submit_now(spec: JobSpec, secrets: dict[str, str], api: Any) -> int:
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    if "expose_public" not in inspect.signature(api.run_job).parameters:
        print("error: this huggingface_hub cannot expose a job's port publicly; upgrade it", file=sys.stderr)
        return 1
    try:
        job = submit(spec, secrets, api)
    except Exception as exc:  # any Hub or network failure: one line, with no secret value in it
        print(f"error: the job was not submitted: {_without(str(exc), secrets.values())}", file=sys.stderr)
        return 1
    print(f"submitted job {job.id}: {job.url}")
    return 0


def _without(text: str, values: Iterable[str]) -> str:
    for value in values:
        text = text.replace(value, REDACTED)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """``examples/jobs/submit.py``'s entry point: the same options as ``harness-trainer jobs submit``."""
    parser = argparse.ArgumentParser(prog="examples/jobs/submit.py", description=__doc__.split("\n")[0])
    add_submit_arguments(parser)
    return run_submit(parser.parse_args(argv))
