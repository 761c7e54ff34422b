"""The rollout runtime: a capture proxy, sandbox backends and a task source, shared by every rollout.

Used by the rollout server (``harness-trainer serve``) and by the in-process session factory. It starts
the capture proxy in its own event loop or, with ``proxy_process``, as a child process (or, with
``capture_url``, uses one already running), learns the engine's served model name, creates sandbox
backends on first use, and closes everything it started in :meth:`aclose`: running rollouts are
cancelled (which closes their sandboxes and capture sessions), then the backends and the proxy it
started are shut down (an external one keeps running).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from aiohttp import web

from capture_proxy.admin_client import CaptureClient
from capture_proxy.app import build_app
from capture_proxy.config import ProxyConfig, engine_root
from harness_trainer.harnesses import HARNESSES, HarnessError
from harness_trainer.harnesses.bundles import probe_agent, provision
from harness_trainer.rollouts.result import RolloutOptions, RolloutResult
from harness_trainer.rollouts.server.group_setup import GroupSetups
from harness_trainer.rollouts.server.proxy_process import ProxyProcess
from harness_trainer.rollouts.server.run import run_rollout
from harness_trainer.sandboxes import SandboxSupervisor, capabilities, make_backend, missing_credentials
from harness_trainer.sandboxes.base import SandboxBackend, SandboxStartError, fetch_command
from harness_trainer.tasks.task import HarborTask

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass
class RuntimeConfig:
    upstream: str
    """The engine's base URL (vLLM or the dev engine): where rollouts that name none send their calls."""
    data_dir: Path
    """Capture journals live here."""
    capture_url: str | None = None
    """An already-running capture proxy (``python -m capture_proxy``) to use instead of starting one; its
    admin key goes in ``admin_key``. The runtime neither starts nor stops it, so it can outlive (or be
    restarted under) the runtime. ``capture_host``/``capture_port`` are then unused."""
    capture_host: str = "127.0.0.1"
    capture_port: int = 8300
    public_url: str | None = None
    """How agents in sandboxes reach the capture proxy (default ``capture_url``, else
    ``http://capture_host:capture_port``)."""
    served_model: str | None = None
    """Model name for agents and upstream; default: the engine's first ``/v1/models`` entry."""
    admin_key: str | None = None
    """Capture proxy admin key; a random one by default (the runtime is its only admin client), required
    with ``capture_url``."""
    sandbox_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Constructor options per sandbox backend name, e.g. ``{"e2b": {"template": "..."}}``."""
    inherit_host_trust: bool = True
    """Backends on this machine (not ``remote`` ones) carry its CA bundle and proxy variables into image
    builds and sandboxes (:mod:`~harness_trainer.sandboxes.host_trust`); False: they get none."""
    sandbox_starts_per_s: float | None = None
    """Start-rate limit per backend (sandbox providers throttle bursts); None = unlimited."""
    max_sandbox_starts: int | None = None
    """Sandbox creates in flight at once, per backend (the rest queue); None = no cap."""
    sandbox_start_jitter_s: float = 0.0
    """Each sandbox start first waits a random 0..this many seconds (a group's members spread out)."""
    allowed_upstreams: tuple[str, ...] = ()
    """Further engines a rollout may name (``RolloutOptions.llm_url``); no other is forwarded to."""
    replicas: bool = False
    """``upstream`` and ``allowed_upstreams`` are replicas of one model: the capture proxy the runtime
    starts gets ``--replicas`` (each session that names no engine is pinned to one replica, moved off one
    that stops answering; :mod:`capture_proxy.replicas`). A replica that does not answer at start is
    listed with no models; the proxy probes it back in."""
    agents: tuple[str, ...] = ()
    """Harnesses whose agent bundles every backend gets before its first rollout or preparation, besides
    each rollout's own harness's (``serve --e2b-agent``: an E2B template's name includes them)."""
    proxy_process: bool = False
    """Run the capture proxy the runtime starts as a child process (``python -m capture_proxy``) instead of
    in this event loop: its own core and interpreter lock, and a crash of one does not take the other."""
    group_setup: bool = True
    """On a backend that forks (``capabilities.forks``), each GRPO group's environment and agent install
    are set up once and its members start from a snapshot of it
    (:mod:`~harness_trainer.rollouts.server.group_setup`); False: every member sets up its own."""


class RolloutRuntime:
    def __init__(self, config: RuntimeConfig) -> None:
        if config.capture_url is not None and not config.admin_key:
            raise ValueError("an external capture proxy (capture_url) needs its admin key (admin_key)")
        self.config = config
        self.admin_key = config.admin_key or secrets.token_urlsafe(24)
        self.model = config.served_model or ""
        self.engines: dict[str, list[str]] = {}
        """Each allowed engine (as :func:`engine_root` spells it, default first) → the models it serves."""
        self.capture: CaptureClient | None = None
        self._runner: web.AppRunner | None = None
        self._proxy_process: ProxyProcess | None = None
        self._backends: dict[str, SandboxBackend] = {}
        self._provided: set[str] = set()
        self._running: set[asyncio.Task[RolloutResult]] = set()
        self.setups = GroupSetups() if config.group_setup else None

    @property
    def proxy_pid(self) -> int | None:
        """The capture proxy child's pid, with ``proxy_process`` while it runs."""
        process = self._proxy_process.process if self._proxy_process is not None else None
        return process.pid if process is not None else None

    @property
    def capture_url(self) -> str:
        if self.config.capture_url is not None:
            return self.config.capture_url.rstrip("/")
        return f"http://{self.config.capture_host}:{self.config.capture_port}"

    async def start(self) -> None:
        """Start the capture proxy (unless an external one is configured) and learn the served model name."""
        if self.config.capture_url is not None:
            public = self.config.public_url or self.capture_url
            self.capture = CaptureClient(self.capture_url, self.admin_key, public_url=public)
            try:
                await self.capture.sessions()  # fail at start, not in every rollout, on a wrong URL or key
            except Exception:
                await self.capture.aclose()
                self.capture = None
                raise
        elif self.config.proxy_process:
            await self._start_proxy_process()
        else:
            await self._start_proxy()
        default, *others = self.engine_urls
        # A configured served model is trusted as before (the engine may come up later); others are asked.
        self.engines[default] = [self.model] if self.model else await engine_models(default)
        self.model = self.model or self.engines[default][0]
        for url in others:
            try:
                self.engines[url] = await engine_models(url)
            except RuntimeError:
                if not self.config.replicas:
                    raise
                self.engines[url] = []  # a replica may be down at start; the proxy probes it in

    @property
    def engine_urls(self) -> list[str]:
        """Every engine rollouts may use, default first."""
        roots = [engine_root(u) for u in (self.config.upstream, *self.config.allowed_upstreams)]
        return list(dict.fromkeys(roots))

    async def engine_problem(self, llm_url: str | None, model: str | None) -> str | None:
        """Why a rollout naming ``llm_url`` / ``model`` cannot run here, in one line; None when it can.

        The engine must be one this server was allowed (no open relay), and serve ``model`` (asked again
        once before refusing: LoRA adapters come and go)."""
        url = engine_root(llm_url) if llm_url else self.engine_urls[0]
        if url not in self.engine_urls:
            allowed = ", ".join(self.engine_urls)
            return f"llm_url {llm_url!r} is not an engine this server forwards to; allowed: {allowed}"
        if model is None or (model == self.model and url == self.engine_urls[0]):
            return None
        if model not in self.engines.get(url, []):
            try:
                self.engines[url] = await engine_models(url)
            except RuntimeError as exc:
                return str(exc)
        if model not in self.engines[url]:
            return f"engine {url} does not serve model {model!r}; it serves {self.engines[url]}"
        return None

    def engine_of(self, options: RolloutOptions) -> tuple[str, dict[str, Any] | None]:
        """The served model the agent is told, and the capture session's engine fields (None: the
        proxy's default engine and model)."""
        url = engine_root(options.llm_url) if options.llm_url else self.engine_urls[0]
        headers = options.engine_headers()
        if url == self.engine_urls[0] and options.model is None and not headers:
            return self.model, None
        model = options.model or (self.model if url == self.engine_urls[0] else self.engines[url][0])
        fields: dict[str, Any] = {"upstream": url, "model": model}
        if headers:
            fields["engine_headers"] = headers
        return model, fields

    async def _start_proxy(self) -> None:
        proxy = ProxyConfig(
            upstream=self.config.upstream,
            data_dir=self.config.data_dir,
            admin_key=self.admin_key,
            host=self.config.capture_host,
            port=self.config.capture_port,
            public_url=self.config.public_url,
            served_model=self.config.served_model,
            allowed_upstreams=self.config.allowed_upstreams,
            replicas=self.config.replicas,
        )
        self._runner = web.AppRunner(build_app(proxy), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.config.capture_host, self.config.capture_port).start()
        self.capture = CaptureClient(self.capture_url, self.admin_key, public_url=proxy.base_url)

    async def _start_proxy_process(self) -> None:
        process = ProxyProcess(
            self.config.upstream,
            self.config.data_dir,
            self.admin_key,
            self.config.capture_host,
            self.config.capture_port,
            public_url=self.config.public_url,
            served_model=self.config.served_model,
            allowed_upstreams=self.config.allowed_upstreams,
            replicas=self.config.replicas,
        )
        client = CaptureClient(self.capture_url, self.admin_key, public_url=self.config.public_url)
        try:
            await process.start(client)
        except BaseException:
            await process.stop()
            await client.aclose()
            raise
        self._proxy_process, self.capture = process, client

    async def set_policy(self, model: str | None, version: int) -> None:
        """Every model call from now on goes to served model ``model`` and records ``version`` (the
        capture proxy's ``PUT /policy``): how a trainer publishing a LoRA adapter per version moves the
        rollouts to the newest one. ``model=None`` stamps the version only (weights pushed in place)."""
        if self.capture is None:
            raise RuntimeError("the rollout runtime is not started")
        await self.capture.set_policy(model, version)
        if model is not None:
            self.model = model

    def sandbox_problem(
        self, name: str, environ: Mapping[str, str] = os.environ, *, for_agent: bool = True
    ) -> str | None:
        """Why backend ``name`` cannot run rollouts from this runtime, in one line; None when it can.

        From the backend's class (its ``capabilities``): an unknown name, a credential missing from
        ``environ``, or (``for_agent``: an agent in it calls the capture proxy; a white-box session's
        sandbox calls nothing) a remote backend whose agents would be pointed at the capture proxy on this
        machine's loopback (no public URL)."""
        try:
            caps = capabilities(name)
        except ValueError as exc:
            return str(exc)
        if missing := missing_credentials(name, environ):
            return f"sandbox {name} needs {' and '.join(missing)} in the rollout server's environment"
        public = self.config.public_url or self.config.capture_url
        host = urlsplit(public).hostname if public else self.config.capture_host
        if for_agent and caps.remote and host in LOOPBACK_HOSTS:
            return (
                f"sandbox {name} runs agents on another machine, which cannot reach the capture proxy on "
                f"this machine's loopback ({host}): start the rollout server with --public-url"
            )
        return None

    def backend(self, name: str) -> SandboxBackend:
        """The backend ``name``, made on first use, behind a supervisor (start-rate limit, close-all)."""
        if name not in self._backends:
            options = dict(self.config.sandbox_options.get(name, {}))
            if capabilities(name).wants_proxy_url and self.capture is not None:
                options.setdefault("proxy_url", self.capture.public_url)
            if not capabilities(name).remote:  # the host's network is not a remote sandbox's
                options.setdefault("inherit_host_trust", self.config.inherit_host_trust)
            backend = make_backend(name, **options)
            self._backends[name] = SandboxSupervisor(
                backend,
                max_starts_per_s=self.config.sandbox_starts_per_s,
                max_starts_in_flight=self.config.max_sandbox_starts,
                start_jitter_s=self.config.sandbox_start_jitter_s,
            )
        return self._backends[name]

    async def replicas(self) -> list[dict[str, Any]] | None:
        """The capture proxy's replicas (``GET /replicas``: index, engine, healthy, drained, sessions, calls,
        failures), or None when the runtime was not configured with ``replicas``."""
        if not self.config.replicas or self.capture is None:
            return None
        return await self.capture.replicas()

    async def open_capture_sessions(self) -> int:
        """Capture sessions still open on the proxy (0 when every rollout cleaned up)."""
        if self.capture is None:
            return 0
        return len(await self.capture.sessions())

    async def rollout(
        self, task: HarborTask, options: RolloutOptions, stop: asyncio.Event | None = None
    ) -> RolloutResult:
        """Run one rollout (see :func:`run_rollout`); cancelled by :meth:`aclose`."""
        if self.capture is None:
            raise RuntimeError("RolloutRuntime.start() was not awaited")
        model, engine = self.engine_of(options)
        await self._provide_configured(options.sandbox)
        coroutine = run_rollout(
            task,
            options,
            capture=self.capture,
            backend=self.backend(options.sandbox),
            model=model,
            stop=stop,
            engine=engine,
            setups=self.setups,
        )
        running = asyncio.ensure_future(coroutine)
        self._running.add(running)
        try:
            return await running
        finally:
            self._running.discard(running)

    async def prepare(
        self, tasks: Sequence[HarborTask], sandbox: str, *, harnesses: Sequence[str] = (), at_once: int = 4
    ) -> int:
        """Build or look up the environment of each of ``tasks`` on the ``sandbox`` backend (an image, a
        template: what it makes once per content), with the agents of ``harnesses`` provisioned and set up
        in each (:mod:`~harness_trainer.harnesses.bundles`) and started once in a sandbox of each
        (:func:`~harness_trainer.harnesses.bundles.probe_agent`: its ``--version``), ``at_once`` at a
        time, before any rollout asks: a run whose environment or agent cannot be built, or whose agent
        does not start there, then fails at start, in seconds, not at its first group. Returns how many
        tasks were prepared.

        Raises:
            SandboxStartError: every task that failed, each with its error (the build log's tail); or an
                agent bundle that could not be built, naming it and the command that failed.
        """
        backend = self.backend(sandbox)
        remote = capabilities(sandbox).remote and self.capture is not None
        harnesses = [*self.config.agents, *harnesses]
        packages = {n: p for n in dict.fromkeys(harnesses) if (p := HARNESSES[n].package) is not None}
        for name, package in packages.items():
            try:
                backend.provide([await provision(package)])
            except HarnessError as exc:
                raise SandboxStartError(f"the {name} agent could not be prepared: {exc}") from exc
        gate = asyncio.Semaphore(at_once)

        async def one(task: HarborTask) -> str | None:
            async with gate:
                try:
                    await backend.prepare(task)
                    if task.separate_verifier is not None:  # its own environment, built beside
                        await backend.prepare(task.verifier_task())
                    for step in (s for s in task.steps if s.separate_verifier is not None):
                        await backend.prepare(task.verifier_task(step))
                    if packages or remote:
                        await self._probe(backend, task, packages, reach=remote)
                except (SandboxStartError, HarnessError) as exc:
                    return f"{task.name}: {exc}"
                return None

        failures = [f for f in await asyncio.gather(*(one(task) for task in tasks)) if f is not None]
        if failures:
            raise SandboxStartError(
                f"{len(failures)} of {len(tasks)} environments could not be prepared on {sandbox}:\n"
                + "\n".join(failures)
            )
        return len(tasks)

    async def _provide_configured(self, sandbox: str) -> None:
        """``config.agents``' bundles into backend ``sandbox``, before its first rollout."""
        if sandbox in self._provided:
            return
        backend = self.backend(sandbox)
        try:
            for name in self.config.agents:
                if (package := HARNESSES[name].package) is not None:
                    backend.provide([await provision(package)])
        except HarnessError as exc:  # the rollout goes on; its own harness's bundle is its own affair
            log.error("the agents every %s sandbox gets could not be prepared: %s", sandbox, exc)
            return
        self._provided.add(sandbox)

    async def _probe(
        self, backend: SandboxBackend, task: HarborTask, packages: Mapping[str, Any], *, reach: bool
    ) -> None:
        """In one sandbox of ``task``'s environment: each agent of ``packages`` started once, and with
        ``reach`` (a remote backend) the capture proxy's ``/health`` fetched at its public URL."""
        sandbox = await backend.start(task, lifetime_s=300)
        try:
            if reach:
                assert self.capture is not None
                url = self.capture.public_url.rstrip("/") + "/health"
                fetched = await sandbox.exec(fetch_command(url), timeout_s=60)
                if fetched.exit_code != 0:
                    why = (fetched.stderr or fetched.stdout).strip()[-500:] or "timed out"
                    raise SandboxStartError(f"a sandbox cannot reach the capture proxy at {url}: {why}")
            for name, package in packages.items():
                try:
                    await probe_agent(sandbox, package)
                except HarnessError as exc:
                    raise HarnessError(f"the {name} agent does not start in this environment: {exc}") from exc
        finally:
            await sandbox.close()

    async def aclose(self) -> None:
        """Cancel running rollouts (they clean up after themselves), then close backends and the proxy."""
        for running in list(self._running):
            running.cancel()
        if self._running:
            await asyncio.wait(set(self._running), timeout=60)
        if self.setups is not None:  # its snapshots, before the backends that made them close
            await self.setups.aclose()
        for backend in self._backends.values():
            await backend.aclose()
        self._backends.clear()
        if self.capture is not None:
            await self.capture.aclose()
            self.capture = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._proxy_process is not None:
            await self._proxy_process.stop()
            self._proxy_process = None


async def engine_models(upstream: str) -> list[str]:
    """The models the engine serves (``GET /v1/models``), at least one."""
    root = engine_root(upstream)
    async with httpx.AsyncClient(timeout=30) as client:
        try:
            response = await client.get(root + "/v1/models")
            response.raise_for_status()
            models = [str(entry["id"]) for entry in response.json()["data"]]
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            raise RuntimeError(f"cannot learn the served model from {root}/v1/models: {exc!r}") from exc
    if not models:
        raise RuntimeError(f"the engine at {root} serves no model ({root}/v1/models is empty)")
    return models
