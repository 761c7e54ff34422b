"""Cleanup that runs to its end even when its caller is cancelled.

A cleanup cut half-way leaks: a sandbox marked closed whose kill never finished (its VM billed until its
timeout, its files left), a capture session never deleted. Cancellations come in bursts when a run stops
(the scheduler cancels a rollout, then the server's stop cancels it again while it is closing), so
shielding one ``await`` is not enough. :func:`finish` keeps waiting through every cancellation and raises
the caller's cancellation once the work has ended: delayed, never lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def finish(work: Awaitable[T]) -> T:
    """``work``'s result, awaited to its end however often the caller is cancelled meanwhile.

    Raises:
        asyncio.CancelledError: the caller was cancelled while ``work`` ran (raised after it ended; an error
            of ``work`` is chained to it), or ``work`` itself was cancelled.
        Exception: whatever ``work`` raised, when the caller was not cancelled.
    """
    task = asyncio.ensure_future(work)
    interrupted = False
    while not task.done():
        try:
            await asyncio.wait({task})  # unlike awaiting the task, a cancelled wait leaves the task running
        except asyncio.CancelledError:
            interrupted = True
    if interrupted:
        error = None if task.cancelled() else task.exception()
        raise asyncio.CancelledError() from error
    return task.result()
