"""One Hugging Face sandbox (a ``huggingface_hub.Sandbox``, pooled or dedicated) behind the sandbox protocol.

The library is synchronous: every call runs in the backend's thread pool (``executor``), never the event
loop's default one, so that a run's long agent commands cannot starve it. Commands run as
``bash -l -c`` (an argv list, so no ``/bin/sh`` in between), with the start ``env`` and the command's
``env`` sent on **every** command (they never go into a job's spec, which the Hub shows). Each command is
wrapped as the E2B backend wraps its own: in a session of its own (``setsid``) whose leader records its
pid in a file under the sandbox's home; on timeout or cancellation the backend kills that session's group
(SIGTERM, then SIGKILL after ``kill_grace_s``) with a second command, so a command that ignores SIGTERM or
leaves background children ends all the same. The sandbox server's own ``timeout`` is set past that, as a
backstop for a client that went away.

When an operation fails, the sandbox asks the backend (``ended``) whether its job (a pooled sandbox's
host) has ended, and if so its ``SandboxError`` names that reason (the job's stage and the Hub's message):
a dead host fails every sandbox on it the same way, and :meth:`HfSandbox.close` then kills nothing.

Files go through the library's file API. In a pooled sandbox that API is rooted at the sandbox's home (a
leading ``/`` is the home), the only place its commands may write: a path outside the home is refused
with :class:`SandboxError` rather than written somewhere commands would not find it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import posixpath
import shlex
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, TypeVar

from harness_trainer.finish import finish
from harness_trainer.sandboxes.base import ExecResult, Lifetime, SandboxError, resolve_path
from harness_trainer.sandboxes.hf_sdk import pack

log = logging.getLogger(__name__)
T = TypeVar("T")

# $1 = pidfile, $2 = command. The inner shell records its pid (= its process group, under setsid).
_WRAP = """ht_w='echo $$ > "$1"; exec /bin/bash -l -c "$2"'
if command -v setsid >/dev/null 2>&1; then setsid -w /bin/bash -c "$ht_w" ht "$0" "$1"
else /bin/bash -c "$ht_w" ht "$0" "$1"; fi
ht_rc=$?; rm -f "$0"; exit $ht_rc
"""
_KILL = """i=0; while [ ! -s "$0" ] && [ $i -lt 20 ]; do sleep 0.05; i=$((i+1)); done
p=$(cat "$0" 2>/dev/null) || exit 0
kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null
i=0; while kill -0 -- "-$p" 2>/dev/null && [ $i -lt "$1" ]; do sleep 0.1; i=$((i+1)); done
kill -KILL -- "-$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null; rm -f "$0"; exit 0
"""
BACKSTOP_S = 30.0
"""How long past the backend's own timeout (and grace) the sandbox server kills a command by itself."""


class HfSandbox:
    """One sandbox; the library's object is ``sdk_sandbox``. ``pooled``: it lives in a pool host's VM."""

    shares_host_filesystem = False

    def __init__(
        self,
        sdk_sandbox: Any,
        *,
        executor: Executor,
        pooled: bool,
        workdir: str,
        env: dict[str, str],
        kill_grace_s: float,
        provisioned: frozenset[str] = frozenset(),
        ended: Callable[[str], Awaitable[str | None]] | None = None,
    ) -> None:
        self.sdk_sandbox = sdk_sandbox
        self.id: str = sdk_sandbox.id
        self.pooled = pooled
        self.workdir = workdir
        self.home = (
            "/tmp"  # until the sandbox says (:meth:`learn_home`): where its first command's pidfile goes
        )
        self.provisioned = provisioned
        self.ended: str | None = None
        """Why its job ended (its stage, the Hub's message), once an operation found it so."""
        self._job_ended = ended
        self._executor = executor
        self._env = env
        self._kill_grace_s = kill_grace_s
        self._closed = False
        self._lifetime = Lifetime()
        self._background: set[asyncio.Future[Any]] = set()
        self.on_close: list[Callable[[HfSandbox], object]] = []

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def job_id(self) -> str:
        """The job this sandbox runs in: a pooled sandbox's host, a dedicated sandbox's own."""
        return getattr(self.sdk_sandbox, "host_id", None) or self.id

    async def failure(self, what: str, detail: object) -> SandboxError:
        """The error for an operation (``what``) that failed (``detail``): naming why the sandbox's job
        ended when it has (asked once; a Hub that cannot say leaves the error as it was)."""
        if self.ended is None and self._job_ended is not None:
            try:
                self.ended = await self._job_ended(self.job_id)
            except Exception as check:  # the Hub cannot say: the operation's own error stands
                log.debug("sandbox %s: cannot ask whether job %s ended: %s", self.id, self.job_id, check)
        if self.ended is not None:
            job = "host job" if self.pooled else "job"
            return SandboxError(
                f"sandbox {self.id}: {what}: its {job} {self.job_id} has ended ({self.ended})"
            )
        return SandboxError(f"sandbox {self.id}: {what}: {detail}")

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the backend's thread pool."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def sandbox_path(self, path: str) -> str:
        return resolve_path(path, workdir=self.workdir, home=self.home)

    def api_path(self, path: str) -> str:
        """A sandbox path as the library's file API takes it (rooted at the home in a pooled sandbox)."""
        target = self.sandbox_path(path)
        if not self.pooled:
            return target
        if target != self.home and not target.startswith(self.home.rstrip("/") + "/"):
            raise SandboxError(
                f"sandbox {self.id}: {target} is outside its home ({self.home}), and a pooled HF sandbox "
                "may write only there (run the task with dedicated=true, the default)"
            )
        return "/" + posixpath.relpath(target, self.home).removeprefix(".")

    async def learn_home(self) -> None:
        """Ask the sandbox what ``HOME`` its commands get (a pooled sandbox's is its own)."""
        result = await self.exec('printf %s "$HOME"', timeout_s=60, cwd="/")
        if result.exit_code != 0 or not result.stdout.startswith("/"):
            raise SandboxError(f"sandbox {self.id}: cannot read its HOME: {result.stderr[-500:]}")
        self.home = result.stdout

    def start_lifetime(self, seconds: float) -> None:
        """Close this sandbox after ``seconds`` unless it is closed before."""
        self._lifetime.start(seconds, self.close)

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
        from huggingface_hub.errors import SandboxError as HubSandboxError

        pidfile = f"{self.home.rstrip('/')}/.ht-exec-{uuid.uuid4().hex}.pid"
        out: list[str] = []
        err: list[str] = []
        backstop = None if timeout_s is None else timeout_s + self._kill_grace_s + BACKSTOP_S
        running = asyncio.ensure_future(
            self.call(
                self.sdk_sandbox.run,
                ["/bin/bash", "-c", _WRAP, pidfile, command],
                shell=False,
                env={**self._env, **(env or {})},
                cwd=self.sandbox_path(cwd) if cwd else self.workdir,
                timeout=backstop,
                on_stdout=out.append,
                on_stderr=err.append,
                check=False,
                capture_output=False,
            )
        )
        try:
            result = await asyncio.wait_for(asyncio.shield(running), timeout_s)
        except TimeoutError:
            await self._kill_group(pidfile)
            await asyncio.wait([running], timeout=self._kill_grace_s + 5)
            return ExecResult(exit_code=None, stdout="".join(out), stderr="".join(err), timed_out=True)
        except asyncio.CancelledError:
            self._keep(asyncio.ensure_future(self._kill_group(pidfile)))  # do not leave it running
            raise
        except HubSandboxError as exc:
            raise await self.failure("command failed to run", exc) from exc
        except Exception as exc:  # the connection to the sandbox's server broke
            raise await self.failure("unreachable", f"{type(exc).__name__}: {exc}") from exc
        if result.timed_out:  # the backstop fired: the client was too slow to kill it itself
            return ExecResult(exit_code=None, stdout="".join(out), stderr="".join(err), timed_out=True)
        return ExecResult(exit_code=result.exit_code, stdout="".join(out), stderr="".join(err))

    def _keep(self, future: asyncio.Future[Any]) -> None:
        self._background.add(future)
        future.add_done_callback(self._background.discard)

    async def _kill_group(self, pidfile: str) -> None:
        ticks = str(max(1, math.ceil(self._kill_grace_s / 0.1)))
        try:
            await self.call(
                self.sdk_sandbox.run, ["/bin/bash", "-c", _KILL, pidfile, ticks], shell=False,
                timeout=self._kill_grace_s + BACKSTOP_S, check=False,
            )  # fmt: skip
        except Exception as exc:  # the sandbox may be dying; close() ends it all anyway
            log.warning("sandbox %s: could not kill a timed-out command: %s", self.id, exc)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        target = self.api_path(path)
        try:
            await self.call(self.sdk_sandbox.files.write, target, data)
        except Exception as exc:
            raise await self.failure(f"cannot write {path}", exc) from exc
        if mode != 0o644:
            await self.check(f"chmod {mode:o} {shlex.quote(self.sandbox_path(path))}")

    async def read_file(self, path: str) -> bytes:
        target = self.api_path(path)
        try:
            return bytes(await self.call(self.sdk_sandbox.files.read, target))
        except Exception as exc:
            if getattr(exc, "status_code", None) == 404:
                raise FileNotFoundError(f"{self.sandbox_path(path)} (in sandbox {self.id})") from exc
            raise await self.failure(f"cannot read {path}", exc) from exc

    async def upload_dir(self, local: Path, remote: str, *, skip: tuple[str, ...] = ()) -> None:
        """Copy ``local``'s contents into ``remote`` (created) as one tar archive, unpacked there; top-level
        entries named in ``skip`` stay out."""
        root, target = Path(local), self.sandbox_path(remote)
        if not root.is_dir():
            raise NotADirectoryError(f"{local} is not a directory")
        archive_in_sandbox = f"{self.home.rstrip('/')}/.ht-upload-{uuid.uuid4().hex}.tar"
        with tempfile.TemporaryDirectory(prefix="ht-hf-upload-") as scratch:
            archive = await asyncio.to_thread(pack, root, Path(scratch) / "upload.tar", skip=skip)
            try:
                await self.call(self.sdk_sandbox.files.upload, archive, self.api_path(archive_in_sandbox))
            except Exception as exc:
                raise await self.failure(f"cannot upload {local} to {target}", exc) from exc
        quoted, packed = shlex.quote(target), shlex.quote(archive_in_sandbox)
        unpack = f"mkdir -p {quoted} && tar -xf {packed} -C {quoted} --no-same-owner"
        await self.check(f"{unpack}; rc=$?; rm -f {packed}; exit $rc")

    async def check(self, command: str, cwd: str | None = "/") -> None:
        """Run ``command``; raises SandboxError with its output unless it exits 0."""
        result = await self.exec(command, timeout_s=300, cwd=cwd)
        if result.exit_code != 0:
            output = (result.stderr or result.stdout).strip()[-500:]
            raise SandboxError(f"sandbox {self.id}: `{command[:200]}` failed: {output}")

    async def close(self) -> None:
        """Kill the sandbox (a dedicated one's job is cancelled; a pooled one leaves its host), unless its job
        has ended already; idempotent, never raises, and finishes when its caller is cancelled meanwhile
        (:func:`~harness_trainer.finish.finish`)."""
        if self._closed:
            return
        self._closed = True
        self._lifetime.cancel()
        await finish(self._kill())

    async def _kill(self) -> None:
        try:
            if self.ended is None:  # an ended job took the sandbox with it: nothing to kill
                await self.call(self.sdk_sandbox.kill)
        except Exception as exc:  # close must not raise; the idle timeout ends it anyway
            log.warning("HF sandbox %s: kill failed (its idle timeout ends it): %s", self.id, exc)
        finally:
            for callback in self.on_close:
                callback(self)
