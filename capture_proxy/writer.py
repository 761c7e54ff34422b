"""Group commit: one thread writes journal lines and fdatasyncs them in batches.

Every forwarded call must be on stable storage before its reply goes back, but a thread hop and an
``fdatasync`` per call cost more than the rest of the proxy's work. Lines queued while the thread is busy
are written together, each file is synced once per batch, and the event loop is woken once per batch.
Lines for one file are written in the order they were queued.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections import defaultdict

_Item = tuple[int, bytes, asyncio.AbstractEventLoop, asyncio.Future[None]]


class JournalWriter:
    """Writes ``data`` to ``fd`` durably; :meth:`write` returns once it is synced."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    async def write(self, fd: int, data: bytes, inline: bool = False) -> None:
        """Append ``data`` to ``fd`` and fdatasync it (raises the ``OSError`` if that failed).

        ``inline`` writes on the calling thread when the writer has nothing queued: for a caller that
        knows nothing else is waiting on its event loop, the thread hop would cost more than the sync.
        """
        if inline and self._queue.empty():
            write_all(fd, data)
            os.fdatasync(fd)
            return
        self._ensure_started()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.put((fd, data, loop, future))
        await future

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _ensure_started(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="journal-writer", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            batch = [first]
            while first is not None:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            items = [item for item in batch if item is not None]
            if items:
                self._commit(items)
            if None in batch:
                return

    @staticmethod
    def _commit(items: list[_Item]) -> None:
        failed: dict[int, OSError] = {}
        for fd, data, _, _ in items:
            if fd in failed:
                continue
            try:
                write_all(fd, data)
            except OSError as exc:
                failed[fd] = exc
        for fd in {fd for fd, *_ in items} - failed.keys():
            try:
                os.fdatasync(fd)
            except OSError as exc:
                failed[fd] = exc
        by_loop: defaultdict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[None], OSError | None]]]
        by_loop = defaultdict(list)
        for fd, _, loop, future in items:
            by_loop[loop].append((future, failed.get(fd)))
        for loop, results in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve, results)
            except RuntimeError:
                pass  # the loop is closed: nobody is waiting any more


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _resolve(results: list[tuple[asyncio.Future[None], OSError | None]]) -> None:
    for future, error in results:
        if future.done():
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
