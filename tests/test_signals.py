"""A signal the kernel hands to another thread still reaches ``asyncio.run``'s handler under
:func:`harness_trainer.signals.wake_on_signals` and the entry points' ``run_interruptible``; the ticking
stops once the block is left."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from harness_trainer.signals import wake_on_signals


def interrupt_itself_once_the_loop_sleeps() -> None:
    """Sends SIGINT to this thread, not the main one, once the main thread's loop is asleep in its
    selector (Python still runs the handler in the main thread: when that thread next runs). The kernel
    gives a process-directed signal only to a thread that does not block it, so this thread unblocks it
    first: a thread inherits its creator's mask, and a library loaded earlier in the test process may have
    left SIGINT blocked in the main thread (a CI run had this test wait for ever)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    time.sleep(0.5)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)


@pytest.fixture(autouse=True)
def python_handles_sigint() -> None:
    """The handler under test is Python's own (asyncio.run installs its own over it only if so): an
    earlier test that left another one in place is named, not mistaken for this module's failure."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.getsignal(signal.SIGINT)


async def wait_forever_woken_by_signals(interrupter: threading.Thread) -> None:
    never = asyncio.Event()  # no timer, no I/O: only the ticks bring the loop back
    with wake_on_signals(asyncio.get_running_loop()):
        interrupter.start()
        await never.wait()


@pytest.mark.timeout(60)  # without the ticks the loop sleeps for ever and this timeout fails the test
def test_a_sigint_on_another_thread_cancels_asyncio_run() -> None:
    interrupter = threading.Thread(target=interrupt_itself_once_the_loop_sleeps)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(wait_forever_woken_by_signals(interrupter))
    interrupter.join()


async def timers_after_the_block() -> int:
    loop = asyncio.get_running_loop()
    with wake_on_signals(loop):
        await asyncio.sleep(0.5)  # a few ticks
    return sum(not handle.cancelled() for handle in loop._scheduled)  # type: ignore[attr-defined]


def test_leaving_the_block_stops_the_ticks() -> None:
    assert asyncio.run(timers_after_the_block()) == 0


@pytest.mark.timeout(60)  # the entry points' runner: the same, for a coroutine the caller made
def test_run_interruptible_cancels_on_a_sigint_taken_by_another_thread() -> None:
    from harness_trainer.signals import run_interruptible

    async def wait_forever() -> None:
        threading.Thread(target=interrupt_itself_once_the_loop_sleeps).start()
        await asyncio.Event().wait()

    with pytest.raises(KeyboardInterrupt):
        run_interruptible(wait_forever())
    assert run_interruptible(asyncio.sleep(0, result="done")) == "done"
