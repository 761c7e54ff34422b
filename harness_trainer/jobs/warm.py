"""The job's warm-up: one E2B sandbox that must start and reach the capture proxy, then closes.

    python -m harness_trainer.jobs.warm --public-url URL [--template base]

Run by the job launcher before the trainer (``E2B_API_KEY`` in its environment, nothing else secret). It
checks the two things every rollout of the run depends on and that only a real sandbox can show: E2B
accepts the key and starts a sandbox, and from inside it ``URL/health`` answers (the Jobs proxy routes the
public port to the capture proxy). Exit status 0 when both hold; otherwise 1 and one line that says which.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness_trainer.sandboxes.base import SandboxError
from harness_trainer.sandboxes.e2b import E2BSandboxBackend
from harness_trainer.tasks.task import bare_task

_PROBE = (
    "if command -v curl >/dev/null 2>&1; then curl -fsS --max-time 30 {url}; else python3 -c "
    "'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=30).read())' {url}; fi"
)


class WarmupError(Exception):
    """The warm-up sandbox did not start, or could not reach the capture proxy."""


async def warm_sandbox(public_url: str, *, template: str = "base", sandbox_class: Any = None) -> str:
    """Start one E2B sandbox from ``template``, fetch ``public_url``/health inside it, close it.

    Returns what ``/health`` answered; raises :class:`WarmupError`. ``sandbox_class`` is the SDK boundary
    of :class:`E2BSandboxBackend` (tests pass a fake).
    """
    url = public_url.rstrip("/") + "/health"
    with tempfile.TemporaryDirectory() as folder:
        task = bare_task("job-warmup", Path(folder))
        backend = E2BSandboxBackend(template=template, sandbox_class=sandbox_class)
        try:
            sandbox = await backend.start(task, lifetime_s=120)
        except SandboxError as exc:
            raise WarmupError(f"no E2B sandbox: {exc}") from exc
        try:
            result = await sandbox.exec(_PROBE.format(url=shlex.quote(url)), timeout_s=60)
        except SandboxError as exc:
            raise WarmupError(f"the warm-up sandbox failed: {exc}") from exc
        finally:
            await sandbox.close()
    if result.exit_code != 0:
        detail = (result.stderr or result.stdout).strip()[-300:] or "timed out"
        raise WarmupError(f"an E2B sandbox cannot reach the capture proxy at {url}: {detail}")
    return result.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--public-url", required=True, help="the capture proxy as sandboxes see it")
    parser.add_argument("--template", default="base", help="E2B template of the warm-up sandbox")
    args = parser.parse_args(argv)
    try:
        answer = asyncio.run(warm_sandbox(args.public_url, template=args.template))
    except WarmupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"warm-up: an E2B sandbox reached {args.public_url}/health: {answer[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
