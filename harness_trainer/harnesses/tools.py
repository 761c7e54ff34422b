"""Installing pinned agent packages (npm or pip) where a sandbox can run them.

Contract:

- A :class:`ToolPackage` names one pinned package, the executable inside its install folder, and any of
  its dependencies pinned too (``pins``, installed with it). Its install folder is named
  ``<package>-<version>`` (then ``-<pin>-<version>`` per pin, so other pins install anew) and is complete
  once it holds the marker file ``.harness-trainer-installed``; a folder without the marker is a broken
  install, wiped and redone.
- A sandbox that sees the host's filesystem (the local sandbox) runs agents from the **host tool cache**
  ``$HARNESS_TRAINER_CACHE/tools`` (default ``~/.cache/harness-trainer/tools``), installed once per
  machine and shared by every sandbox: concurrent installers (threads, tasks, processes) serialise on a
  ``flock`` of ``<folder>.lock``, and the one that wins installs while the others wait and reuse it.
- Any other sandbox (E2B) installs inside itself, under ``~/.cache/harness-trainer/tools``, with the
  sandbox's own ``npm`` / ``python3``; a template that already holds the marked folder installs nothing.
  :func:`agent_layer` is that same install as one shell command, for an E2B template's last layer (the
  E2B backend's ``agent_layer``), so that rollouts started from the template install nothing.
- Failures raise :class:`~harness_trainer.harnesses.base.HarnessError` with the installer's output tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import shlex
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from harness_trainer.harnesses.base import HarnessError
from harness_trainer.sandboxes.base import Sandbox

MARKER = ".harness-trainer-installed"
INSTALL_TIMEOUT_S = 900.0
_OUTPUT_TAIL = 3000
_LOCK_POLL_S = 0.2
_host_ready: set[Path] = set()  # install folders this process has already seen complete


@dataclass(frozen=True)
class NativeBinary:
    """The platform build an npm agent ships as a package of its own (``opencode-linux-x64``), whose
    executable runs without Node: ``name@version`` on the npm registry, the executable at ``path`` in it."""

    name: str
    version: str
    path: str


@dataclass(frozen=True)
class ToolPackage:
    """One pinned agent package; ``entrypoint`` is the executable's path inside the install folder."""

    manager: Literal["npm", "pip"]
    name: str
    version: str
    entrypoint: str
    pins: tuple[tuple[str, str], ...] = ()
    """Dependencies pinned to an exact version, ``(name, version)``, installed with the package: where its
    own range would float (a start's cost, and what the agent runs, would change with each release)."""
    native: NativeBinary | None = None
    """An npm agent's linux-x64 native executable: its bundle is that alone, no Node (:mod:`.bundles`)."""
    requires_python: str = ""
    """A pip agent's Python range: a bare minimum (``3.10``) or bounds (``>=3.10,<3.13``), checked where its
    venv is made for an image's Python (:mod:`.bundle_installer`)."""
    probe: tuple[str, ...] = ("--version",)
    """Arguments that make the agent print its version and exit 0 (run once per environment at
    preparation, :func:`~harness_trainer.harnesses.bundles.probe_agent`)."""

    @property
    def spec(self) -> str:
        """What the package manager is asked for (``name@version`` / ``name==version``)."""
        return self._spec(self.name, self.version)

    @property
    def specs(self) -> list[str]:
        """The package's spec, then its pins'."""
        return [self.spec, *(self._spec(name, version) for name, version in self.pins)]

    def _spec(self, name: str, version: str) -> str:
        return f"{name}@{version}" if self.manager == "npm" else f"{name}=={version}"

    @property
    def dirname(self) -> str:
        parts = [(self.name, self.version), *self.pins]
        return "-".join(re.sub(r"[^A-Za-z0-9._-]+", "-", name.lstrip("@")) + f"-{v}" for name, v in parts)

    def install_command(self, dest: str, python: str = "python3") -> str:
        """A bash command that installs the package into ``dest`` (which it creates)."""
        quoted = shlex.quote(dest)
        specs = " ".join(shlex.quote(spec) for spec in self.specs)
        if self.manager == "npm":
            return (
                f"mkdir -p {quoted} && npm install --prefix {quoted} --no-fund --no-audit "
                f"--loglevel=error {specs}"
            )
        venv = shlex.quote(f"{dest}/venv")
        return (
            f"mkdir -p {quoted} && {shlex.quote(python)} -m venv {venv} && {venv}/bin/pip install "
            f"--disable-pip-version-check --no-input -q {specs}"
        )

    @property
    def prerequisite(self) -> str:
        return "npm" if self.manager == "npm" else "python3"


def host_tools_dir() -> Path:
    """The host tool cache: ``$HARNESS_TRAINER_CACHE/tools`` or ``~/.cache/harness-trainer/tools``."""
    root = os.environ.get("HARNESS_TRAINER_CACHE") or Path.home() / ".cache" / "harness-trainer"
    return Path(root) / "tools"


def shares_host_filesystem(sandbox: Sandbox) -> bool:
    """Whether ``sandbox`` sees the host's files (then agents run from the host tool cache)."""
    return bool(getattr(sandbox, "shares_host_filesystem", False))


def sandbox_tools_dir(sandbox: Sandbox) -> str:
    """Where a sandbox that does not share the host's files keeps its installs."""
    return tools_dir_in(sandbox.home)


def tools_dir_in(home: str) -> str:
    """The install root inside a sandbox whose ``HOME`` is ``home``."""
    return f"{home.rstrip('/')}/.cache/harness-trainer/tools"


def sandbox_install_command(package: ToolPackage, dest: str) -> str:
    """A bash command that installs ``package`` into ``dest`` and marks it complete, doing nothing when the
    marker is already there; exits 127 when the package manager is missing."""
    marker = shlex.quote(f"{dest}/{MARKER}")
    need = package.prerequisite
    return (
        f"if [ -f {marker} ]; then exit 0; fi; "
        f"command -v {need} >/dev/null || {{ echo 'no {need} on PATH' >&2; exit 127; }}; "
        f"rm -rf {shlex.quote(dest)} && {package.install_command(dest)} && "
        f"echo {shlex.quote(' '.join(package.specs))} > {marker}"
    )


def agent_layer(packages: Sequence[ToolPackage], home: str) -> str:
    """One shell command installing ``packages`` where :func:`install_tool` looks in a sandbox whose
    ``HOME`` is ``home`` (each in its own subshell, so one marker's early exit skips only that one);
    empty for no packages."""
    return " && ".join(
        f"( {sandbox_install_command(package, f'{tools_dir_in(home)}/{package.dirname}')} )"
        for package in packages
    )


def tool_path(sandbox: Sandbox, package: ToolPackage, host_root: Path | None = None) -> str:
    """The entrypoint's path as seen inside ``sandbox`` once :func:`install_tool` has run."""
    if shares_host_filesystem(sandbox):
        return str((host_root or host_tools_dir()) / package.dirname / package.entrypoint)
    return f"{sandbox_tools_dir(sandbox)}/{package.dirname}/{package.entrypoint}"


async def install_tool(
    sandbox: Sandbox,
    package: ToolPackage,
    *,
    host_root: Path | None = None,
    timeout_s: float = INSTALL_TIMEOUT_S,
) -> str:
    """Make ``package`` runnable in ``sandbox``; returns the entrypoint's path there (see module doc)."""
    if shares_host_filesystem(sandbox):
        folder = await ensure_host_install(package, root=host_root, timeout_s=timeout_s)
        return str(folder / package.entrypoint)
    dest = f"{sandbox_tools_dir(sandbox)}/{package.dirname}"
    result = await sandbox.exec(sandbox_install_command(package, dest), timeout_s=timeout_s)
    if result.exit_code != 0:
        why = "timed out" if result.timed_out else f"exited with {result.exit_code}"
        tail = (result.stdout + result.stderr)[-_OUTPUT_TAIL:]
        raise HarnessError(f"installing {package.spec} in sandbox {sandbox.id} {why}: {tail}")
    return f"{dest}/{package.entrypoint}"


async def ensure_host_install(
    package: ToolPackage, *, root: Path | None = None, timeout_s: float = INSTALL_TIMEOUT_S
) -> Path:
    """The package's complete install folder in the host tool cache, installing it first if needed."""
    folder = (root or host_tools_dir()) / package.dirname
    if folder in _host_ready or (folder / MARKER).is_file():
        _host_ready.add(folder)
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    async with file_lock(folder.with_name(folder.name + ".lock"), timeout_s):
        if not (folder / MARKER).is_file():
            await asyncio.to_thread(shutil.rmtree, folder, True)
            await run_installer(package.install_command(str(folder), python=sys.executable), timeout_s)
            (folder / MARKER).write_text(" ".join(package.specs) + "\n")
    _host_ready.add(folder)
    return folder


@contextlib.asynccontextmanager
async def file_lock(path: Path, timeout_s: float) -> AsyncIterator[None]:
    """An exclusive ``flock`` on ``path``, polled so that waiting stays cancellable."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise HarnessError(f"another process held {path} for over {timeout_s:g} s") from None
                await asyncio.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


async def run_installer(command: str, timeout_s: float) -> None:
    process = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        await _kill_group(process)
        raise HarnessError(f"installer timed out after {timeout_s:g} s: {command}") from None
    except BaseException:  # cancelled: the installer and all it spawned go too, then cancellation goes on
        await _kill_group(process)
        raise
    if process.returncode != 0:
        tail = output.decode(errors="replace")[-_OUTPUT_TAIL:]
        raise HarnessError(f"installer exited with {process.returncode}: {command}\n{tail}")


async def _kill_group(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    await process.wait()
