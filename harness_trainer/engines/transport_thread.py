"""A weight transport's blocking half (NCCL's rendezvous, its broadcast) run beside the HTTP call vLLM
answers only once that half is done: the two must overlap, or each waits for the other. The blocking half
runs on a daemon thread (:func:`_in_daemon_thread` says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from harness_trainer.engines.base import EngineUnavailable


async def alongside(
    request: Awaitable[Any], blocking: Callable[[], None], what: str, base_url: str, timeout_s: float
) -> None:
    """Run an HTTP ``request`` and the transport's ``blocking`` half (its ``what``: ``connect``, ``send``)
    together, for at most ``timeout_s``; fail when either fails, naming the engine at ``base_url``.

    Raises:
        EngineUnavailable: either side failed (the route's own error, or the transport's), or they were
            not both done in time.
    """
    http = asyncio.ensure_future(request)
    # Whichever side fails first is the error reported; reading the other's keeps asyncio quiet.
    http.add_done_callback(_observe)
    side = _in_daemon_thread(blocking, name=f"weight-transport-{what}")
    try:
        done, _ = await asyncio.wait({http, side}, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        if side in done and (exc := side.exception()) is not None:
            raise EngineUnavailable(f"weight transport {what}() to {base_url} failed: {exc!r}") from exc
        if http in done:
            http.result()  # raises the route's EngineUnavailable
        if len(done) < 2:
            raise EngineUnavailable(f"weight transport {what}() to {base_url}: not done in {timeout_s:.0f}s")
    finally:
        http.cancel()


def _observe(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as retrieved: after the first failure nobody awaits the other side."""
    if not future.cancelled():
        future.exception()


def _in_daemon_thread(fn: Callable[[], None], *, name: str) -> asyncio.Future[None]:
    """Run blocking ``fn`` on a daemon thread; its outcome lands in the returned future.

    Not ``asyncio.to_thread``: a thread stuck in an NCCL call cannot be interrupted, and the default
    executor is joined at loop shutdown, which would hang the process; a daemon thread dies with it.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    future.add_done_callback(_observe)

    def settle(exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)

    def run() -> None:
        outcome: BaseException | None = None
        try:
            fn()
        except BaseException as exc:  # handed to the awaiting coroutine, which decides what it means
            outcome = exc
        # The loop may be gone if the caller gave up and returned: then nobody wants the outcome.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
