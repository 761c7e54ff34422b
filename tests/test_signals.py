"""A signal the kernel hands to another thread still wakes ``asyncio.run``'s loop under
:func:`harness_trainer.signals.wake_on_signals`, and the wakeup fd is left as it was found."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from harness_trainer.signals import wake_on_signals


def interrupt_itself_once_the_loop_sleeps() -> None:
    """Sends SIGINT to this thread, not the main one, once the main thread's loop is asleep in its
    selector (Python still runs the handler in the main thread: when that thread next runs)."""
    time.sleep(0.5)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)


async def wait_forever_woken_by_signals(interrupter: threading.Thread) -> None:
    never = asyncio.Event()  # no timer, no I/O: only a wakeup can bring the loop back
    with wake_on_signals(asyncio.get_running_loop()):
        interrupter.start()
        await never.wait()


@pytest.mark.timeout(60)  # without the wakeup the loop sleeps for ever and this timeout fails the test
def test_a_sigint_on_another_thread_cancels_asyncio_run_at_once() -> None:
    interrupter = threading.Thread(target=interrupt_itself_once_the_loop_sleeps)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(wait_forever_woken_by_signals(interrupter))
    interrupter.join()
    assert signal.set_wakeup_fd(-1) == -1  # restored: no wakeup fd left behind


async def inside_with_a_wakeup_fd_already_set() -> tuple[int, int]:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: None)  # asyncio sets its own wakeup fd for this
    try:
        theirs = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(theirs)
        with wake_on_signals(loop):
            inside = signal.set_wakeup_fd(-1)
            signal.set_wakeup_fd(inside)
        return theirs, inside
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)


def test_a_wakeup_fd_already_set_is_left_in_place() -> None:
    theirs, inside = asyncio.run(inside_with_a_wakeup_fd_already_set())
    assert theirs != -1 and inside == theirs


def test_outside_the_main_thread_it_changes_nothing() -> None:
    seen: list[int] = []

    def run() -> None:
        async def body() -> None:
            with wake_on_signals(asyncio.get_running_loop()):
                seen.append(0)

        asyncio.run(body())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [0] and signal.set_wakeup_fd(-1) == -1
