"""The agent's answer to a model call: its reply rendered in its dialect, or an error, once the call's
outcome is known (journaled first: see :mod:`capture_proxy.forward`).

A streaming client whose call takes longer than ``keepalive_s`` gets its headers and its dialect's
keepalive every ``keepalive_s``; an error after that arrives as an SSE error event. A dialect without one
(Gemini: Google's clients cannot skip an SSE comment) gets nothing until its reply or error. A call done
sooner starts no task and no stream: its whole event stream goes out as one body, in one write.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from capture_proxy.dialects.base import ChatCall, Dialect, Reply
from capture_proxy.state import ProxyState

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Outcome:
    """What the agent is answered with: a reply to render, or an error status and message."""

    reply: Reply | None = None
    status: int = 200
    error: str | None = None
    upstream_ms: float = 0.0
    body: bytes | None = None  # ``reply`` rendered for the agent, when that was done already


def done(outcome: Outcome) -> asyncio.Future[Outcome]:
    """``outcome``, already done, as :func:`respond` takes it."""
    future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
    future.set_result(outcome)
    return future


async def respond(
    request: web.Request,
    state: ProxyState,
    dialect: Dialect,
    call: ChatCall,
    pending: asyncio.Future[Outcome],
) -> web.StreamResponse:
    """Answer once ``pending`` is done; a streaming client gets keepalives while it is not."""
    keepalives = None
    if call.stream and dialect.keepalive is not None and not pending.done():
        keepalives = _Keepalives(request, pending, state.config.keepalive_s, dialect.keepalive)
    try:
        outcome = await pending
    except BaseException:
        if keepalives is not None:
            keepalives.cancel()
        raise
    stream = None
    if keepalives is not None:
        stream = await keepalives.finish()
        if keepalives.gone:
            return stream or web.Response(status=499)
    if outcome.reply is None:
        status, message = outcome.status, outcome.error or "error"
        if stream is None:
            return json_response(dialect.render_error(status, message), status)
        return await _finish(stream, dialect.render_stream_error(status, message))
    data = outcome.body if outcome.body is not None else render(dialect, call, outcome.reply)
    if not call.stream:
        return web.Response(body=data, content_type="application/json")
    if stream is None:
        # Nothing sent yet: the whole event stream goes out as one body, in one write.
        return web.Response(body=data, headers=SSE_HEADERS)
    return await _finish(stream, data)


class _Keepalives:
    """The dialect's keepalive (an SSE comment) to a streaming agent every ``interval`` seconds while
    ``pending`` is not done, the first of which opens the event stream. A call done within one interval
    starts nothing."""

    def __init__(
        self, request: web.Request, pending: asyncio.Future[Outcome], interval: float, frame: bytes
    ) -> None:
        self.request, self.frame = request, frame
        self.pending = pending
        self.interval = interval
        self.stream: web.StreamResponse | None = None
        self.gone = False  # the agent went away (the forward task still journals the call once)
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(interval, self._start)

    def _start(self) -> None:
        if not self.pending.done():
            self._task = asyncio.ensure_future(self._send())

    async def _send(self) -> None:
        while not self.pending.done():
            try:
                if self.stream is None:
                    self.stream = web.StreamResponse(headers=SSE_HEADERS)
                    await self.stream.prepare(self.request)
                await self.stream.write(self.frame)
            except (ConnectionError, RuntimeError):
                self.gone = True
                return
            await asyncio.wait({self.pending}, timeout=self.interval)

    async def finish(self) -> web.StreamResponse | None:
        """Once ``pending`` is done: the event stream, if one was opened (no keepalive is written after)."""
        self._timer.cancel()
        if self._task is not None:
            await self._task
        return self.stream

    def cancel(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


def render(dialect: Dialect, call: ChatCall, reply: Reply) -> bytes:
    """``reply`` as the agent gets it: its dialect's JSON, or (``stream``) the whole SSE replay."""
    if call.stream:
        return b"".join(dialect.render_stream(reply, call))
    return orjson.dumps(dialect.render_reply(reply, call))


async def _finish(stream: web.StreamResponse, data: bytes) -> web.StreamResponse:
    try:
        await stream.write(data)
        await stream.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # the agent disconnected; nothing left to deliver
    return stream


def json_response(payload: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")
