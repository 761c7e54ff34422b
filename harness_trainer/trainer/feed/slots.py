"""The scheduler's rollout slots: an async semaphore whose size changes while it is held.

:class:`~harness_trainer.trainer.feed.scheduling.RolloutScheduler` holds one slot per rollout in flight;
``set_concurrency_limit`` (the adaptive limit, :mod:`.concurrency`) resizes it without cancelling anyone.
"""

from __future__ import annotations

import asyncio
import collections


class Slots:
    """An async semaphore whose size (``limit``) may change while it is held: a rollout takes a slot while
    fewer than ``limit`` are held, waiting in arrival order otherwise. Used on the scheduler's loop only
    (``set_limit`` from elsewhere goes through ``call_soon_threadsafe``); the counts are read from any
    thread (ints, a moment's snapshot)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self._wake()

    async def __aenter__(self) -> None:
        if self.held < self.limit and not self._waiters:
            self.held += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # resolved by _wake, which counts the slot as held
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # given a slot and cancelled at once: give it back
                self.held -= 1
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            self._wake()  # whoever queued behind it may go now
            raise

    async def __aexit__(self, *exc: object) -> None:
        self.held -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.held < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():  # a cancelled one leaves in its own time
                waiter.set_result(None)
                self.held += 1
