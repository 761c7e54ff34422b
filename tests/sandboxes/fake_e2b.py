"""A fake of the E2B SDK at its boundary: pass a :class:`FakeE2BCloud` as ``sandbox_class=``.

It stands in for ``e2b.AsyncSandbox`` with the SDK's own signatures (a test binds every recorded call to
the real ones) and records every call. Commands really run, locally: each fake sandbox is a private
mount + PID namespace (the local backend's :class:`Namespace`) in which ``/app``, ``/logs``, ``/tests``,
``/solution``, ``/home/user`` and ``/root`` are its own, and each command runs as envd runs it, in
``/bin/bash -l -c``. Like a real command stream that times out, a timed-out ``commands.run`` raises
``TimeoutException`` and leaves the process running: killing it is the backend's job. ``kill()``
ends every process of the sandbox, as tearing down the VM does.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from e2b import (
    CommandExitException,
    CommandResult,
    FileNotFoundException,
    InvalidArgumentException,
    SandboxException,
    TimeoutException,
)

from harness_trainer.sandboxes.processes import Namespace, Spawned, exit_status, spawn

FAKE_PATHS = ("/app", "/logs", "/tests", "/solution", "/home/user", "/root")


class FakeE2BCloud:
    """The fake ``AsyncSandbox`` class: ``create`` records its arguments and fails ``fail_creates`` times."""

    def __init__(self, root: Path, *, fail_creates: int = 0, failure: Exception | None = None) -> None:
        self.root = root
        self.fail_creates = fail_creates
        self.failure = failure or SandboxException("fake: the E2B API is unavailable")
        self.create_calls: list[dict[str, Any]] = []
        self.sandboxes: list[FakeAsyncSandbox] = []
        self._ids = itertools.count()

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
        if self.fail_creates > 0:
            self.fail_creates -= 1
            raise self.failure
        sandbox_id = f"fake-{next(self._ids)}"
        root = self.root / sandbox_id
        binds = []
        for path in FAKE_PATHS:
            (root / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
            Path(path).mkdir(parents=True, exist_ok=True)
            binds.append((root / path.lstrip("/"), path))
        namespace = await Namespace.create(binds, {"PATH": os.environ.get("PATH", os.defpath)})
        sandbox = FakeAsyncSandbox(sandbox_id, root, namespace, dict(envs or {}))
        self.sandboxes.append(sandbox)
        return sandbox


class FakeAsyncSandbox:
    def __init__(self, sandbox_id: str, root: Path, namespace: Namespace, envs: dict[str, str]) -> None:
        self.sandbox_id = sandbox_id
        self.root = root
        self.namespace = namespace
        self.envs = envs
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.killed = False
        self.commands = FakeCommands(self)
        self.files = FakeFilesystem(self)

    def host(self, path: str) -> Path:
        if not any(path == p or path.startswith(p + "/") for p in FAKE_PATHS):
            raise InvalidArgumentException(f"fake sandbox: {path} is outside {FAKE_PATHS}")
        return self.root / path.lstrip("/")

    async def kill(self, **opts: Any) -> bool:
        self.calls.append(("kill", opts))
        if self.killed:
            return False
        self.killed = True
        await self.namespace.kill()
        await self.commands.reap()
        shutil.rmtree(self.root, ignore_errors=True)
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
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": home, **sandbox.envs, **(envs or {})}
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
