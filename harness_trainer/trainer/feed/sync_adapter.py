"""A sync session factory as the async contract: each blocking call on a worker thread.

The scheduler has one code path, over :class:`~harness_trainer.rollouts.client.contract.AsyncSessionFactory`
and :class:`~harness_trainer.rollouts.client.contract.AsyncSession`. :func:`as_async` gives it a factory
with a coroutine ``acreate`` as it is, and wraps a sync one in :class:`ThreadedSessionFactory`: ``create``,
``wait_for_completion``, ``fetch_training_trace``, ``verify`` and ``close`` each run on a thread of the
scheduler's pool (one thread per rollout in flight, so rollouts block one another no more than they did
when each ran whole on one thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from harness_trainer.rollouts.client.contract import (
    AsyncSession,
    AsyncSessionFactory,
    CapturedTrace,
    RolloutFactory,
    Session,
    SessionFactory,
    Verification,
)

T = TypeVar("T")


def as_async(
    factory: RolloutFactory,
    executor: concurrent.futures.Executor,
    stopping: threading.Event,
    made: Callable[[AsyncSession], None] | None = None,
) -> AsyncSessionFactory[AsyncSession]:
    """``factory`` itself when it has a coroutine ``acreate``, else a :class:`ThreadedSessionFactory` over
    it (``executor``, ``stopping`` and ``made`` as there)."""
    if isinstance(factory, AsyncSessionFactory):
        return factory
    return ThreadedSessionFactory(factory, executor, stopping, made)


class ThreadedSession:
    """A :class:`Session` as an :class:`AsyncSession`: each call on a thread of ``executor``."""

    def __init__(self, session: Session, executor: concurrent.futures.Executor) -> None:
        self.session, self.executor = session, executor

    @property
    def session_id(self) -> str | None:
        # The one place a foreign session's shape is tolerated: OpenEnv's loop-owning sessions declare no
        # id (their factories are accepted as they are), so theirs reads as None, as the contract allows.
        return getattr(self.session, "session_id", None)

    async def wait(self, timeout_s: float | None = None) -> int:
        return await _on(self.executor, self.session.wait_for_completion, timeout_s)

    async def afetch_training_trace(self) -> CapturedTrace:
        return await _on(self.executor, self.session.fetch_training_trace)

    async def averify(self, completion: list[dict[str, Any]] | None = None) -> Verification:
        return await _on(self.executor, self.session.verify, completion)

    async def aclose(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # finalised after its loop closed (a stop that outwaited its drain): close here
            self.session.close()
            return
        await _on(self.executor, self.session.close)

    def close(self) -> None:
        self.session.close()


class ThreadedSessionFactory:
    """A :class:`SessionFactory` as an :class:`AsyncSessionFactory`: ``create`` on a thread of ``executor``,
    its sessions :class:`ThreadedSession` s.

    Each session is handed to ``made`` on the thread that made it, before its caller resumes: a caller whose
    event loop dies in between never resumes, and the scheduler's stop closes what ``made`` registered. A
    session made once ``stopping`` is set is closed on its thread at once and ``RuntimeError`` raised: its
    caller may be gone (the scheduler's loop stops without waiting for a slow ``create``), and nobody else
    would close it.
    """

    def __init__(
        self,
        factory: SessionFactory[Session],
        executor: concurrent.futures.Executor,
        stopping: threading.Event,
        made: Callable[[AsyncSession], None] | None = None,
    ) -> None:
        self.factory, self.executor, self.stopping, self.made = factory, executor, stopping, made

    async def acreate(
        self, task: Any, seed: int | None = None, episode_id: str | None = None
    ) -> ThreadedSession:
        create = functools.partial(self._create, task, seed=seed, episode_id=episode_id)
        return await _on(self.executor, create)

    def _create(self, task: Any, *, seed: int | None, episode_id: str | None) -> ThreadedSession:
        session = ThreadedSession(self.factory.create(task, seed=seed, episode_id=episode_id), self.executor)
        if self.made is not None:
            self.made(session)  # before the check: a stop after it finds the session registered
        if self.stopping.is_set():
            session.close()
            raise RuntimeError("training stopped while this rollout's session was made")
        return session


async def _on(executor: concurrent.futures.Executor, call: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(executor, call, *args)
