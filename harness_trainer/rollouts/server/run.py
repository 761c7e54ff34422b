"""One rollout, start to finish: capture session → sandbox → agent → verifier → trace → cleanup (for a
multi-step task, agent → verifier once per step, in one sandbox and one capture session).

``run_rollout`` never raises for what an agent or sandbox does: a crash, a hang past the timeout (the
agent is killed, its captured turns kept, ``timed_out`` set) or a spent step budget are results, and a
sandbox, install or proxy failure, or an engine that failed a model call past retries, makes the result
unscorable (``error`` set, reward None, ``error_kind`` saying which). A malformed capture (a
:class:`~harness_trainer.trace.CaptureContractError`) is a result too, of kind ``capture_contract``: the
trainer's side raises it again (:func:`~harness_trainer.rollouts.errors.error_for`) and stops training.
It raises only when cancelled. Every path closes the sandbox and deletes the capture session (after the
trace is read).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

from capture_proxy.admin_client import CaptureClient, CaptureError, NothingTrainable
from harness_trainer.finish import finish
from harness_trainer.harnesses import make_harness
from harness_trainer.harnesses.base import AgentEndpoint, AgentRun, Harness, HarnessError
from harness_trainer.harnesses.bundles import provision
from harness_trainer.rollouts.agreement import agreement
from harness_trainer.rollouts.errors import ErrorKind
from harness_trainer.rollouts.result import RolloutOptions, RolloutResult, StepResult
from harness_trainer.rollouts.server.group_setup import GroupSetups, Start
from harness_trainer.rollouts.server.sandbox_meter import SandboxMeter
from harness_trainer.rollouts.server.verifier import (
    VerifierOutcome,
    run_separate_verifier,
    run_verifier,
    upload_tests,
)
from harness_trainer.sandboxes.base import Sandbox, SandboxBackend, SandboxError
from harness_trainer.tasks.steps import SETUP_SCRIPT, TaskStep, rolled_up, stops_after
from harness_trainer.tasks.task import HarborTask
from harness_trainer.trace import CaptureContractError, load_trace

log = logging.getLogger(__name__)

EMPTY_TRACE: dict[str, Any] = {"schema_version": 1, "turns": []}
_SANDBOX_SLACK_S = 300.0  # sandbox lifetime beyond agent + verifier timeouts, for install and cleanup
_LOG_TAIL = 4000


@contextlib.contextmanager
def _phase(result: RolloutResult, name: str) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    finally:  # a multi-step task's steps add up
        spent = result.phase_seconds.get(name, 0.0) + time.monotonic() - started
        result.phase_seconds[name] = round(spent, 4)


async def run_rollout(
    task: HarborTask,
    options: RolloutOptions,
    *,
    capture: CaptureClient,
    backend: SandboxBackend,
    model: str,
    harness: Harness | None = None,
    stop: asyncio.Event | None = None,
    engine: dict[str, Any] | None = None,
    setups: GroupSetups | None = None,
) -> RolloutResult:
    """Run ``options.harness`` on ``task`` in a ``backend`` sandbox, its model calls through ``capture``.

    ``model`` is the served model name the agent is told; ``engine`` the capture session's own engine
    fields (``upstream``, ``model``, ``engine_headers``) when the rollout does not use the proxy's default.
    With ``setups``, a GRPO group's member on a backend that forks starts from its group's one setup
    (:mod:`~harness_trainer.rollouts.server.group_setup`; ``snapshot`` on the result says which).

    Setting ``stop`` ends the agent early as a timeout would (killed, ``timed_out``, turns kept); the
    verifier and trace export still run.
    """
    result = RolloutResult(
        task_name=task.name,
        split=task.split,
        task_index=task.index,
        harness=options.harness,
        sandbox=options.sandbox,
    )
    session_id: str | None = None
    sandbox: Sandbox | None = None
    meter = SandboxMeter()
    try:
        harness = harness or _harness(options.harness, options.harness_options)
        with _phase(result, "capture_session"):
            metadata = {
                "task": task.name,
                "split": task.split,
                "index": task.index,
                "episode_id": options.episode_id,
            }
            limit = options.agent_step_limit or None
            session = await capture.mint(options.sampling, limit, metadata, engine=engine)
        session_id = result.capture_session_id = session.session_id
        with _phase(result, "sandbox_start"):
            if harness.package is not None:  # its bundle (built once per machine) into the sandboxes
                backend.provide([await provision(harness.package)])
            lifetime = _lifetime(task, options)
            if setups is None:
                started = Start(await meter.start(backend, task, lifetime_s=lifetime))
            else:
                started = await setups.start(backend, task, options, harness, meter, lifetime_s=lifetime)
            sandbox = started.sandbox
            result.snapshot, result.group_setup_note = started.snapshot, started.note
        if started.setup_seconds:
            result.phase_seconds["group_setup_wait"] = started.setup_seconds
        if not started.installed:
            with _phase(result, "install"):
                await harness.install(sandbox)
        endpoint = AgentEndpoint(session.root_url, session.session_id, model)
        episode = _Episode(task, options, harness, sandbox, endpoint, stop, result, backend, meter)
        await (episode.run_steps() if task.steps else episode.run_once())
        with _phase(result, "trace"):
            result.trace = await _export(capture, session.session_id)
            summary = await capture.summary(session.session_id)
        turns = result.trace.get("turns", [])
        result.agreement = agreement(episode.agent_calls, [turn.get("request") for turn in turns])
        result.findings, result.model_calls = (
            list(summary.get("findings", [])),
            int(summary.get("model_calls", 0)),
        )
        # The engine failed a model call past the proxy's retries (5xx, dropped connections, timeouts) or
        # answered unusably: the agent's episode was cut short by the infrastructure, so its reward says
        # nothing about the policy. Unscorable (excluded from the group baseline), never a zero. An engine
        # 4xx refusal of the agent's request is not retried and stays the agent's result.
        failed = [f for f in result.findings if _engine_failure(f)]
        if failed:
            detail = str(failed[0].get("detail", ""))
            result.error = f"EngineFailure: the engine failed {len(failed)} model call(s): {detail}"
            result.error_kind = "engine"
    except CaptureContractError as exc:
        result.error, result.error_kind, result.error_rules = str(exc), "capture_contract", list(exc.rules)
    except (SandboxError, HarnessError, CaptureError) as exc:
        result.error, result.error_kind = f"{type(exc).__name__}: {exc}", _kind(exc)
    except Exception as exc:  # a rollout's failure is a result, never a crash of the caller
        log.exception("rollout of %s failed unexpectedly", task.name)
        result.error, result.error_kind = f"unexpected {type(exc).__name__}: {exc}", "unexpected"
    finally:
        with _phase(result, "cleanup"):
            try:
                await finish(_cleanup(capture, session_id, sandbox, meter))
            finally:
                if sandbox is not None and setups is not None:
                    setups.closed(sandbox)
        result.sandbox_seconds = round(meter.seconds, 4)
    if result.error is not None:
        result.reward, result.trace = None, None
    return result


def _lifetime(task: HarborTask, options: RolloutOptions) -> float:
    """The sandbox's lifetime: every agent and verifier timeout it may have to wait out, and some slack."""
    parts = task.steps or (task,)
    agents = sum(options.agent_timeout_sec or part.agent_timeout_sec for part in parts)
    return agents + sum(part.verifier_timeout_sec for part in parts) + _SANDBOX_SLACK_S


@dataclass
class _Episode:
    """What a rollout's agent runs and verifier runs share: the task, its options and harness, the sandbox,
    the capture endpoint, the stop signal, the result being filled in, the backend (for a separate
    verifier's sandbox) and the meter of the rollout's sandbox-seconds."""

    task: HarborTask
    options: RolloutOptions
    harness: Harness
    sandbox: Sandbox
    endpoint: AgentEndpoint
    stop: asyncio.Event | None
    result: RolloutResult
    backend: SandboxBackend
    meter: SandboxMeter
    agent_calls: list[list[dict[str, Any]]] | None = field(default_factory=list)
    """The agent's own record of its model calls, over its runs (None once a run kept none)."""

    async def agent(self, instruction: str, timeout_s: float) -> tuple[int | None, bool]:
        """One agent run on ``instruction`` (:func:`_record_agent`'s exit code and timeout)."""
        with _phase(self.result, "agent"):
            run = self.harness.run(
                self.sandbox, instruction, self.endpoint, step_limit=self.options.agent_step_limit,
                timeout_s=self.options.agent_timeout_sec or timeout_s,
            )  # fmt: skip
            ran = await _until_stopped(run, self.stop)
            if self.agent_calls is not None:
                self.agent_calls = (
                    None if ran is None or ran.record is None else self.agent_calls + ran.record
                )
            return _record_agent(self.result, ran)

    async def verify(self, step: TaskStep | None = None) -> VerifierOutcome:
        """The task's (or ``step``'s) verifier: in the agent's sandbox, or in one of its own."""
        task, key = self.task, self.options.reward_key
        if (task.separate_verifier if step is None else step.separate_verifier) is not None:
            with _phase(self.result, "verifier"):
                return await run_separate_verifier(
                    self.sandbox, task, self.backend, self.meter, reward_key=key, step=step
                )
        with _phase(self.result, "upload"):
            await upload_tests(self.sandbox, task, step)
        with _phase(self.result, "verifier"):
            return await run_verifier(self.sandbox, task, reward_key=key, upload=False, step=step)

    async def run_once(self) -> None:
        """The agent on the task's instruction, then its verifier: a task of one instruction."""
        await self.agent(self.task.instruction, self.task.agent_timeout_sec)
        outcome = await self.verify()
        self.result.reward, self.result.rewards = outcome.reward, dict(outcome.rewards)
        self.result.reward_detail = outcome.detail

    async def run_steps(self) -> None:
        """A multi-step task's steps in order, each a new agent run on the step's instruction followed by
        the step's verifier (:mod:`harness_trainer.tasks.steps`); the reward is their roll-up. The steps end
        early when one misses its ``min_reward`` or ``stop`` is set; a step the verifier gave no reward
        leaves the rollout ungraded (reward None, ``reward_detail`` naming the step)."""
        result, rewards = self.result, []
        for step in self.task.steps:
            started = time.monotonic()
            with _phase(result, "setup"):
                await _set_up(self.sandbox, step)
            exit_code, timed_out = await self.agent(step.instruction, step.agent_timeout_sec)
            outcome = await self.verify(step)
            done = StepResult(
                name=step.name, reward=outcome.reward, rewards=dict(outcome.rewards),
                reward_detail=outcome.detail, exit_code=exit_code, timed_out=timed_out,
                seconds=round(time.monotonic() - started, 4),
            )  # fmt: skip
            result.steps.append(done)
            if outcome.reward is None:
                result.reward_detail = f"step {step.name!r}: {outcome.detail}"
                return
            rewards.append(outcome.reward)
            if stops_after(step, outcome.reward, outcome.rewards) or (
                self.stop is not None and self.stop.is_set()
            ):
                break
        strategy, ran = self.task.reward_strategy, ", ".join(f"{s.name} {s.reward:g}" for s in result.steps)
        result.reward = rolled_up(strategy, self.task.steps, rewards)
        result.reward_detail = f"{strategy} of {len(self.task.steps)} steps ({ran}; the rest not run: 0)"


async def _set_up(sandbox: Sandbox, step: TaskStep) -> None:
    """Copy ``step``'s ``workdir/`` into the working directory and run its ``setup.sh`` there (then remove
    it: it is the task's hook, not the agent's material).

    Raises:
        SandboxError: the copy failed, or the setup script did (the task is broken, not the agent).
    """
    if not step.workdir_dir.is_dir():
        return
    await sandbox.upload_dir(step.workdir_dir, sandbox.workdir)
    if not (step.workdir_dir / SETUP_SCRIPT).is_file():
        return
    ran = await sandbox.exec(
        f"bash {SETUP_SCRIPT} && rm -f {SETUP_SCRIPT}", timeout_s=step.agent_timeout_sec, cwd=sandbox.workdir
    )
    if ran.exit_code != 0:
        output = (ran.stdout + ran.stderr)[-_LOG_TAIL:]
        raise SandboxError(f"step {step.name!r}: {SETUP_SCRIPT} exited with {ran.exit_code}: {output}")


def _record_agent(result: RolloutResult, run: AgentRun | None) -> tuple[int | None, bool]:
    """What an agent run did, added to ``result`` (a multi-step task's runs add up: its last exit code, and
    ``timed_out`` if any run timed out); returns the run's own exit code and timeout."""
    if run is None:  # stopped before it ended
        result.timed_out = True
        return None, True
    result.exit_code, result.timed_out = run.result.exit_code, result.timed_out or run.result.timed_out
    for name, count in run.tools.calls_by_name.items():
        result.tool_calls_by_name[name] = result.tool_calls_by_name.get(name, 0) + count
    result.tool_failure_count += run.tools.failures
    result.log_tail = (result.log_tail + run.log)[-_LOG_TAIL:]
    return run.result.exit_code, run.result.timed_out


def _kind(exc: SandboxError | HarnessError | CaptureError) -> ErrorKind:
    if isinstance(exc, SandboxError):
        return "sandbox"
    return "harness" if isinstance(exc, HarnessError) else "capture"


def _engine_failure(finding: dict[str, Any]) -> bool:
    """A capture finding saying the engine failed a call past the proxy's retries, or replied unusably."""
    return finding.get("code") in ("engine_unavailable", "malformed_reply")


async def _until_stopped(agent: Coroutine[Any, Any, AgentRun], stop: asyncio.Event | None) -> AgentRun | None:
    """The agent's run, or None if ``stop`` was set first (then the agent is cancelled: commands killed)."""
    task = asyncio.ensure_future(agent)
    stopper = asyncio.ensure_future((stop or asyncio.Event()).wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()  # the rollout is being cancelled: the agent goes with it, its commands killed
        await finish(task)
        raise
    finally:
        stopper.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _harness(name: str, options: dict[str, Any]) -> Harness:
    try:
        return make_harness(name, **options)
    except ValueError as exc:
        raise HarnessError(str(exc)) from None


async def _export(capture: CaptureClient, session_id: str) -> dict[str, Any]:
    """The validated trace; an empty one when the agent never made a trainable call."""
    try:
        raw = await capture.trace(session_id)
    except NothingTrainable:
        return dict(EMPTY_TRACE)
    # Raises CaptureContractError on a malformed capture; off the event loop, as long traces take seconds.
    await asyncio.to_thread(load_trace, raw, session_id=session_id)
    return raw


async def _cleanup(
    capture: CaptureClient, session_id: str | None, sandbox: Sandbox | None, meter: SandboxMeter
) -> None:
    """Close the sandbox (through ``meter``) and delete the capture session; both always attempted, neither
    raises (the caller finishes it through its cancellations)."""
    if sandbox is not None:
        try:
            await meter.close(sandbox)
        except Exception:  # cleanup must reach the capture session too
            log.warning("closing sandbox failed", exc_info=True)
    if session_id is not None:
        try:
            await capture.delete(session_id)
        except Exception:  # a leftover capture session is logged, not fatal
            log.warning("deleting capture session %s failed", session_id, exc_info=True)
