"""A white-box session's environment: a task's sandbox offered as tools, with no agent and no capture session.

The trainer samples the model itself and drives the episode over the rollout server's HTTP API (issue 23):
it lists the tools, calls them one by one, then asks for the verdict. Contract of :class:`Environment`:

1. :meth:`~Environment.start` starts a sandbox for the task (lifetime: the episode timeout plus the
   verifier's, plus slack) and wraps it in :class:`~harness_trainer.sandboxes.tools.SandboxTools`.
2. One operation at a time (a tool call or the verify), in arrival order; each is a task the environment
   owns, so :meth:`~Environment.close` can cancel it (a cancelled command is killed).
3. A tool call answers what ``SandboxTools.call_tool`` answers: the model's mistakes (an unknown tool, bad
   arguments, a missing file, a timeout) are error results, counted. A dead sandbox
   (:class:`~harness_trainer.sandboxes.base.SandboxError`) fails the environment: its sandbox is closed
   at once, and this and every later call raise :class:`EnvironmentGone` (the episode is unscorable).
4. :meth:`~Environment.verify` ends the episode: the task's ``tests/`` are uploaded, its verifier run
   (:mod:`~harness_trainer.rollouts.server.verifier`, as in a black-box rollout), then the sandbox is
   closed. The verdict is kept: verifying again returns it; a tool call after it raises
   :class:`EpisodeOver`.
5. :meth:`~Environment.close` is idempotent and never raises: it cancels the operation in flight and
   closes the sandbox. Every path closes the sandbox: a failed start (the backend cleans up what it
   made), a dead sandbox, the verify, ``DELETE``, the idle reaper and server shutdown.

``openenv`` (the extra :mod:`~harness_trainer.sandboxes.tools` needs) is imported when an environment is
made, so a server without it still serves black-box rollouts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from harness_trainer.finish import finish
from harness_trainer.rollouts.result import EnvironmentOptions, EnvironmentVerdict
from harness_trainer.rollouts.server.sandbox_meter import SandboxMeter
from harness_trainer.rollouts.server.verifier import run_verifier, upload_tests
from harness_trainer.sandboxes.base import Sandbox, SandboxBackend, SandboxError
from harness_trainer.tasks.task import HarborTask

if TYPE_CHECKING:
    from openenv.core.harness import ToolResult

    from harness_trainer.sandboxes.tools import SandboxTools

log = logging.getLogger(__name__)
SANDBOX_SLACK_S = 300.0
"""Sandbox lifetime beyond the episode and verifier timeouts (start and cleanup)."""
T = TypeVar("T")


class EnvironmentGone(RuntimeError):
    """The environment's sandbox is gone (died, closed, or the session was closed): unscorable."""


class EpisodeOver(RuntimeError):
    """The episode was verified: no tool runs after its verdict."""


class Environment:
    """One white-box session's sandbox and tools; see the module docstring for the contract.

    Raises ValueError for ``options.tool_limits`` that :class:`ToolLimits` refuses, a multi-step task or
    one whose verifier is separate (an episode here is one instruction and one verdict, in its sandbox),
    ImportError without the ``openenv`` extra.
    """

    def __init__(self, task: HarborTask, options: EnvironmentOptions, backend: SandboxBackend) -> None:
        from harness_trainer.sandboxes.tools import ToolLimits

        if task.separate_verifier is not None:
            raise ValueError(
                f"{task.name} has a separate verifier: a white-box episode is verified in its own sandbox; "
                "run it as a black-box rollout"
            )
        if task.steps:
            raise ValueError(
                f"{task.name} is a multi-step task ({len(task.steps)} steps): a white-box episode is one "
                "instruction and one verdict; run it as a black-box rollout"
            )

        try:
            self.limits = ToolLimits(**options.tool_limits)
        except TypeError as exc:  # an unknown keyword
            raise ValueError(f"tool_limits: {exc}") from None
        self.task, self.options, self.backend = task, options, backend
        self.sandbox: Sandbox | None = None
        self.tools: SandboxTools | None = None
        self.verdict: EnvironmentVerdict | None = None
        self.error: str | None = None
        self.closed = False
        self.phase_seconds: dict[str, float] = {}
        self.meter = SandboxMeter()
        self._lock = asyncio.Lock()
        self._operations: set[asyncio.Task[Any]] = set()

    @property
    def status(self) -> Literal["running", "ready", "done"]:
        """``running`` while starting or running a call, ``ready`` for the next call, ``done`` once verified,
        failed or closed."""
        if self.closed or self.error is not None or self.verdict is not None:
            return "done"
        return "running" if self._operations or self.tools is None else "ready"

    def summary(self) -> dict[str, Any]:
        """What ``GET /sessions/{id}`` shows of the environment."""
        metrics = self.tools.metrics() if self.tools is not None else {}
        return {
            "task": self.task.name,
            "sandbox": self.options.sandbox,
            "tool_calls_by_name": metrics.get("tool_calls_by_name", {}),
            "tool_failure_count": metrics.get("tool_failure_count", 0),
            "verdict": self.verdict.model_dump() if self.verdict is not None else None,
            "error": self.error,
        }

    async def start(self) -> None:
        """Start the sandbox and its tools; raises SandboxError (the sandbox is then closed) or
        EnvironmentGone (closed meanwhile)."""
        from harness_trainer.sandboxes.tools import SandboxTools

        await self._own(self._start(SandboxTools))

    async def _start(self, tools_class: type[SandboxTools]) -> None:
        episode = self.options.episode_timeout_sec or self.task.agent_timeout_sec
        started = time.monotonic()
        lifetime = episode + self.task.verifier_timeout_sec + SANDBOX_SLACK_S
        try:
            self.sandbox = await self.meter.start(self.backend, self.task, lifetime_s=lifetime)
        except Exception as exc:  # a failed start fails the environment (SandboxError, or a bug: logged)
            self.error = f"{type(exc).__name__}: {exc}"
            raise
        self.phase_seconds["sandbox_start"] = round(time.monotonic() - started, 4)
        self.tools = tools_class(self.sandbox, self.limits)

    async def call_tool(self, name: str, arguments: Any) -> ToolResult:
        """Tool ``name``'s result (rules 3 and 4 of the module docstring)."""
        return await self._own(self._call_tool(name, arguments))

    async def _call_tool(self, name: str, arguments: Any) -> ToolResult:
        async with self._lock:
            tools = self._usable()
            started = time.monotonic()
            try:
                return await tools.call_tool(name, arguments)
            except SandboxError as exc:
                await self._fail(f"{type(exc).__name__}: {exc}")
                raise EnvironmentGone(self.error) from exc
            finally:  # the episode's time in its tools: its environment time, beside the sandbox's phases
                spent = time.monotonic() - started
                self.phase_seconds["tools"] = round(self.phase_seconds.get("tools", 0.0) + spent, 4)

    async def verify(self) -> EnvironmentVerdict:
        """The verdict (rule 4); the same one again on a second call."""
        return await self._own(self._verify())

    async def _verify(self) -> EnvironmentVerdict:
        async with self._lock:
            if self.verdict is not None:
                return self.verdict
            tools = self._usable()
            assert self.sandbox is not None
            try:
                started = time.monotonic()
                await upload_tests(self.sandbox, self.task)
                uploaded = time.monotonic()
                outcome = await run_verifier(
                    self.sandbox, self.task, reward_key=self.options.reward_key, upload=False
                )
            except SandboxError as exc:
                await self._fail(f"{type(exc).__name__}: {exc}")
                raise EnvironmentGone(self.error) from exc
            self.phase_seconds["upload"] = round(uploaded - started, 4)
            self.phase_seconds["verifier"] = round(time.monotonic() - uploaded, 4)
            metrics = tools.metrics()
            self.verdict = EnvironmentVerdict(
                task_name=self.task.name, split=self.task.split, task_index=self.task.index,
                sandbox=self.options.sandbox, reward=outcome.reward, rewards=dict(outcome.rewards),
                reward_detail=outcome.detail, verifier_exit_code=outcome.exit_code,
                verifier_timed_out=outcome.timed_out, verifier_output_tail=outcome.output_tail,
                tool_calls_by_name=metrics["tool_calls_by_name"],
                tool_failures_by_name=metrics["tool_failures_by_name"],
                tool_failure_count=metrics["tool_failure_count"], submitted=tools.submitted,
                summary=tools.summary, phase_seconds=dict(self.phase_seconds),
                sandbox_seconds=round(self.meter.elapsed(), 4),
            )  # fmt: skip
            await self._close_sandbox()
            return self.verdict

    def _usable(self) -> SandboxTools:
        if self.closed:
            raise EnvironmentGone("the session was closed")
        if self.error is not None:
            raise EnvironmentGone(self.error)
        if self.verdict is not None:
            raise EpisodeOver("the episode was verified; open a new session for another")
        assert self.tools is not None  # start() ran: the routes make no call before it returns
        return self.tools

    async def _own(self, work: Awaitable[T]) -> T:
        """Run ``work`` as an operation :meth:`close` can cancel. Raises EnvironmentGone when it was
        cancelled that way; a cancellation of the caller cancels it too."""
        if self.closed:
            raise EnvironmentGone("the session was closed")
        operation = asyncio.ensure_future(work)
        self._operations.add(operation)
        try:
            await asyncio.wait({operation})
        except asyncio.CancelledError:
            operation.cancel()
            raise
        finally:
            if operation.done():
                self._operations.discard(operation)
            else:
                operation.add_done_callback(self._operations.discard)
        if operation.cancelled():
            raise EnvironmentGone("the session was closed while the call ran")
        return operation.result()

    async def _fail(self, reason: str) -> None:
        log.warning("white-box session on %s: sandbox failed: %s", self.task.name, reason)
        self.error = reason
        await self._close_sandbox()

    async def close(self) -> None:
        """Cancel the operation in flight and close the sandbox; idempotent, never raises."""
        self.closed = True
        running = [op for op in self._operations if op is not asyncio.current_task()]
        for operation in running:
            operation.cancel()
        if running:
            await asyncio.wait(running)
        await self._close_sandbox()

    async def _close_sandbox(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is None:
            return
        try:
            await finish(self.meter.close(sandbox))
        except Exception as exc:
            log.warning("closing the sandbox of a white-box session on %s failed: %r", self.task.name, exc)
