"""A fake of the E2B SDK at its boundary: pass a :class:`FakeE2BCloud` as ``sandbox_class=`` and its
``template_class`` (a :class:`FakeAsyncTemplate`) as ``template_class=``.

It stands in for ``e2b.AsyncSandbox`` with the SDK's own signatures (a test binds every recorded call to the
real ones) and records every call. Commands really run, locally, but **not on this machine's files**: each
fake sandbox is a mount + PID namespace chrooted into an overlay of its template's filesystem, the
template's image exported from the Docker daemon (or the base image's, for a sandbox of no template built
here) under the template's own layer (:mod:`tests.sandboxes.fake_rootfs`), so an image without Node has no
``node`` in the fake, as in the cloud. Each command runs as envd runs it, in ``/bin/bash -l -c``. Like a
real command stream that times out, a timed-out ``commands.run`` raises ``TimeoutException`` and leaves the
process running: killing it is the backend's job. ``kill()`` ends every process of the sandbox, as tearing
down the VM does.

Templates (one account's, shared by every backend given the same cloud, as two processes share an E2B
account): calling ``template_class`` returns the **real** SDK template object (the SDK's own Dockerfile
converter runs); ``build`` serializes it with the SDK (``AsyncTemplate.to_json``) and applies its steps for
real in a namespace of its own: ``RUN`` runs (``/bin/bash -l -c`` as root: E2B runs build steps through a
sandbox's envd, as it runs commands), ``COPY`` copies from the build context, ``ENV`` and ``WORKDIR`` are
kept, over the ``FROM`` image's filesystem (stood in for as the Docker backend does where the daemon lacks
it) or a ``fromTemplate`` built here. Its log has E2B's shape (``[base] FROM …``, ``[builder 2/5] RUN …``,
the step's output); a failing ``RUN`` fails the build with ``BuildException``, as E2B does. As in E2B, a
name exists from the moment its build is requested; a sandbox created from a name whose build is unfinished
or failed is refused. A sandbox created from a built name starts from the template's filesystem (an overlay:
nothing copied) and its ``ENV``. ``hang_builds`` makes builds wait forever (until cancelled);
``fail_requests`` makes the next build requests raise.

Snapshots (``sandbox.create_snapshot``, ``create(<snapshot id>)``, ``list_snapshots``, ``delete_snapshot``):
``snapshots``, a :class:`~tests.sandboxes.fake_e2b_snapshots.FakeSnapshots` (see its module).

Failed creates: ``create_failures`` scripts the next ``create`` calls (each raises its exception, or with
None creates normally); ``fail_creates``/``failure`` fail the next N with one exception (by default the
503 E2B answers when it has no capacity). :func:`api_error` builds an API error as the SDK does, from an
answer's status and body, with the SDK's own mapping (``e2b.api.handle_api_exception``).

Latency and limits (:class:`FakeLatency`, all off by default; for benchmarks): a delay per create, per
template build, per snapshot and per create from a snapshot, an account-wide create rate answered the way
E2B answers it (HTTP 429, which the SDK's transport retries with its own backoff, then raises
``RateLimitException``). Needs root and a Docker daemon with the base image (``scripts/setup_docker.sh``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import posixpath
import random
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
from e2b import (
    AsyncTemplate,
    BuildException,
    CommandExitException,
    CommandResult,
    FileNotFoundException,
    SandboxException,
    SandboxQuery,
    TimeoutException,
)
from e2b.api import handle_api_exception
from e2b.retry import BACKOFF_BASE_SECONDS, BACKOFF_JITTER_MIN, BACKOFF_MAX_SECONDS
from e2b.template.logger import LogEntry, LogEntryEnd, LogEntryStart
from e2b.template.types import BuildInfo

from harness_trainer.sandboxes import dockerfile
from harness_trainer.sandboxes.docker_daemon import BASE_IMAGE
from harness_trainer.sandboxes.processes import Namespace, Spawned, exit_status, run_captured, spawn
from tests.sandboxes.fake_e2b_snapshots import FakeSnapshots
from tests.sandboxes.fake_rootfs import RootFs, cloud_env, image_env, image_rootfs


@dataclass(frozen=True)
class FakeLatency:
    """What the fake cloud adds to its own (real, local) work, in seconds; the defaults add nothing."""

    create_s: tuple[float, float] = (0.0, 0.0)
    """Each admitted create then waits uniformly within this range (the API call and the VM's boot)."""
    build_s: Callable[[str], float] | None = None
    """Each template build waits ``build_s(name)`` once E2B accepted it, before its steps run."""
    create_rate_per_s: float | None = None
    """The account's create rate (a token bucket, ``create_burst`` deep); a create over it gets a 429."""
    create_burst: int = 1
    sdk_retries: int = 3
    """How often the SDK's transport retries a 429 (its default ``retries``), waiting its own backoff."""
    retry_scale: float = 1.0
    """The SDK's backoff waits times this (a benchmark that scales time scales them too)."""
    snapshot_s: float = 0.0
    """Each ``create_snapshot`` waits this long before its files are frozen (E2B pauses the sandbox)."""
    create_from_snapshot_s: float = 0.0
    """An admitted create from a snapshot waits this long instead of ``create_s`` (E2B resumes it)."""


class _TokenBucket:
    """``take()``: True at most ``rate_per_s`` times a second on average, ``burst`` at once; never waits."""

    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate_per_s, self.burst = rate_per_s, burst
        self._tokens, self._stamp = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate_per_s)
        self._stamp = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class FakeE2BCloud:
    """The fake ``AsyncSandbox`` class: ``create`` records its arguments and fails ``fail_creates`` times;
    ``latency`` adds delays and a create-rate limit (:class:`FakeLatency`), whose 429s ``rate_limited``
    counts (each HTTP answer, retried or not) and ``rate_limit_errors`` (the ``RateLimitException`` s the
    SDK raised after its retries)."""

    def __init__(
        self,
        root: Path,
        *,
        fail_creates: int = 0,
        failure: Exception | None = None,
        latency: FakeLatency | None = None,
    ) -> None:
        self.root = root
        self.latency = latency or FakeLatency()
        self._bucket = (
            _TokenBucket(self.latency.create_rate_per_s, self.latency.create_burst)
            if self.latency.create_rate_per_s
            else None
        )
        self.rate_limited = 0
        self.rate_limit_errors = 0
        self.fail_creates = fail_creates
        self.failure = failure or api_error(503, "fake: the E2B API is unavailable")
        self.create_failures: list[Exception | None] = []
        self.create_calls: list[dict[str, Any]] = []
        self.sandboxes: list[FakeAsyncSandbox] = []
        self._ids = itertools.count()
        self.list_calls: list[dict[str, Any]] = []
        self.kill_calls: list[dict[str, Any]] = []
        self.templates: dict[str, FakeTemplateBuild] = {}  # the account's template names, latest build
        self.template_class = FakeAsyncTemplate(self)
        self.snapshots = FakeSnapshots(root / "snapshots")

    async def create(
        self,
        template: str | None = None,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        envs: dict[str, str] | None = None,
        allow_internet_access: bool | None = None,
        network: dict[str, Any] | None = None,
        **opts: Any,
    ) -> FakeAsyncSandbox:
        call = {"template": template, "timeout": timeout, "metadata": metadata, "envs": envs}
        call |= {"allow_internet_access": allow_internet_access, "network": network, **opts}
        self.create_calls.append({k: v for k, v in call.items() if v is not None})
        scripted = self.create_failures.pop(0) if self.create_failures else None
        if scripted is not None:
            raise scripted
        if self.fail_creates > 0:
            self.fail_creates -= 1
            raise self.failure
        await self._admit()
        # A create the API accepted completes on its side whatever the client does meanwhile (as a real
        # request's does): a client that stops waiting leaves a running sandbox it never heard of.
        return await asyncio.shield(self._create_admitted(template, metadata, envs))

    async def _create_admitted(
        self, template: str | None, metadata: dict[str, str] | None, envs: dict[str, str] | None
    ) -> FakeAsyncSandbox:
        snapshot = self.snapshots.find(template)
        low, high = (self.latency.create_from_snapshot_s,) * 2 if snapshot else self.latency.create_s
        if high > 0:
            await asyncio.sleep(random.uniform(low, high))
        if template in self.snapshots.deleted:
            raise api_error(404, f"template '{template}' not found")
        built = self.templates.get(template or "")
        if built is not None and not built.ready:
            raise api_error(404, f"template '{template}' has no ready build")  # E2B's answer, for both
        sandbox_id = f"fake-{next(self._ids)}"
        if snapshot is not None:
            layers, template_env = snapshot.layers, snapshot.env
        elif built is not None:
            layers, template_env = built.layers, built.env
        else:
            base = await asyncio.to_thread(image_rootfs, BASE_IMAGE)
            layers, template_env = [base], image_env(base)
        rootfs = RootFs(layers, self.root / sandbox_id)
        await rootfs.start()
        sandbox_env = {**template_env, **(envs or {})}
        sandbox = FakeAsyncSandbox(self, sandbox_id, rootfs, sandbox_env, template=template)
        sandbox.metadata = dict(metadata or {})
        self.sandboxes.append(sandbox)
        return sandbox

    async def _admit(self) -> None:
        """The create-rate limit: a 429, retried as the SDK's transport retries it (exponential backoff with
        jitter, ``sdk_retries`` times), then the ``RateLimitException`` the SDK maps a 429 to."""
        if self._bucket is None:
            return
        for attempt in range(self.latency.sdk_retries + 1):
            if self._bucket.take():
                return
            self.rate_limited += 1
            if attempt < self.latency.sdk_retries:
                backoff = min(BACKOFF_BASE_SECONDS * 2**attempt, BACKOFF_MAX_SECONDS)
                jitter = BACKOFF_JITTER_MIN + random.random() * (1 - BACKOFF_JITTER_MIN)
                await asyncio.sleep(backoff * jitter * self.latency.retry_scale)
        self.rate_limit_errors += 1
        raise api_error(429, "fake: sandbox creation rate limit reached")  # the SDK's mapping of an answer

    def list(
        self,
        query: SandboxQuery | None = None,
        limit: int | None = None,
        next_token: str | None = None,
        order: str | None = None,
        **opts: Any,
    ) -> FakeSandboxPaginator:
        """The account's live sandboxes whose metadata has every pair of ``query.metadata``, in pages of
        ``limit`` (the SDK's paginator: ``has_next``, ``await next_items()``)."""
        self.list_calls.append(
            {"query": query, "limit": limit, "next_token": next_token, "order": order, **opts}
        )
        wanted = (query.metadata if query is not None else None) or {}
        infos = [
            SimpleNamespace(sandbox_id=s.sandbox_id, metadata=dict(s.metadata), template_id=s.template)
            for s in self.sandboxes
            if not s.killed and all(s.metadata.get(k) == v for k, v in wanted.items())
        ]
        return FakeSandboxPaginator(infos, limit or 100)

    async def kill(self, sandbox_id: str, **opts: Any) -> bool:
        """``AsyncSandbox.kill(sandbox_id)`` called on the class: False when no live sandbox has that id."""
        self.kill_calls.append({"sandbox_id": sandbox_id, **opts})
        found = next((s for s in self.sandboxes if s.sandbox_id == sandbox_id and not s.killed), None)
        return await found.kill(**opts) if found is not None else False

    def list_snapshots(
        self,
        sandbox_id: str | None = None,
        limit: int | None = None,
        next_token: str | None = None,
        name: str | None = None,
        **opts: Any,
    ) -> FakeSandboxPaginator:
        """``AsyncSandbox.list_snapshots()`` called on the class: the account's snapshots (of ``sandbox_id``,
        answering to ``name``), in pages of ``limit``."""
        call = {"sandbox_id": sandbox_id, "limit": limit, "next_token": next_token, "name": name, **opts}
        self.snapshots.list_calls.append(call)
        return FakeSandboxPaginator(self.snapshots.listed(sandbox_id, name), limit or 100)

    async def delete_snapshot(self, snapshot_id: str, **opts: Any) -> bool:
        """``AsyncSandbox.delete_snapshot(snapshot_id)``: True when deleted, False when there is none."""
        self.snapshots.delete_calls.append({"snapshot_id": snapshot_id, **opts})
        await asyncio.sleep(0)  # an API round trip
        return self.snapshots.delete(snapshot_id)


class FakeSandboxPaginator:
    def __init__(self, items: list[Any], page: int) -> None:
        self._items, self._page = items, page
        self.has_next = True

    async def next_items(self, **opts: Any) -> list[Any]:
        if not self.has_next:
            raise SandboxException("fake: no more items to fetch")
        page, self._items = self._items[: self._page], self._items[self._page :]
        self.has_next = bool(self._items)
        return page


def api_error(status: int, message: str) -> Exception:
    """What the SDK raises for an E2B API answer of ``status`` whose JSON body has ``message`` (E2B's error
    body: ``{"code": status, "message": …}``), made by the SDK's own mapping."""
    return handle_api_exception(httpx.Response(status, json={"code": status, "message": message}))


@dataclass
class FakeTemplateBuild:
    """One build of a template name: its steps as the SDK serialized them, and its files once applied."""

    name: str
    build_id: str
    template: dict[str, Any]  # AsyncTemplate.to_json
    folder: Path
    cpu_count: int | None
    memory_mb: int | None
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    layers: list[Path] = field(default_factory=list)
    """Its filesystem once built: its own layer over its image's (topmost first)."""
    ready: bool = False
    failed: bool = False
    requested_at: float = 0.0  # time.monotonic() when its build was requested
    finished_at: float | None = None  # ... and when it ended (ready or failed)


class FakeAsyncTemplate:
    """The fake ``AsyncTemplate`` class of one account (see the module docstring); records every call."""

    def __init__(self, cloud: FakeE2BCloud) -> None:
        self.cloud = cloud
        self.init_calls: list[dict[str, Any]] = []
        self.exists_calls: list[dict[str, Any]] = []
        self.build_calls: list[dict[str, Any]] = []
        self.builds: list[FakeTemplateBuild] = []
        self.hang_builds = False
        self.fail_requests: list[Exception] = []

    def __call__(
        self, file_context_path: str | Path | None = None, file_ignore_patterns: list[str] | None = None
    ) -> AsyncTemplate:
        self.init_calls.append(
            {"file_context_path": file_context_path, "file_ignore_patterns": file_ignore_patterns}
        )
        return AsyncTemplate(file_context_path=file_context_path, file_ignore_patterns=file_ignore_patterns)

    async def exists(self, name: str, **opts: Any) -> bool:
        self.exists_calls.append({"name": name, **opts})
        await asyncio.sleep(0)  # an API round trip: other tasks run meanwhile
        return name in self.cloud.templates

    async def build(
        self,
        template: Any,
        name: str | None = None,
        *,
        alias: str | None = None,
        tags: list[str] | None = None,
        cpu_count: int | None = None,
        memory_mb: int | None = None,
        min_free_disk_mb: int | None = None,
        skip_cache: bool = False,
        on_build_logs: Callable[[LogEntry], None] | None = None,
        **opts: Any,
    ) -> BuildInfo:
        call = {"template": template, "name": name, "alias": alias, "tags": tags, "cpu_count": cpu_count}
        call |= {"memory_mb": memory_mb, "on_build_logs": on_build_logs, **opts}
        self.build_calls.append({k: v for k, v in call.items() if v is not None})
        log = on_build_logs or (lambda entry: None)
        name = name or alias or ""
        log(LogEntryStart(timestamp=datetime.now(), message="Build started"))
        try:
            await asyncio.sleep(0)
            if self.fail_requests:
                raise self.fail_requests.pop(0)
            serialized = json.loads(AsyncTemplate.to_json(template))
            build_id = str(uuid.uuid4())
            build = FakeTemplateBuild(
                name, build_id, serialized, self.cloud.root / "templates" / build_id, cpu_count, memory_mb
            )
            build.requested_at = time.monotonic()
            self.cloud.templates[name] = build  # E2B registers the name when the build is requested
            self.builds.append(build)
            # The SDK's own messages around the API calls of a build, in its order.
            _info(log, f"Requesting build for template: {name}")
            _info(log, f"Template created with ID: {name}-id, Build ID: {build_id}")
            _info(log, "All file uploads completed")
            _info(log, "Starting building...")
            _info(log, "Waiting for logs...")
            if self.hang_builds:
                await asyncio.Event().wait()
            if self.cloud.latency.build_s is not None:
                await asyncio.sleep(self.cloud.latency.build_s(name))
            try:
                await self._apply(build, template._template._file_context_path, log)
            except BuildException:
                build.failed = True
                build.finished_at = time.monotonic()
                raise
            build.ready = True
            build.finished_at = time.monotonic()
            return BuildInfo(
                template_id=f"{name}-id", build_id=build_id, name=name, alias=name, tags=["default"]
            )
        finally:
            log(LogEntryEnd(timestamp=datetime.now(), message="Build finished"))

    async def _apply(self, build: FakeTemplateBuild, context: str, log: Callable[[LogEntry], None]) -> None:
        base = build.template.get("fromTemplate")
        below = self.cloud.templates.get(base) if base else None
        if below is not None and below.ready:
            lower = below.layers
            build.env.update(below.env)
        else:
            image = build.template.get("fromImage") or BASE_IMAGE
            lower = [await asyncio.to_thread(image_rootfs, image)]
            build.env.update(image_env(lower[0]))
        rootfs = RootFs(lower, build.folder)
        starting = asyncio.ensure_future(rootfs.start())
        try:
            namespace = await asyncio.shield(starting)
        except asyncio.CancelledError:  # a build timeout: leave no namespace behind
            await starting
            await rootfs.stop()
            raise
        steps = build.template["steps"]
        try:
            _info(log, f"[base] FROM {build.template.get('fromImage') or base} [{'0' * 64}]")
            for number, step in enumerate(steps, start=1):
                kind, args = step["type"], step["args"]
                _info(log, f"[builder {number}/{len(steps)}] {_step_text(kind, args)}")
                if kind == "ENV":
                    build.env.update(zip(args[::2], args[1::2], strict=True))
                elif kind == "WORKDIR":
                    build.workdir = posixpath.normpath(posixpath.join(build.workdir, args[0]))
                    rootfs.host(build.workdir).mkdir(parents=True, exist_ok=True)
                elif kind == "COPY":
                    await self._copy(build, rootfs, context, args, number)
                elif kind == "RUN":
                    await self._run(build, namespace, args[0], log)
        except BaseException:
            await rootfs.stop()
            raise
        await rootfs.stop(keep_upper=True)
        build.layers = [rootfs.upper, *lower]

    async def _copy(
        self, build: FakeTemplateBuild, rootfs: RootFs, context: str, args: list[str], number: int
    ) -> None:
        src, dest, _user, mode = args
        dest_path = posixpath.join(build.workdir, dest)
        is_dir = dest.endswith("/") or (Path(context) / src).is_dir()
        step = dockerfile.CopyStep((src,), dest_path, is_dir, int(mode, 8) if mode else None, False, number)
        await asyncio.to_thread(dockerfile.copy_into, step, Path(context), rootfs.host)

    async def _run(
        self, build: FakeTemplateBuild, namespace: Namespace, command: str, log: Callable[[LogEntry], None]
    ) -> None:
        env = {**cloud_env(), "HOME": "/root", **build.env}
        argv = namespace.enter_argv(["/bin/bash", "-l", "-c", command], cwd=build.workdir)
        result = await run_captured(argv, env=env, timeout_s=None, grace_s=1.0)
        for line in (result.stdout + result.stderr).splitlines():
            _info(log, line)
        if result.exit_code != 0:
            message = f"failed to run command '{command}': exit status {result.exit_code}"
            log(LogEntry(timestamp=datetime.now(), level="error", message=f"Build failed: {message}"))
            raise BuildException(message)


def _info(log: Callable[[LogEntry], None], message: str) -> None:
    log(LogEntry(timestamp=datetime.now(), level="info", message=message))


def _step_text(kind: str, args: list[str]) -> str:
    """A step as E2B's build log names it (``RUN cmd``, ``COPY src dest``, ``ENV K=V``…)."""
    if kind == "ENV":
        return "ENV " + " ".join(f"{k}={v}" for k, v in zip(args[::2], args[1::2], strict=True))
    if kind == "COPY":
        return f"COPY {args[0]} {args[1]}"
    return f"{kind} {args[0]}"


class FakeAsyncSandbox:
    def __init__(
        self, cloud: FakeE2BCloud, sandbox_id: str, rootfs: RootFs, envs: dict[str, str], template: str | None
    ) -> None:
        assert rootfs.namespace is not None
        self.cloud = cloud
        self.sandbox_id = sandbox_id
        self.template = template
        self.rootfs = rootfs
        self.namespace = rootfs.namespace
        self.envs = envs
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.killed = False
        self.metadata: dict[str, str] = {}
        self.commands = FakeCommands(self)
        self.files = FakeFilesystem(self)

    def host(self, path: str) -> Path:
        """``path`` in the sandbox, seen from this machine (gone once the sandbox is killed)."""
        return self.rootfs.host(path)

    async def create_snapshot(self, name: str | None = None, *, mode: str | None = None, **opts: Any) -> Any:
        """Freeze this sandbox's files (:mod:`tests.sandboxes.fake_e2b_snapshots`): a ``SnapshotInfo``."""
        self.calls.append(("create_snapshot", {"name": name, "mode": mode, **opts}))
        return await self.cloud.snapshots.take(self, name, self.cloud.latency.snapshot_s)

    async def kill(self, **opts: Any) -> bool:
        self.calls.append(("kill", opts))
        if self.killed:
            return False
        self.killed = True
        await self.rootfs.stop()
        await self.commands.reap()
        shutil.rmtree(self.rootfs.folder, ignore_errors=True)
        return True


class FakeCommands:
    def __init__(self, sandbox: FakeAsyncSandbox) -> None:
        self._sandbox = sandbox
        self._stray: list[tuple[Spawned, list[asyncio.Task[None]]]] = []

    async def run(
        self,
        cmd: str,
        background: bool | None = None,
        envs: dict[str, str] | None = None,
        user: str | None = None,
        cwd: str | None = None,
        on_stdout: Any = None,
        on_stderr: Any = None,
        stdin: bool | None = None,
        timeout: float | None = 60,
        request_timeout: float | None = None,
    ) -> CommandResult:
        sandbox = self._sandbox
        sandbox.calls.append(
            ("commands.run", {"cmd": cmd, "envs": envs, "user": user, "cwd": cwd, "timeout": timeout})
        )
        if background:
            raise NotImplementedError("the fake runs foreground commands only")
        home = "/root" if user in (None, "root") else f"/home/{user}"
        env = {**cloud_env(), "HOME": home, **sandbox.envs, **(envs or {})}
        argv = sandbox.namespace.enter_argv(["/bin/bash", "-l", "-c", cmd], cwd=cwd or home)
        spawned = await spawn(argv, env=env, new_session=False)
        process = spawned.process
        out: list[str] = []
        err: list[str] = []
        pumps = [
            asyncio.create_task(_pump(process.stdout, out, on_stdout)),
            asyncio.create_task(_pump(process.stderr, err, on_stderr)),
        ]
        try:
            await asyncio.wait_for(asyncio.shield(spawned.exited), timeout or None)
        except TimeoutError:
            self._stray.append((spawned, pumps))
            raise TimeoutException("fake: the command stream timed out") from None
        await asyncio.wait(pumps, timeout=0.5)  # envd reports the exit, not the end of the output pipes
        for pump in pumps:
            pump.cancel()
        spawned.close_pipes()
        code = exit_status(spawned.returncode or 0)
        if code != 0:
            raise CommandExitException(stderr="".join(err), stdout="".join(out), exit_code=code, error=None)
        return CommandResult(stderr="".join(err), stdout="".join(out), exit_code=0, error=None)

    async def reap(self) -> None:
        """After the namespace is killed: collect the processes left by timed-out commands."""
        for spawned, pumps in self._stray:
            await asyncio.wait([spawned.exited], timeout=5)
            for pump in pumps:
                pump.cancel()
            spawned.close_pipes()
        self._stray.clear()


async def _pump(stream: asyncio.StreamReader | None, sink: list[str], callback: Any) -> None:
    assert stream is not None
    while chunk := await stream.read(1 << 16):
        text = chunk.decode(errors="replace")
        sink.append(text)
        if callback is not None:
            callback(text)


class FakeFilesystem:
    def __init__(self, sandbox: FakeAsyncSandbox) -> None:
        self._sandbox = sandbox

    async def read(
        self, path: str, format: str = "text", user: str | None = None, request_timeout: float | None = None
    ) -> str | bytearray:
        self._sandbox.calls.append(("files.read", {"path": path, "format": format, "user": user}))
        target = self._sandbox.host(path)
        if not target.is_file():
            raise FileNotFoundException(f"fake: {path} not found")
        data = target.read_bytes()
        return bytearray(data) if format == "bytes" else data.decode()

    async def write(
        self, path: str, data: str | bytes, user: str | None = None, request_timeout: float | None = None
    ) -> SimpleNamespace:
        self._sandbox.calls.append(("files.write", {"path": path, "data": data, "user": user}))
        return self._store(path, data)

    def _store(self, path: str, data: str | bytes) -> SimpleNamespace:
        target = self._sandbox.host(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)
        return SimpleNamespace(name=target.name, path=path)

    async def write_files(
        self, files: list[dict[str, Any]], user: str | None = None, request_timeout: float | None = None
    ) -> list[SimpleNamespace]:
        self._sandbox.calls.append(("files.write_files", {"files": files, "user": user}))
        return [self._store(f["path"], f["data"]) for f in files]

    async def make_dir(
        self, path: str, user: str | None = None, request_timeout: float | None = None
    ) -> bool:
        self._sandbox.calls.append(("files.make_dir", {"path": path, "user": user}))
        target = self._sandbox.host(path)
        existed = target.is_dir()
        target.mkdir(parents=True, exist_ok=True)
        return not existed
