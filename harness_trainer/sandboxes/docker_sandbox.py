"""A running Docker sandbox: one container of the docker backend (:mod:`.docker`, whose module docstring
describes it: commands through a wrapper that puts each in its own process group, its output to files; the
lifetime; the proxy relay; ``close`` removing the container and its sidecars)."""

from __future__ import annotations

import asyncio
import io
import logging
import tarfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness_trainer.finish import finish
from harness_trainer.sandboxes.base import ExecResult, Lifetime, SandboxError, resolve_path
from harness_trainer.sandboxes.docker_daemon import as_root, sdk, tar_of
from harness_trainer.sandboxes.docker_scripts import KILL, WRAP
from harness_trainer.sandboxes.netns_relay import NetnsRelay

if TYPE_CHECKING:
    from harness_trainer.sandboxes.docker import DockerSandboxBackend
    from harness_trainer.sandboxes.docker_compose import Sidecars

log = logging.getLogger(__name__)


class DockerSandbox:
    """One running container; see the module docstring."""

    shares_host_filesystem = False

    def __init__(
        self,
        backend: DockerSandboxBackend,
        container: str,
        *,
        task_name: str,
        workdir: str,
        env: dict[str, str],
        provisioned: frozenset[str] = frozenset(),
        sidecars: Sidecars | None = None,
    ):
        self.id = container[:12]
        self.sidecars = sidecars
        """A compose task's network and sidecar containers (:mod:`.docker_compose`), removed with it."""
        self.provisioned = provisioned
        """The agents mounted into this container (:mod:`.docker_agents`), by bundle name."""
        self.container = container
        self.task_name = task_name
        self.workdir = workdir
        self.home = backend.home
        self._backend = backend
        self._env = env  # given to every exec: the container's PATH (for the login shell) and start env
        self._closed = False
        self._lifetime = Lifetime()
        self._relay = NetnsRelay(backend.call)
        self.on_close: list[Callable[[DockerSandbox], object]] = []

    @property
    def closed(self) -> bool:
        return self._closed

    def sandbox_path(self, path: str) -> str:
        return resolve_path(path, workdir=self.workdir, home=self.home)

    async def _api(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await self._backend.call(getattr(self._backend.client.api, method), *args, **kwargs)

    async def exec(
        self,
        command: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        full_env = {**self._env, **(env or {})}
        full_env["__HT_PATH"] = full_env.get(
            "PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        )
        tag = uuid.uuid4().hex[:16]
        workdir = self.sandbox_path(cwd) if cwd else self.workdir
        argv = ["/bin/bash", "-c", WRAP, "ht", tag, command]
        try:
            created = await self._api(
                "exec_create", self.container, argv, environment=full_env, workdir=workdir
            )
        except Exception as exc:
            raise SandboxError(f"sandbox {self.id}: cannot run a command: {exc}") from exc
        start = self._backend.stream_api.exec_start  # no read timeout: a command may be silent for long
        running = asyncio.ensure_future(self._backend.call(start, created["Id"], demux=True, long=True))
        running.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved
        try:
            out, err = await asyncio.wait_for(asyncio.shield(running), timeout_s)
        except TimeoutError:
            await self._kill(tag)
            try:
                out, err = await asyncio.wait_for(asyncio.shield(running), 10)
            except Exception:  # the wrapper outlived the kill, or the container went away
                out, err = b"", b""
            return ExecResult(None, _text(out).partition("\n")[2], _text(err), timed_out=True)
        except asyncio.CancelledError:
            await asyncio.shield(self._kill(tag))
            raise
        except Exception as exc:
            closed = " (it was closed while the command ran)" if self._closed else ""
            raise SandboxError(f"sandbox {self.id}: command failed to run{closed}: {exc}") from exc
        code, _, stdout = _text(out).partition("\n")
        if code.isdigit():
            return ExecResult(int(code), stdout, _text(err))
        if self._closed:  # removed under the command: it was killed, not finished
            raise SandboxError(f"sandbox {self.id} was closed while a command ran")
        try:  # the wrapper itself failed (a missing cwd, say): docker knows the exit code
            inspected = await self._api("exec_inspect", created["Id"])
        except Exception as exc:
            raise SandboxError(f"sandbox {self.id}: command failed to run: {exc}") from exc
        return ExecResult(inspected.get("ExitCode"), _text(out), _text(err))

    async def _kill(self, tag: str) -> None:
        ticks = str(max(1, int(self._backend.kill_grace_s / 0.05)))
        try:
            created = await self._api(
                "exec_create", self.container, ["/bin/bash", "-c", KILL, "ht", tag, ticks]
            )
            await self._api("exec_start", created["Id"])
        except Exception as exc:  # the container is gone: so is the command
            log.debug("sandbox %s: kill of %s failed: %s", self.id, tag, exc)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        payload = data.encode() if isinstance(data, str) else data
        archive = tar_of([(self.sandbox_path(path), payload, mode)])
        await self._put(archive)

    async def read_file(self, path: str) -> bytes:
        target = self.sandbox_path(path)
        docker = sdk()
        try:
            stream, _ = await self._api("get_archive", self.container, target)
            raw = await self._backend.call(lambda: b"".join(stream))
        except docker.errors.NotFound:
            raise FileNotFoundError(f"sandbox {self.id}: no such file: {target}") from None
        except docker.errors.APIError as exc:
            raise SandboxError(f"sandbox {self.id}: cannot read {target}: {exc}") from exc
        with tarfile.open(fileobj=io.BytesIO(raw)) as archive:
            member = archive.next()
            extracted = archive.extractfile(member) if member is not None and member.isfile() else None
            if extracted is None:
                raise IsADirectoryError(f"sandbox {self.id}: {target} is not a regular file")
            return extracted.read()

    async def upload_dir(self, local: Path, remote: str) -> None:
        if not Path(local).is_dir():
            raise NotADirectoryError(f"{local} is not a directory")
        target = self.sandbox_path(remote).lstrip("/")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            archive.add(local, arcname=target or ".", filter=as_root)
        await self._put(buffer.getvalue())

    async def _put(self, archive: bytes) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        try:
            await self._api("put_archive", self.container, "/", archive)
        except Exception as exc:
            raise SandboxError(f"sandbox {self.id}: cannot copy files in: {exc}") from exc

    async def relay(self, pid: int, host: str, port: int) -> None:
        """Listen on ``host:port`` inside the container's network namespace; relay to the same here."""
        await self._relay.open(pid, host, port)

    def expire_after(self, seconds: float) -> None:
        """Close this sandbox after ``seconds`` (its lifetime), unless it is closed before."""
        self._lifetime.start(seconds, self.close)

    async def close(self) -> None:
        """Remove the container and everything in it; idempotent, never raises, and finishes when its caller
        is cancelled meanwhile (:func:`~harness_trainer.finish.finish`)."""
        if self._closed:
            return
        self._closed = True
        self._lifetime.cancel()
        self._relay.close()
        await finish(self._remove())

    async def _remove(self) -> None:
        try:
            await self._backend.remove(self.container)
            if self.sidecars is not None:
                await self._backend.sidecars.remove(self.sidecars)
        finally:
            for callback in self.on_close:
                callback(self)


def _text(data: bytes | None) -> str:
    return (data or b"").decode(errors="replace")
