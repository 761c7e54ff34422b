"""Runs inside a Hugging Face Job: vLLM, the rollout server and its capture proxy, a warm-up, the trainer.

    python -m harness_trainer.jobs.job_launcher --dataset DATASET [options] -- TRAINER_ARGS...

``TRAINER_ARGS`` go to the trainer launcher unchanged, plus ``--server`` and ``--vllm-url``, which the
launcher sets (passing them yourself is an error). It reads ``--model``, ``--sandbox``,
``--max-concurrent-rollouts``, ``--lora`` and ``--output-dir`` from them (with the trainer launcher's
defaults) to configure the rest. Each step starts only once the one before is up, and every wait is
bounded, with an error naming what did not come up:

1. **vLLM** on ``127.0.0.1`` (default GPU 0; ``--vllm-gpu-count`` or ``--vllm-gpus`` for several, used
   ``--vllm-parallel tensor`` or ``data``) with ``VLLM_SERVER_DEV_MODE=1`` and the flags of
   ``docs/gpu-checks.md`` (processed logprobs, token ids, NCCL weight transfer, tool-call parser; with
   ``--lora``, ``--enable-lora --max-lora-rank`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``); up when
   ``/health`` answers.
2. **The rollout server** (``harness-trainer serve``) on ``127.0.0.1`` with ``MAX_CONCURRENT_ENVS`` = the
   trainer's concurrency + 1 (its session factory keeps one session for metadata); up when its
   ``/health`` and the capture proxy's ``/health`` answer.
3. **A warm-up sandbox** (only with a remote ``--sandbox``: ``e2b``, ``hf``): :mod:`harness_trainer.jobs.warm`
   starts one sandbox of that backend (E2B: ``--warm-template``; hf: a dedicated sandbox of
   ``--warm-image``, after the backend's check that the token may run Jobs), fetches the capture proxy's
   public ``/health`` from inside it and closes it, so a bad key or token or an unreachable proxy fails
   the job in a minute or two, not after vLLM has loaded and the first rollouts time out. It runs beside
   the server, not through it: the server has no route that starts a sandbox without an agent.
4. **The trainer launcher** (``--trainer-command``) on the GPUs vLLM does not get (``--trainer-gpus``;
   by default GPU 1 of ``--gpus 2``); on several, one rank each under ``accelerate launch``
   (``--accelerate-command``) with FSDP2, or DDP with ``--lora`` (:mod:`.gpus`). Its exit status is the
   launcher's.

How remote sandboxes (E2B's, and HF sandboxes, which are jobs of their own under the token's account)
reach the capture proxy: the job is submitted with the capture port in
``expose_public`` (Hugging Face Jobs' own proxy: ``https://<job id>--<port>.hf.jobs``, no HF token needed to
call it). The launcher finds that URL through the Jobs API (the job carries the label
``harness-trainer-run=$HT_RUN_ID``; ``--public-url`` overrides) and gives it to ``serve --public-url``; the
capture proxy binds ``0.0.0.0`` only then. Chosen over a tunnel (cloudflared, ngrok) because it needs no
extra binary or account and nothing else to keep alive, and over the authenticated ``expose`` because that
would need an HF token in every sandbox. What the public port allows: agent routes need a capture
session id (unguessable, one per rollout; a sandbox only ever gets its own), admin routes the admin key
that ``serve`` makes at random and never prints; ``/health`` and ``/metrics`` are open. vLLM (whose
dev-mode routes replace weights) and the rollout server listen on loopback and are never exposed.

Secrets: the job's secrets (names in ``$HT_SECRET_NAMES``, values in the environment) are removed from
every child's environment and given back only where needed (:data:`.plan.SECRET_ROUTES`): ``HF_TOKEN``
to vLLM, the server and the trainer; each sandbox backend's credentials (``E2B_API_KEY``; ``HF_TOKEN``,
the hf backend's) to the server and, the run's own backend's only, to the warm-up; any other secret
(e.g. ``WANDB_API_KEY``) to the trainer. No secret is ever on a command line, and none reaches a sandbox: the
server starts sandboxes with the task's environment only, and agents get their session id as API key.

On SIGTERM / SIGINT, or when a service dies, everything is stopped (see :mod:`.process_supervisor`),
trainer first. Exit status: the trainer's when it ends by itself; 128 + N after signal N; 1 when a
component did not come up or died; 2 for bad arguments. ``--dry-run`` prints the plan (commands,
environment, secret names, the GPU split) as JSON and starts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from harness_trainer.jobs.gpus import TRAINER_MODULE
from harness_trainer.jobs.plan import (
    DEFAULT_CAPTURE_PORT,
    DEFAULT_GPUS,
    DEFAULT_SERVER_PORT,
    DEFAULT_VLLM_PORT,
    NAMESPACE_ENV,
    RUN_ID_ENV,
    RUN_LABEL,
    LaunchPlan,
    Step,
    add_engine_arguments,
    build_plan,
    step_env,
)
from harness_trainer.jobs.process_supervisor import Child, Interrupted, LaunchError, Supervisor, log
from harness_trainer.jobs.warm import DEFAULT_IMAGE, DEFAULT_TEMPLATE

_HEALTH_POLL_S = 0.5
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback checks bypass proxies


def run(plan: LaunchPlan, environ: Mapping[str, str], supervisor: Supervisor) -> int:
    """Run ``plan`` to the end; returns the exit status (see the module docstring). Stops everything."""

    def start(step: Step, *, service: bool = True) -> Child:
        env = step_env(step, environ, plan.secret_names)
        stop_timeout_s = step.stop_timeout_s
        return supervisor.start(step.name, step.argv, env, stop_timeout_s=stop_timeout_s, service=service)

    log(f"GPU split: {plan.gpus.summary}")
    try:
        for step in (plan.vllm, plan.serve):
            start(step)
            _wait_ready(supervisor, step)
        if plan.warm is not None:
            warm = start(plan.warm, service=False)
            code = supervisor.wait(warm, plan.warm.ready_timeout_s)
            if code != 0:
                outcome = f"exited with code {code}" if code is not None else "did not finish in time"
                raise LaunchError(
                    f"the warm-up sandbox {outcome} ({plan.warm.ready_timeout_s:g}s allowed): the run's "
                    f"sandboxes cannot start or cannot reach the capture proxy at {plan.public_url} (output "
                    "above)"
                )
            supervisor.forget(warm)
        trainer = start(plan.trainer, service=False)
        code = supervisor.wait(trainer)
        assert code is not None
        log(f"trainer exited with code {code}")
        return code
    except Interrupted as exc:
        log(str(exc))
        return 128 + exc.signum
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        supervisor.stop_all()


def _wait_ready(supervisor: Supervisor, step: Step) -> None:
    deadline = time.monotonic() + step.ready_timeout_s
    for url in step.health:
        while not _answers(url):
            if time.monotonic() >= deadline:
                raise LaunchError(f"{step.name} did not answer {url} within {step.ready_timeout_s:g}s")
            supervisor.sleep(_HEALTH_POLL_S)
        log(f"{step.name} is up: {url}")


def _answers(url: str) -> bool:
    try:
        with _NO_PROXY.open(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def discover_public_url(
    run_id: str,
    port: int,
    *,
    namespace: str | None = None,
    api: Any = None,
    attempts: int = 10,
    delay_s: float = 3.0,
) -> str:
    """This job's public URL for ``port``, found through the Jobs API by the job's run label.

    ``api`` is an ``HfApi`` (the default reads ``HF_TOKEN``). The URL is taken from the job's
    ``status.expose_urls``; when the job lists none for ``port`` yet, it is built the way the Jobs proxy
    names it, ``https://<job id>--<port>.hf.jobs``. Raises LaunchError when no job carries the label.
    """
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    for attempt in range(attempts):
        jobs = list(api.list_jobs(labels={RUN_LABEL: run_id}, namespace=namespace))
        if jobs:
            job = jobs[0]
            for url in (job.status.expose_urls if job.status else None) or []:
                if f"--{port}." in url:
                    return str(url).rstrip("/")
            return f"https://{job.id}--{port}.hf.jobs"
        if attempt + 1 < attempts:
            time.sleep(delay_s)
    raise LaunchError(
        f"no job labelled {RUN_LABEL}={run_id} in namespace {namespace or '(token owner)'}: cannot learn the "
        "capture proxy's public URL; pass --public-url"
    )


def build_parser() -> argparse.ArgumentParser:
    python = shlex.quote(sys.executable)
    parser = argparse.ArgumentParser(
        prog="python -m harness_trainer.jobs.job_launcher",
        description="Run vLLM, the rollout server and the trainer inside one job (arguments after -- go "
        "to the trainer).",
    )
    parser.add_argument("--dataset", required=True, help="task folder or Hugging Face dataset id, for serve")
    parser.add_argument("--vllm-command", default="vllm serve", help="serves the model (flags are appended)")
    parser.add_argument("--serve-command", default=f"{python} -m harness_trainer.cli serve")
    parser.add_argument(
        "--trainer-command",
        default=f"{python} -m {TRAINER_MODULE}",
        help="runs the trainer when it has one GPU (on several: --accelerate-command)",
    )
    parser.add_argument("--warm-command", default=f"{python} -m harness_trainer.jobs.warm")
    parser.add_argument(
        "--accelerate-command",
        default=f"{python} -m accelerate.commands.launch",
        help="starts the trainer's ranks when it has several GPUs (its flags and the trainer module follow)",
    )
    parser.add_argument(
        "--gpus", type=int, default=DEFAULT_GPUS, help="GPUs on this machine (jobs submit: the flavor's)"
    )
    parser.add_argument("--vllm-port", type=int, default=DEFAULT_VLLM_PORT)
    parser.add_argument("--server-port", type=int, default=DEFAULT_SERVER_PORT)
    parser.add_argument("--capture-port", type=int, default=DEFAULT_CAPTURE_PORT)
    add_engine_arguments(parser)
    parser.add_argument("--max-concurrent-envs", type=int, default=0, help="default: concurrency + 1")
    parser.add_argument("--public-url", default=None, help="how sandboxes reach the capture proxy")
    parser.add_argument("--capture-dir", default=None, help="capture journals (default: OUTPUT_DIR/capture)")
    parser.add_argument(
        "--warm-template", default=DEFAULT_TEMPLATE, help="E2B template of the warm-up sandbox"
    )
    parser.add_argument("--warm-image", default=DEFAULT_IMAGE, help="image of the warm-up sandbox (hf)")
    parser.add_argument("--serve-ready-timeout", type=float, default=300.0)
    parser.add_argument("--warm-timeout", type=float, default=300.0)
    parser.add_argument("--stop-timeout", type=float, default=30.0, help="SIGTERM to SIGKILL, services")
    parser.add_argument("--trainer-stop-timeout", type=float, default=300.0, help="room for its checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="print the plan as JSON, start nothing")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    options = build_parser().parse_args(argv[:split])
    trainer_argv = argv[split + 1 :]
    environ = dict(os.environ)
    public_url = options.public_url
    if public_url is None and environ.get(RUN_ID_ENV):
        if options.dry_run:
            public_url = f"https://<job id>--{options.capture_port}.hf.jobs"
        else:
            try:
                public_url = discover_public_url(
                    environ[RUN_ID_ENV], options.capture_port, namespace=environ.get(NAMESPACE_ENV) or None
                )
            except Exception as exc:  # any Hub failure: the run cannot expose its proxy, say why and stop
                print(f"error: cannot learn this job's public URL: {exc}", file=sys.stderr)
                return 1
            log(f"capture proxy public URL: {public_url}")
    try:
        plan = build_plan(options, trainer_argv, environ, public_url)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if options.dry_run:
        print(json.dumps(plan.model_dump(), indent=2))
        return 0
    supervisor = Supervisor()
    supervisor.install_signal_handlers()
    return run(plan, environ, supervisor)


if __name__ == "__main__":
    sys.exit(main())
