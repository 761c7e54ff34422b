"""A fake vLLM control plane served on loopback for each test that asks for one."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from aiohttp import web

from tests.engines.fake_vllm_control import FakeVLLM


@dataclass
class Served:
    """A running fake and its URL."""

    fake: FakeVLLM
    url: str


async def serve(app: web.Application, sock: socket.socket) -> web.AppRunner:
    """Serve ``app`` on the bound socket ``sock``; the caller cleans the runner up."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner


def bound_socket(port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


@pytest.fixture
async def serve_fake() -> AsyncIterator[Callable[..., Awaitable[Served]]]:
    """Start fakes (``await serve_fake(**FakeVLLM kwargs)``); all are stopped after the test."""
    runners: list[web.AppRunner] = []

    async def start(**kwargs) -> Served:
        fake = FakeVLLM(**kwargs)
        sock = bound_socket()
        runners.append(await serve(fake.app(), sock))
        return Served(fake, f"http://127.0.0.1:{sock.getsockname()[1]}")

    yield start
    for runner in runners:
        await runner.cleanup()
