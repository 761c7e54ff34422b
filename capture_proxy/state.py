"""Everything one running proxy holds, reachable from handlers as ``request.app[STATE]``."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from capture_proxy.config import ProxyConfig, engine_root
from capture_proxy.metrics import Metrics
from capture_proxy.replicas import ReplicaSet
from capture_proxy.sessions import Policy, SessionSpec, SessionStore
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
        self.upstreams = {
            root: Upstream(
                root,
                timeout_s=config.upstream_timeout_s,
                attempts=config.upstream_attempts,
                pool_size=config.upstream_pool,
                backoff_s=config.retry_backoff_s,
                max_retry_after_s=config.max_retry_after_s,
                api_key=config.upstream_api_key,
            )
            for root in config.engines
        }
        self.upstream = self.upstreams[engine_root(config.upstream)]
        """The default engine (``config.upstream``)."""
        self.replicas: ReplicaSet | None = None
        """With ``config.replicas``: every engine, a replica that sessions naming no engine are routed to."""
        if config.replicas:
            upstreams = list(self.upstreams.values())
            self.replicas = ReplicaSet(
                upstreams, config.served_model, config.probe_interval_s, policy_version=self._policy_version
            )
        self.metrics = Metrics()
        self.load_problems: list[str] = []
        self._models: dict[str, str] = {}
        """Served model name per engine root, learned from its ``/v1/models`` on first use."""
        if config.served_model is not None:
            self._models[self.upstream.root] = config.served_model
        self.policy: Policy | None = None
        """Set by ``PUT /policy``: overrides the served model name and stamps the version on each call."""
        self._model_lock = asyncio.Lock()
        self._inflight: set[asyncio.Future[Any]] = set()

    def _policy_version(self) -> int | None:
        return self.policy.version if self.policy is not None else None

    async def start(self) -> None:
        for upstream in self.upstreams.values():
            await upstream.start()
        if self.replicas is not None:
            try:
                await self.replicas.start()
            except BaseException:
                for upstream in self.upstreams.values():
                    await upstream.close()
                raise
        self.load_problems = replay(self.config.data_dir, self.store.root)
        self.load_problems += self.store.load_all()
        self.wal.open()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Let in-flight calls finish journaling (bounded), then close the pool and every journal."""
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=grace_s)
        for task in list(self._inflight):
            task.cancel()
        if self.replicas is not None:
            await self.replicas.stop()
        for upstream in self.upstreams.values():
            await upstream.close()
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

    def upstream_of(self, spec: SessionSpec) -> Upstream:
        """The engine a session's calls go to (its own, else the default); KeyError for one not allowed.
        ``spec.upstream`` is spelled by :func:`engine_root` since the session was minted. With replicas,
        a session naming no engine is routed by :attr:`replicas` instead (see :meth:`routed`)."""
        return self.upstream if spec.upstream is None else self.upstreams[spec.upstream]

    def routed(self, spec: SessionSpec) -> ReplicaSet | None:
        """The replica set that routes this session's calls, or None (it names its own engine, or the
        proxy has no replicas)."""
        return self.replicas if spec.upstream is None else None

    async def model_name(self, asked: str, upstream: Upstream | None = None) -> str:
        """The served model name at ``upstream`` (default: the default engine): configured, else the
        engine's first model (asked once), else ``asked``. With replicas, every engine serves the set's
        model, once known (so a default engine that is down is not asked)."""
        root = (upstream or self.upstream).root
        if root in self._models:
            return self._models[root]
        if self.replicas is not None and self.replicas.model is not None:
            return self.replicas.model
        async with self._model_lock:
            if root not in self._models:
                try:
                    names = await (upstream or self.upstream).models()
                except Exception:
                    return asked
                if names:
                    self._models[root] = names[0]
        return self._models.get(root, asked)


STATE = web.AppKey("capture_proxy_state", ProxyState)
