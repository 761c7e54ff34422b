"""The sandbox protocol: where one rollout's agent and verifier run.

Paths inside a sandbox are the task's absolute paths (``/logs/verifier/reward.txt``, ``/tests``, the
Dockerfile's ``WORKDIR``). A started sandbox has ``/logs/agent``, ``/logs/verifier``, an empty ``/tests``
and an empty ``/solution``: the rollout uploads the tests only when the verifier runs (the agent must not
see them), as Harbor does. ``exec``'s ``timeout_s=None`` means no limit. Every backend implements
:class:`SandboxBackend` and :class:`Sandbox`; one contract test module runs against each. ``close`` is
idempotent and never raises.
"""

from __future__ import annotations

import asyncio
import posixpath
import shlex
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from harness_trainer.tasks.task import HarborTask


class SandboxError(Exception):
    """Base of sandbox failures; a rollout that hits one is unscorable, not a zero."""


class SandboxStartError(SandboxError):
    """The sandbox could not be created or its environment could not be prepared (after retries)."""


class SandboxTimeout(SandboxError):
    """An operation on the sandbox itself (not a command) took too long."""


@dataclass
class ExecResult:
    """What a command did. ``exit_code`` is None when it was killed on timeout (``timed_out``)."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False


class Sandbox(Protocol):
    """A running sandbox. ``workdir`` is where commands start (the Dockerfile's ``WORKDIR``, default
    ``/app``); ``home`` is the ``HOME`` its commands see. Relative paths given to the file methods are
    relative to ``workdir``."""

    id: str
    workdir: str
    home: str
    shares_host_filesystem: bool  # True when the host's files are visible (host tool caches are usable)

    async def exec(
        self,
        command: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        """Run ``command`` with ``bash -lc``; on timeout kill its whole process group."""
        ...

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None: ...

    async def read_file(self, path: str) -> bytes:
        """Raises ``FileNotFoundError`` when there is no such file."""
        ...

    async def upload_dir(self, local: Path, remote: str) -> None:
        """Copy a local directory's contents into ``remote`` (created)."""
        ...

    async def close(self) -> None:
        """End the sandbox and everything in it; idempotent, never raises. A close whose caller is cancelled
        meanwhile runs to its end first, then raises the cancellation (a half-done close leaks)."""
        ...


def resolve_path(path: str, *, workdir: str, home: str) -> str:
    """A sandbox path made absolute: ``~`` is ``home``, relative paths are relative to ``workdir``."""
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    return posixpath.normpath(posixpath.join(workdir, path))


class Lifetime:
    """A sandbox's lifetime watchdog: :meth:`start` closes it after ``seconds`` unless :meth:`cancel` (its
    own ``close``) comes first. Shared by the backends whose sandboxes nothing else would reap."""

    def __init__(self) -> None:
        self._timer: asyncio.TimerHandle | None = None
        self._expiry: asyncio.Task[None] | None = None  # held so the closing task is not collected

    def start(self, seconds: float, close: Callable[[], Awaitable[None]]) -> None:
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire, close)

    def _expire(self, close: Callable[[], Awaitable[None]]) -> None:
        self._expiry = asyncio.ensure_future(close())

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def sandbox_lifetime(task: HarborTask, lifetime_s: float, margin_s: float) -> float:
    """How long a sandbox may live: what the caller asked for, never less than the agent and verifier
    timeouts together, plus ``margin_s`` for setup and teardown."""
    return max(lifetime_s, task.agent_timeout_sec + task.verifier_timeout_sec) + margin_s


AGENT_ROOT = "/opt/harness-trainer/agents"
"""Where a sandbox sees the agents provisioned into it (:class:`AgentProvision`), one folder each."""


@dataclass(frozen=True)
class AgentProvision:
    """An agent a backend puts into every sandbox before any rollout asks, so that no rollout installs
    anything over the network (its image may have neither Node nor the network).

    ``host_dir``, a folder on this machine (the agent's bundle), is seen at ``AGENT_ROOT/<name>`` in each
    sandbox; ``setup``, when set, is a shell command run once per environment as root with the network,
    inside that environment and with the folder writable, that completes it for what the environment has
    (a pip agent's venv for the image's Python); it is idempotent, and its failure is the environment's."""

    name: str
    host_dir: Path
    setup: str = ""

    @property
    def path(self) -> str:
        """The folder as a sandbox sees it."""
        return f"{AGENT_ROOT}/{self.name}"


@dataclass(frozen=True)
class Isolation:
    """What a backend's sandbox keeps from its agent; True is enforced, False is not."""

    network: bool
    """``[environment] allow_internet = false`` cuts the sandbox off the internet."""
    filesystem: bool
    """The host's files are out of the agent's sight (beyond the task's private paths)."""
    user: bool
    """Commands cannot act as a user of the host (they run in another machine, VM or user namespace)."""
    limits: bool
    """``[environment] cpus`` and ``memory_mb`` are enforced."""


@dataclass(frozen=True)
class Login:
    """A login that a backend's library stores on this machine and reads when its credential variables are
    unset (``hf auth login``'s token): checks of a backend's ``credentials`` count it as given."""

    command: str
    """How a user stores it, for the line that says what is missing."""
    stored: Callable[[], bool]
    """Whether one is stored on this machine now."""


@dataclass(frozen=True)
class Capabilities:
    """A backend's facts, declared on its class (``capabilities``) and read from the registry by preflight,
    the Jobs plan, ``serve`` and the help texts: nothing else compares a backend's name to a string.

    ``credentials`` are the environment variables it needs where sandboxes start (``serve``, the Jobs
    warm-up), which ``login``, when set, stands in for; ``remote`` means its sandboxes run on another
    machine, so agents reach the capture proxy only by a public URL; ``builds`` is what it makes, once per
    content, from a task's environment (``"templates"``, ``"images"``), or None when it prepares the
    environment at every start;
    ``wants_proxy_url`` means it takes the capture proxy's URL as agents are told it (its ``proxy_url``
    option, which the rollout runtime fills in) to make that URL reachable inside its sandboxes;
    ``sidecars`` means it starts a compose task's other services beside the agent's (a backend that does not
    refuses such a task at start)."""

    summary: str
    isolation: Isolation
    credentials: tuple[str, ...] = ()
    login: Login | None = None
    remote: bool = False
    builds: str | None = None
    wants_proxy_url: bool = False
    sidecars: bool = False
    extra: str | None = None
    """The project's pip extra that brings the backend's SDK (``pip install 'harness-trainer[EXTRA]'``), which
    a Jobs run installs by default for the backend it uses; None: it needs none."""
    forks: bool = False
    """The backend is also a :class:`ForkingBackend`: a GRPO group's members can start from one prepared
    sandbox's snapshot instead of each preparing its own (one setup per group)."""


class SandboxBackend(Protocol):
    name: str
    capabilities: Capabilities

    def provide(self, agents: Sequence[AgentProvision]) -> None:
        """Put these agents into every sandbox started from now on (and set them up as each environment is
        prepared); a backend whose sandboxes see this machine's files needs nothing."""
        ...

    async def prepare(self, task: HarborTask) -> None:
        """Make ready what starts of ``task`` share (an image, a template), once per environment however
        many callers ask at once; raises :class:`SandboxStartError`. ``start`` does it too: a caller that
        limits starts (:class:`~.supervisor.SandboxSupervisor`) awaits it first, so a slow build never
        holds a start slot or a create-rate token."""
        ...

    async def start(
        self, task: HarborTask, *, lifetime_s: float, env: dict[str, str] | None = None
    ) -> Sandbox:
        """A running sandbox with the task's environment prepared; raises :class:`SandboxStartError`."""
        ...

    async def aclose(self) -> None:
        """Close every sandbox this backend started that is still open (shutdown, SIGTERM)."""
        ...


@dataclass(frozen=True)
class SandboxSnapshot:
    """A prepared sandbox's files, frozen by a :class:`ForkingBackend` for other sandboxes to start from.

    ``id`` is the backend's own handle (an image, an E2B snapshot, a folder); ``source`` the id of the
    sandbox it was taken from; ``task_name`` the task that sandbox ran."""

    id: str
    source: str
    task_name: str


class ForkingBackend(SandboxBackend, Protocol):
    """A backend whose ``capabilities.forks`` is True: a sandbox's state can be frozen once and started
    many times (E2B's snapshots, a committed Docker container, a copy-on-write layer on this machine).

    Every snapshot is named or labelled with the process's run (as its sandboxes are), so that ``aclose``,
    the next backend's first start after a crash and the backend's ``cleanup`` find and delete the ones
    left behind."""

    @property
    def snapshots(self) -> list[SandboxSnapshot]:
        """The snapshots it made that are not dropped yet."""
        ...

    async def snapshot(self, sandbox: Sandbox) -> SandboxSnapshot:
        """Freeze ``sandbox``'s files as they are now (running processes are not carried over); the
        sandbox keeps running and its later writes are not in the snapshot. Raises :class:`SandboxError`."""
        ...

    async def start_from(
        self,
        snapshot: SandboxSnapshot,
        task: HarborTask,
        *,
        lifetime_s: float,
        env: dict[str, str] | None = None,
    ) -> Sandbox:
        """A running sandbox for ``task`` holding the snapshot's files, as :meth:`start` would return it
        (its ``/logs``, ``/tests`` and ``/solution`` as the snapshot left them) and independent of every
        other: a write in one is seen in no other, nor in the snapshot. Raises :class:`SandboxStartError`."""
        ...

    async def drop(self, snapshot: SandboxSnapshot) -> None:
        """Delete ``snapshot``; idempotent, never raises. The caller drops a snapshot only once every
        sandbox started from it is closed; ``aclose`` drops those still held."""
        ...


def fetch_command(url: str, timeout_s: int = 30) -> str:
    """A shell command that prints the body at ``url`` fetched from inside a sandbox and fails when it
    cannot: with ``curl``, else ``python3``, else (plain HTTP) bash's ``/dev/tcp``, whichever the image has,
    so that an image with none of the first two is no reason to call the URL unreachable."""
    quoted = shlex.quote(url)
    python = (
        "python3 -c 'import sys, urllib.request; "
        f"print(urllib.request.urlopen(sys.argv[1], timeout={timeout_s}).read().decode())' {quoted}"
    )
    command = (
        f"if command -v curl >/dev/null 2>&1; then curl -fsS --max-time {timeout_s} {quoted}; "
        f"elif command -v python3 >/dev/null 2>&1; then {python}; "
    )
    parts = urlsplit(url)
    if parts.scheme == "http" and parts.hostname:
        host, port = parts.hostname, parts.port or 80
        request = shlex.quote(f"GET {parts.path or '/'} HTTP/1.0\r\nHost: {host}\r\n\r\n")
        command += (
            f"else exec 3<>/dev/tcp/{host}/{port} && printf {request} >&3 && "
            f"timeout {timeout_s} cat <&3 | grep -q '^HTTP/1.[01] 200' && echo ok; "
        )
    else:
        command += "else echo 'neither curl nor python3 here to fetch an https URL' >&2; exit 127; "
    return command + "fi"


def refuse_sidecars(task: HarborTask, backend: str) -> None:
    """For a backend without ``sidecars``: refuse a compose task whose services it would not start.

    Raises:
        SandboxStartError: ``task``'s ``docker-compose.yaml`` has services beside ``main``.
    """
    if task.compose is not None and task.compose.sidecars:
        names = ", ".join(service.name for service in task.compose.sidecars)
        raise SandboxStartError(
            f"{task.name}: its {task.compose.path.name} runs services beside the agent's ({names}); the "
            f"{backend} backend starts none: run it on the docker backend"
        )
