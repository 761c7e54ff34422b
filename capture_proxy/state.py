"""Everything one running proxy holds, reachable from handlers as ``request.app[STATE]``."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from capture_proxy.config import ProxyConfig
from capture_proxy.metrics import Metrics
from capture_proxy.sessions import Policy, SessionStore
from capture_proxy.upstream import Upstream
from capture_proxy.wal import SharedLog, replay
from capture_proxy.writer import JournalWriter


class ProxyState:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        # Session files, deletes and trace exports. Journal lines: the writer, synced by its helper process.
        self.executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="proxy-io")
        self.writer = JournalWriter()
        self.wal = SharedLog(config.data_dir, self.writer)
        self.store = SessionStore(config.data_dir, self.executor, self.writer, self.wal)
        self.upstream = Upstream(
            config.upstream,
            timeout_s=config.upstream_timeout_s,
            attempts=config.upstream_attempts,
            pool_size=config.upstream_pool,
            backoff_s=config.retry_backoff_s,
            max_retry_after_s=config.max_retry_after_s,
            api_key=config.upstream_api_key,
        )
        self.metrics = Metrics()
        self.load_problems: list[str] = []
        self._model: str | None = config.served_model
        self.policy: Policy | None = None
        """Set by ``PUT /policy``: overrides the served model name and stamps the version on each call."""
        self._model_lock = asyncio.Lock()
        self._inflight: set[asyncio.Future[Any]] = set()

    async def start(self) -> None:
        await self.upstream.start()
        self.load_problems = replay(self.config.data_dir, self.store.root)
        self.load_problems += self.store.load_all()
        self.wal.open()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Let in-flight calls finish journaling (bounded), then close the pool and every journal."""
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=grace_s)
        for task in list(self._inflight):
            task.cancel()
        await self.upstream.close()
        await self.wal.stop_checkpoints()
        self.writer.close()
        self.store.close()
        self.wal.close()
        self.executor.shutdown(wait=True)

    @property
    def inflight(self) -> int:
        """Forward tasks not yet finished (calls being forwarded or journaled)."""
        return len(self._inflight)

    def track(self, task: asyncio.Future[Any]) -> None:
        """Keep a forward task referenced until it finishes, whatever happens to its handler."""
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    def finished(self, task: asyncio.Future[Any] | None) -> None:
        """``task`` has no more work to do (it is about to hand its outcome over)."""
        self._inflight.discard(task)

    async def model_name(self, asked: str) -> str:
        """The served model name: configured, else the engine's first model (asked once), else ``asked``."""
        if self._model is not None:
            return self._model
        async with self._model_lock:
            if self._model is None:
                try:
                    names = await self.upstream.models()
                except Exception:
                    return asked
                if names:
                    self._model = names[0]
        return self._model or asked


STATE = web.AppKey("capture_proxy_state", ProxyState)
