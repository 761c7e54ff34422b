"""Sandbox-seconds: how long a rollout kept sandboxes running, which is what a remote backend bills.

A :class:`SandboxMeter` counts, for each sandbox a rollout starts through it (the agent's, a separate
verifier's), the time from the backend handing the sandbox over (created, its environment prepared) to the
end of its close, and sums them: two sandboxes open at once count twice. The wait before the create (a start
queued behind the start-rate limit, an image or template build) is left out, and so is the create itself,
which ``perf/sandbox_start_s`` shows. Every backend is counted alike: the meter wraps ``start`` and
``close``, whatever the backend. The trainer reports the mean per rollout of a step as
``sandbox/seconds_per_rollout`` (:func:`~harness_trainer.trainer.step.batch.sandbox_metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from harness_trainer.sandboxes.base import ForkingBackend, Sandbox, SandboxBackend, SandboxSnapshot
from harness_trainer.tasks.task import HarborTask


class SandboxMeter:
    """One rollout's sandbox-seconds so far (:attr:`seconds`: the closed sandboxes', :meth:`elapsed`: with
    the open ones' up to now); ``clock`` is monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = 0.0
        self._clock = clock
        self._opened: dict[int, float] = {}  # id(sandbox) -> when it was handed over

    async def start(
        self,
        backend: SandboxBackend,
        task: HarborTask,
        *,
        lifetime_s: float,
        env: dict[str, str] | None = None,
    ) -> Sandbox:
        """``backend.start(...)``'s sandbox, counted from now; a start that fails counts nothing."""
        return self._opening(await backend.start(task, lifetime_s=lifetime_s, env=env))

    async def start_from(
        self,
        backend: ForkingBackend,
        snapshot: SandboxSnapshot,
        task: HarborTask,
        *,
        lifetime_s: float,
        env: dict[str, str] | None = None,
    ) -> Sandbox:
        """``backend.start_from(...)``'s sandbox, counted from now, as :meth:`start`'s."""
        return self._opening(await backend.start_from(snapshot, task, lifetime_s=lifetime_s, env=env))

    def _opening(self, sandbox: Sandbox) -> Sandbox:
        self._opened[id(sandbox)] = self._clock()
        return sandbox

    async def close(self, sandbox: Sandbox) -> None:
        """``sandbox.close()``, its time counted once it ends (or fails); a second close adds nothing."""
        try:
            await sandbox.close()
        finally:
            opened = self._opened.pop(id(sandbox), None)
            if opened is not None:
                self.seconds += self._clock() - opened

    def elapsed(self) -> float:
        """:attr:`seconds` plus the time the still open sandboxes have run so far."""
        now = self._clock()
        return self.seconds + sum(now - opened for opened in self._opened.values())
