"""The job's warm-up: one remote sandbox that must start and reach the capture proxy, then closes.

    python -m harness_trainer.jobs.warm --public-url URL [--sandbox e2b|hf] [--template base]
        [--image python:3.12]

Run by the job launcher before the trainer when the run's sandbox backend is remote (its class's
``capabilities``: ``e2b``, ``hf``), with that backend's credentials in its environment (``E2B_API_KEY``;
``HF_TOKEN``), nothing else secret. It checks the two things every rollout of the run depends on and that
only a real sandbox can show: the provider accepts the credential and starts a sandbox (for ``hf``, the
backend's own check first: the token is valid and may run Jobs), and from inside it ``URL/health``
answers (the Jobs proxy routes the public port to the capture proxy), as ``serve --prepare`` checks
before the first group (``fetch_command``). Exit status 0 when both hold; otherwise 1 and one line that
says which.

The warm-up sandbox's environment is named the way a task.toml names one, so that each backend takes its
own key and no option is backend-specific: ``[environment] e2b_template`` (``--template``, an E2B
template: nothing is built) and ``docker_image`` (``--image``, the image an ``hf`` sandbox runs; it needs
``curl`` or ``python3`` to fetch an https URL).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness_trainer.rollouts.run_options import DEFAULT_RUN
from harness_trainer.sandboxes import make_backend
from harness_trainer.sandboxes.base import SandboxError, fetch_command
from harness_trainer.signals import run_interruptible
from harness_trainer.tasks.task import EnvironmentSpec, bare_task


class WarmupError(Exception):
    """The warm-up sandbox did not start, or could not reach the capture proxy."""


DEFAULT_TEMPLATE = "base"
"""E2B's stock template."""
DEFAULT_IMAGE = "python:3.12"
"""``huggingface_hub``'s default sandbox image (it has ``curl`` and ``python3``)."""


async def warm_sandbox(
    public_url: str,
    *,
    sandbox: str = DEFAULT_RUN.sandbox,
    template: str = DEFAULT_TEMPLATE,
    image: str = DEFAULT_IMAGE,
    **options: Any,
) -> str:
    """Start one ``sandbox`` sandbox (of E2B ``template``, or of ``image``), fetch ``public_url``/health
    inside it, close it.

    Returns what ``/health`` answered; raises :class:`WarmupError`. ``options`` go to the backend (tests
    pass the E2B fake as ``sandbox_class``).
    """
    url = public_url.rstrip("/") + "/health"
    environment = EnvironmentSpec(docker_image=image, extra={"e2b_template": template})
    with tempfile.TemporaryDirectory() as folder:
        task = dataclasses.replace(bare_task("job-warmup", Path(folder)), environment=environment)
        backend = make_backend(sandbox, **options)
        try:
            started = await backend.start(task, lifetime_s=120)
        except SandboxError as exc:
            raise WarmupError(f"no {sandbox} sandbox: {exc}") from exc
        try:
            result = await started.exec(fetch_command(url), timeout_s=60)
        except SandboxError as exc:
            raise WarmupError(f"the warm-up sandbox failed: {exc}") from exc
        finally:
            await started.close()
            await backend.aclose()
    if result.exit_code != 0:
        detail = (result.stderr or result.stdout).strip()[-300:] or "timed out"
        raise WarmupError(f"the {sandbox} sandbox cannot reach the capture proxy at {url}: {detail}")
    return result.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--public-url", required=True, help="the capture proxy as sandboxes see it")
    parser.add_argument("--sandbox", default=DEFAULT_RUN.sandbox, help="the run's (remote) sandbox backend")
    parser.add_argument("--template", default=DEFAULT_TEMPLATE, help="the warm-up sandbox's E2B template")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="the warm-up sandbox's image (hf)")
    args = parser.parse_args(argv)
    try:
        answer = run_interruptible(
            warm_sandbox(args.public_url, sandbox=args.sandbox, template=args.template, image=args.image)
        )
    except (WarmupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"warm-up: the {args.sandbox} sandbox reached {args.public_url}/health: {answer[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
