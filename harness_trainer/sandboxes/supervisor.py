"""The sandbox supervisor: a start-rate limit in front of a backend, and nothing left running at exit.

:class:`SandboxSupervisor` is itself a :class:`~harness_trainer.sandboxes.base.SandboxBackend`: wrap the
backend once per process and start every sandbox through it.

- Starts pass a token bucket (:class:`StartRateLimiter`: ``max_starts_per_s`` on average, bursts of up to
  ``burst``), so a burst of rollouts does not hammer E2B's API (or fork a hundred namespaces at once);
  at most ``max_starts_in_flight`` creates run at once (the rest queue in arrival order); each start first
  waits a random ``0..start_jitter_s`` so a GRPO group's members do not arrive at the provider in the
  same millisecond. Before all that, a start waits for the backend to prepare the task's environment
  (``prepare``: an image or template build), so builds never hold a slot or a token.
- Over a backend that forks (``capabilities.forks``), it forks too: ``start_from`` passes the same jitter,
  token bucket and in-flight cap as ``start`` (a start from a snapshot is a create at the provider), and is
  tracked alike; ``snapshot``, ``drop`` and ``snapshots`` are the backend's.
- It tracks every sandbox it started that is not closed yet. ``aclose()`` refuses new starts, closes
  them all concurrently, each bounded by ``close_timeout_s``, then closes the backend (which closes
  anything it still holds). A sandbox that finishes starting after shutdown began is closed at once.
- ``install_signal_handlers(loop)``: on SIGTERM (by default) it runs ``aclose()``, then calls
  ``on_closed(signum)`` if given, else restores the default action and re-raises the signal so the
  process exits as a terminated process would, with every sandbox closed first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Sequence

from harness_trainer.sandboxes.base import (
    AgentProvision,
    ForkingBackend,
    Sandbox,
    SandboxBackend,
    SandboxSnapshot,
    SandboxStartError,
)
from harness_trainer.tasks.task import HarborTask

log = logging.getLogger(__name__)


class StartRateLimiter:
    """A token bucket: ``acquire()`` returns at most ``rate_per_s`` times a second on average, with up to
    ``burst`` at once after a quiet spell. Waiters are served in arrival order."""

    def __init__(self, rate_per_s: float, burst: int = 1) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError(f"need rate_per_s > 0 and burst >= 1, got {rate_per_s} and {burst}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = float(burst)
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            self._refill()
            if self._tokens < 1:
                await asyncio.sleep((1 - self._tokens) / self.rate_per_s)
                self._refill()
            self._tokens -= 1

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate_per_s)
        self._stamp = now


class SandboxSupervisor:
    """Rate-limited starts, and every live sandbox closed on shutdown or SIGTERM (see module docstring)."""

    def __init__(
        self,
        backend: SandboxBackend,
        *,
        max_starts_per_s: float | None = None,
        burst: int = 1,
        max_starts_in_flight: int | None = None,
        start_jitter_s: float = 0.0,
        close_timeout_s: float = 30.0,
    ) -> None:
        if max_starts_in_flight is not None and max_starts_in_flight < 1:
            raise ValueError(f"max_starts_in_flight must be at least 1, got {max_starts_in_flight}")
        if start_jitter_s < 0:
            raise ValueError(f"start_jitter_s must be >= 0, got {start_jitter_s}")
        self.backend = backend
        self.name = backend.name
        self.capabilities = backend.capabilities
        self.close_timeout_s = close_timeout_s
        self.start_jitter_s = start_jitter_s
        self._limiter = StartRateLimiter(max_starts_per_s, burst) if max_starts_per_s else None
        self._in_flight = asyncio.Semaphore(max_starts_in_flight) if max_starts_in_flight else None
        self._live: list[Sandbox] = []
        self._closing = False
        self._signals: tuple[int, ...] = ()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown: asyncio.Task[None] | None = None

    @property
    def live(self) -> list[Sandbox]:
        """Sandboxes started here and not closed yet."""
        self._live = [s for s in self._live if not getattr(s, "closed", False)]
        return list(self._live)

    async def start(
        self, task: HarborTask, *, lifetime_s: float, env: dict[str, str] | None = None
    ) -> Sandbox:
        if self._closing:
            raise SandboxStartError("the sandbox supervisor is shutting down")
        # Outside the limits: a start waiting for its environment's build holds no slot and no token, so
        # the starts of environments already built (and the builds of the others) go on meanwhile.
        await self.backend.prepare(task)
        return await self._limited(lambda: self.backend.start(task, lifetime_s=lifetime_s, env=env))

    async def start_from(
        self,
        snapshot: SandboxSnapshot,
        task: HarborTask,
        *,
        lifetime_s: float,
        env: dict[str, str] | None = None,
    ) -> Sandbox:
        """The backend's ``start_from``, through the same limits as :meth:`start`."""
        if self._closing:
            raise SandboxStartError("the sandbox supervisor is shutting down")
        forking = self._forking()
        return await self._limited(lambda: forking.start_from(snapshot, task, lifetime_s=lifetime_s, env=env))

    async def _limited(self, create: Callable[[], Awaitable[Sandbox]]) -> Sandbox:
        if self.start_jitter_s:
            await asyncio.sleep(random.uniform(0, self.start_jitter_s))
        if self._limiter is not None:
            await self._limiter.acquire()
        async with self._in_flight or contextlib.nullcontext():
            sandbox = await create()
        if self._closing:
            await sandbox.close()
            raise SandboxStartError("the sandbox supervisor shut down while this sandbox started")
        self._live = [*self.live, sandbox]  # prunes closed ones as it goes
        return sandbox

    @property
    def snapshots(self) -> list[SandboxSnapshot]:
        return self._forking().snapshots

    async def snapshot(self, sandbox: Sandbox) -> SandboxSnapshot:
        return await self._forking().snapshot(sandbox)

    async def drop(self, snapshot: SandboxSnapshot) -> None:
        await self._forking().drop(snapshot)

    def _forking(self) -> ForkingBackend:
        if not self.capabilities.forks:
            raise TypeError(f"the {self.name} backend does not fork (capabilities.forks is false)")
        return self.backend  # type: ignore[return-value]

    def provide(self, agents: Sequence[AgentProvision]) -> None:
        self.backend.provide(agents)

    async def prepare(self, task: HarborTask) -> None:
        await self.backend.prepare(task)

    async def aclose(self) -> None:
        """Close every live sandbox (concurrently, each bounded), then the backend; idempotent."""
        self._closing = True
        sandboxes = self.live
        self._live = []
        results = await asyncio.gather(
            *(asyncio.wait_for(s.close(), self.close_timeout_s) for s in sandboxes), return_exceptions=True
        )
        for sandbox, result in zip(sandboxes, results, strict=True):
            if isinstance(result, BaseException):
                log.error("sandbox %s did not close cleanly: %r", sandbox.id, result)
        try:
            await asyncio.wait_for(self.backend.aclose(), self.close_timeout_s)
        except Exception as exc:  # shutdown goes on; the error is reported, not raised over the cause
            log.error("sandbox backend %s did not close cleanly: %r", self.name, exc)

    def install_signal_handlers(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        signals: Sequence[int] = (signal.SIGTERM,),
        on_closed: Callable[[int], object] | None = None,
    ) -> None:
        """On any of ``signals``: close everything, then ``on_closed(signum)`` or die of the signal."""
        self._loop = loop or asyncio.get_running_loop()
        self._signals = tuple(signals)
        for signum in self._signals:
            self._loop.add_signal_handler(signum, self._on_signal, signum, on_closed)

    def remove_signal_handlers(self) -> None:
        if self._loop is not None:
            for signum in self._signals:
                self._loop.remove_signal_handler(signum)
        self._signals = ()

    def _on_signal(self, signum: int, on_closed: Callable[[int], object] | None) -> None:
        if self._shutdown is not None:
            return  # already closing; a second signal changes nothing
        log.warning("signal %d: closing %d live sandboxes", signum, len(self.live))
        self._shutdown = asyncio.ensure_future(self._close_then_exit(signum, on_closed))

    async def _close_then_exit(self, signum: int, on_closed: Callable[[int], object] | None) -> None:
        await self.aclose()
        if on_closed is not None:
            on_closed(signum)
            return
        self.remove_signal_handlers()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
