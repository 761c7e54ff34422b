"""A signal's handler runs soon, whichever thread the kernel gave the signal to.

Python runs a signal's handler in the main thread, when that thread next runs bytecode. Under
``asyncio.run`` the main thread is mostly asleep in the selector; when the kernel hands a process-directed
signal (Ctrl-C's SIGINT) to another thread, as it may in a process with several, nothing wakes the
selector, and the handler (asyncio's, which cancels the main task) waits for the loop's next event: with an
agent asleep in its sandbox, that can be its whole timeout. :func:`wake_on_signals` wakes the loop every
:data:`TICK_S` seconds, so a pending handler runs within that; :func:`run_interruptible` is ``asyncio.run``
with it, for the command-line entry points. (A wakeup fd, ``signal.set_wakeup_fd``, would
wake it at once, but a process has only one, which asyncio's ``add_signal_handler`` sets too; one tried
first did not wake the loop in a CI run, most likely because another was already set.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

TICK_S = 0.2
"""The longest a signal's handler waits for the loop, inside :func:`wake_on_signals`."""


@contextlib.contextmanager
def wake_on_signals(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """While inside, ``loop`` wakes every :data:`TICK_S` seconds (a no-op callback), so a signal caught on
    any thread has its handler run within that; the ticking stops on exit."""
    handle: asyncio.TimerHandle | None = None

    def tick() -> None:
        nonlocal handle
        handle = loop.call_later(TICK_S, tick)

    tick()
    try:
        yield
    finally:
        assert handle is not None
        handle.cancel()


def run_interruptible(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` with the loop ticking (:func:`wake_on_signals`): what the command-line entry
    points run, so Ctrl-C cancels ``main`` within :data:`TICK_S`, whichever thread took the SIGINT."""

    async def ticking() -> T:
        with wake_on_signals(asyncio.get_running_loop()):
            return await main

    return asyncio.run(ticking())
