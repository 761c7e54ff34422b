"""The task's verifier, run in the rollout's sandbox: the server side of a rollout (tasks/ stays pure data).

Contract of :func:`run_verifier`: clears ``/logs/verifier``, replaces ``/tests`` with the task's
``tests/`` (so nothing the agent wrote there is run or read), runs ``bash /tests/test.sh`` with the
verifier timeout and ``[verifier] env``, then parses what it wrote. The verifier's own failures (non-zero
exit, timeout → ``timed_out`` and reward None, garbage or no reward file) are results; only a
:class:`~harness_trainer.sandboxes.base.SandboxError` (the sandbox itself failed) propagates. For a step of
a multi-step task (``step``), ``/tests`` is the task's ``tests/`` (where it has one) with the step's copied
over it, and the timeout and env are the step's.

A task (or step) whose verifier is separate (:class:`~harness_trainer.tasks.task.SeparateVerifier`) is
verified by :func:`run_separate_verifier` in a sandbox of its own, started from the verifier's environment,
which sees of the agent's work only the artifacts copied over (Harbor's ``/logs/artifacts`` and the task's
``artifacts``); where a tests folder defines that environment, its image holds ``/tests`` and nothing is
uploaded.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass

from harness_trainer.rollouts.server.sandbox_meter import SandboxMeter
from harness_trainer.sandboxes.base import Sandbox, SandboxBackend, SandboxError
from harness_trainer.tasks.reward import parse_reward
from harness_trainer.tasks.steps import TaskStep
from harness_trainer.tasks.task import HarborTask

VERIFIER_LOG_DIR = "/logs/verifier"
REWARD_TXT = f"{VERIFIER_LOG_DIR}/reward.txt"
REWARD_JSON = f"{VERIFIER_LOG_DIR}/reward.json"
TESTS_DIR = "/tests"
OUTPUT_TAIL_CHARS = 4096
_SETUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class VerifierOutcome:
    """One verifier run. ``exit_code`` is None when it was killed on timeout (``timed_out``)."""

    reward: float | None
    rewards: dict[str, float]
    detail: str
    exit_code: int | None
    timed_out: bool
    output_tail: str
    duration_s: float = 0.0


async def upload_tests(sandbox: Sandbox, task: HarborTask, step: TaskStep | None = None) -> None:
    """Empty the verifier's folders in ``sandbox`` and copy ``task``'s ``tests/`` in (only now: the agent
    never sees them), then ``step``'s over them.

    Raises:
        SandboxError: the sandbox could not run commands or copy files (not the verifier's fault).
    """
    await _setup(
        sandbox,
        # empty rather than remove: either folder may be a mount point in the sandbox
        f"mkdir -p {VERIFIER_LOG_DIR} {TESTS_DIR} && find {VERIFIER_LOG_DIR} {TESTS_DIR} -mindepth 1 -delete",
        f"could not prepare {VERIFIER_LOG_DIR} and {TESTS_DIR}",
    )
    for tests in [task.tests_dir] if step is None else [task.tests_dir, step.tests_dir]:
        if step is None or tests.is_dir():
            await sandbox.upload_dir(tests, TESTS_DIR)


async def run_verifier(
    sandbox: Sandbox,
    task: HarborTask,
    *,
    timeout_s: float | None = None,
    reward_key: str = "",
    upload: bool = True,
    step: TaskStep | None = None,
) -> VerifierOutcome:
    """Run ``task``'s verifier in ``sandbox`` and read its reward; see the module docstring. ``upload``:
    copy the tests in first (:func:`upload_tests`); False when the caller did, to time it on its own.

    Raises:
        SandboxError: the sandbox could not run commands or copy files (not the verifier's fault).
    """
    if upload:
        await upload_tests(sandbox, task, step)
    own = step or task
    limit = own.verifier_timeout_sec if timeout_s is None else timeout_s
    started = time.monotonic()
    env = dict(own.verifier_env) or None
    result = await sandbox.exec(f"bash {TESTS_DIR}/test.sh", timeout_s=limit, env=env)
    duration = time.monotonic() - started
    output_tail = _tail(result.stdout + result.stderr)
    if result.timed_out:
        detail = f"the verifier timed out after {limit:g} s"
        return VerifierOutcome(None, {}, detail, result.exit_code, True, output_tail, duration)

    parsed = parse_reward(
        await _read_optional(sandbox, REWARD_TXT), await _read_optional(sandbox, REWARD_JSON), reward_key
    )
    return VerifierOutcome(
        parsed.reward, parsed.rewards, parsed.detail, result.exit_code, False, output_tail, duration
    )


async def _read_optional(sandbox: Sandbox, path: str) -> bytes | None:
    try:
        return await sandbox.read_file(path)
    except FileNotFoundError:
        return None


async def _setup(sandbox: Sandbox, command: str, failure: str) -> None:
    """Run a setup command of the verifier's; its failure is the sandbox's (``failure``: its output's
    tail), not the verifier's."""
    ran = await sandbox.exec(command, timeout_s=_SETUP_TIMEOUT_S)
    if ran.exit_code != 0:
        raise SandboxError(f"{failure}: {_tail(ran.stdout + ran.stderr)}")


def _tail(text: str, limit: int = OUTPUT_TAIL_CHARS) -> str:
    return text if len(text) <= limit else text[-limit:]


ARTIFACTS_ARCHIVE = "/logs/.harness-trainer-artifacts.tgz"  # /logs: a sandbox's own in every backend
_SEPARATE_SLACK_S = 120.0  # a separate verifier sandbox's lifetime beyond its timeout: start, copy, close


async def collect_artifacts(sandbox: Sandbox, paths: tuple[str, ...]) -> bytes:
    """The ``paths`` of ``sandbox`` that exist, as one gzipped tar archive rooted at ``/`` (``tar`` is in
    every image Harbor tasks start from; one that lacks it is a sandbox failure, named).

    Raises:
        SandboxError: the archive could not be made or read.
    """
    listed = " ".join(shlex.quote(path) for path in paths)
    existing = f'for p in {listed}; do [ -e "$p" ] && printf \'%s\\n\' "${{p#/}}"; done'
    await _setup(
        sandbox,
        f"mkdir -p /logs && {{ {existing}; }} > {ARTIFACTS_ARCHIVE}.list; "
        f"tar -czf {ARTIFACTS_ARCHIVE} -C / -T {ARTIFACTS_ARCHIVE}.list && rm -f {ARTIFACTS_ARCHIVE}.list",
        f"could not archive the artifacts {list(paths)}",
    )
    return await sandbox.read_file(ARTIFACTS_ARCHIVE)


async def run_separate_verifier(
    agent_sandbox: Sandbox,
    task: HarborTask,
    backend: SandboxBackend,
    meter: SandboxMeter,
    *,
    reward_key: str = "",
    step: TaskStep | None = None,
) -> VerifierOutcome:
    """``task``'s (or ``step``'s) verifier in a sandbox of its own (its ``separate_verifier``): the
    artifacts of ``agent_sandbox`` copied in, the tests too where the verifier's image does not hold them,
    then :func:`run_verifier`. The verifier's sandbox is started and closed through ``meter`` (the rollout's
    sandbox-seconds), and closed on every path.

    Raises:
        SandboxError: either sandbox failed (starting the verifier's, copying the artifacts).
    """
    separate = task.separate_verifier if step is None else step.separate_verifier
    if separate is None:
        raise ValueError(f"{task.name}: its verifier shares the agent's sandbox")
    archive = await collect_artifacts(agent_sandbox, separate.artifacts)
    verifier_task = task.verifier_task(step)
    timeout = (step or task).verifier_timeout_sec
    sandbox = await meter.start(backend, verifier_task, lifetime_s=timeout + _SEPARATE_SLACK_S)
    try:
        await sandbox.write_file(ARTIFACTS_ARCHIVE, archive)
        await _setup(
            sandbox,
            f"mkdir -p {VERIFIER_LOG_DIR} && tar -xzf {ARTIFACTS_ARCHIVE} -C / && rm -f {ARTIFACTS_ARCHIVE}",
            "could not unpack the artifacts in the verifier's sandbox",
        )
        upload = not separate.from_tests
        return await run_verifier(sandbox, task, reward_key=reward_key, upload=upload, step=step)
    finally:
        await meter.close(sandbox)
