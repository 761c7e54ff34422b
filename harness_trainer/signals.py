"""A signal wakes the event loop, whichever thread the kernel gave it to.

Python runs a signal's handler in the main thread, between two bytecodes. Under ``asyncio.run`` the main
thread is mostly asleep in the selector; when the kernel hands a process-directed signal (Ctrl-C's
SIGINT) to another thread, as it may in a process with several, nothing wakes the selector, and the
handler (asyncio's, which cancels the main task) waits for the loop's next event: with an agent asleep in
its sandbox, that can be its whole timeout. Python's C handler writes each caught signal's number to the
wakeup fd when one is set (``signal.set_wakeup_fd``): :func:`wake_on_signals` sets one that the running
loop reads, as asyncio does itself only for handlers added with ``loop.add_signal_handler``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def wake_on_signals(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """While inside, every signal Python catches wakes ``loop`` (running in the main thread), so its
    handler runs at once; the previous wakeup fd is restored after. Outside the main thread, or with a
    wakeup fd already set (asyncio's own, for ``loop.add_signal_handler``), it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if previous != -1:  # someone wakes the loop already: leave theirs in place
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        yield
        return

    def drain() -> None:
        with contextlib.suppress(OSError):  # BlockingIOError once empty: nothing more to read
            while reader.recv(4096):
                pass

    loop.add_reader(reader.fileno(), drain)
    try:
        yield
    finally:
        loop.remove_reader(reader.fileno())
        current = signal.set_wakeup_fd(-1)  # ours, back to none (as before: previous was none)
        if current != writer.fileno():  # replaced meanwhile (asyncio's own, say): the replacement stays
            signal.set_wakeup_fd(current)
        reader.close()
        writer.close()
