"""Fixtures: a fake vLLM engine and the capture proxy, both serving on loopback in a background loop.

``stack`` is a fresh pair per test (its own data dir); ``stack.new_session(...)`` mints a session via the
admin API and returns its JSON (``session_id``, ``base_url`` = ``…/v1``, ``root_url``,
``prefixed_base_url``); ``stack.admin`` is an httpx client with the admin key; ``stack.engine`` is the
:class:`FakeEngine` (queue faults, read the requests it received).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from capture_proxy.app import build_app
from capture_proxy.config import ProxyConfig
from harness_trainer.net import free_port
from tests.proxy.fake_engine import FakeEngine, ServerThread

ADMIN_KEY = "test-admin-key"


class Stack:
    def __init__(self, servers: ServerThread, data_dir: Path, **config: Any) -> None:
        self.servers = servers
        self.data_dir = data_dir
        self.engine = FakeEngine()
        self.engine_url = servers.serve(self.engine.app())
        self.config_overrides = config
        self.url = ""
        self.proxy_runner: web.AppRunner | None = None
        self.start_proxy()
        self.admin = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
        )

    def start_proxy(self) -> None:
        port = free_port()
        config = ProxyConfig(
            upstream=self.engine_url,
            data_dir=self.data_dir,
            admin_key=ADMIN_KEY,
            port=port,
            retry_backoff_s=0.01,
            **self.config_overrides,
        )
        self.url = self.servers.serve(build_app(config), port)
        self.proxy_runner = self.servers.runners[-1]
        if hasattr(self, "admin"):
            self.admin.base_url = httpx.URL(self.url)

    def stop_proxy(self) -> None:
        assert self.proxy_runner is not None
        self.servers.stop_runner(self.proxy_runner)
        self.proxy_runner = None

    @property
    def state(self) -> Any:
        from capture_proxy.state import STATE

        assert self.proxy_runner is not None
        return self.proxy_runner.app[STATE]

    def new_session(self, **spec: Any) -> dict[str, Any]:
        response = self.admin.post("/sessions", json=spec)
        assert response.status_code == 201, response.text
        return response.json()

    def calls(self, session_id: str) -> list[dict[str, Any]]:
        response = self.admin.get(f"/sessions/{session_id}/calls")
        assert response.status_code == 200, response.text
        return response.json()["calls"]

    def settled_calls(self, session_id: str, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The session's calls once one is journaled and a further 0.3 s passed (for a second, if any)."""
        deadline = time.monotonic() + timeout
        while not self.calls(session_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        return self.calls(session_id)

    def trace(self, session_id: str) -> dict[str, Any]:
        response = self.admin.get(f"/sessions/{session_id}/trace")
        assert response.status_code == 200, response.text
        return response.json()

    def close(self) -> None:
        self.admin.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerThread]:
    thread = ServerThread()
    yield thread
    thread.close()


@pytest.fixture
def stack(servers: ServerThread, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(servers, tmp_path / "data")
    yield stack
    stack.close()
    for runner in list(servers.runners):
        servers.stop_runner(runner)
