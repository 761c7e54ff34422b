"""The local sandbox: the mock sandbox of the dev loop and the tests, built on Linux namespaces.

Each sandbox owns a private root directory ``<base_dir>/ht-<id>/fs`` holding its workspace (the task's
``[environment] workdir``, else its Dockerfile's ``WORKDIR``, else ``/app``), ``/logs`` (with ``agent/`` and
``verifier/``), ``/tests``, ``/solution`` and a private ``HOME`` (``/home/user``). One init process per
sandbox holds its namespaces (see :mod:`harness_trainer.sandboxes.processes`) in which those directories are
bind-mounted over their absolute paths, so ``/logs/verifier/reward.txt`` works and concurrent sandboxes never
see each other's files. ``/tests`` and ``/solution`` start empty: the rollout uploads them when it needs them
(the agent must not see the tests), as Harbor does.

Two modes (:mod:`harness_trainer.sandboxes.rootless`; ``LocalSandboxBackend.modes``), the strongest that
works here chosen at the first start and logged once (``mode=`` forces one):

- **root** (the caller is root): a mount + PID namespace. The mount points must exist on the host: they
  are **created as empty directories on the host** when missing (``/app``, ``/logs``, ``/tests``,
  ``/solution``, ``/home/user``…) and stay empty there.
- **rootless** (any user, where unprivileged user namespaces work): a user + mount + PID namespace, the
  caller mapped to root. The sandbox runs in a new root (a tmpfs holding binds of the host's ``/``
  entries and of its private directories), so **the host gets no new directory**; commands, ``RUN``
  steps included, run as root of the namespace, which on the host is the caller: a ``RUN`` that needs
  the host's real root (``apt-get install``, writing ``/usr``) fails, naming the task and the line.

Where neither works (user namespaces disabled, a container without the rights, not Linux), ``start``
raises :class:`~harness_trainer.sandboxes.rootless.LocalSandboxUnavailable` before making anything,
saying why and what to do (the dev loop asks first, and stops).

The environment is prepared without Docker, from the task's ``environment/Dockerfile``
(:mod:`harness_trainer.sandboxes.dockerfile`): ``WORKDIR``, ``ENV``, ``ARG``, ``COPY``/``ADD`` and ``RUN``
are applied at every start (no layer cache; ``RUN`` steps share the build timeout); every other
instruction is refused with its line number. A GRPO group pays that once: ``snapshot`` copies a prepared
sandbox's private directories into a locked folder ``<base_dir>/ht-snap-<id>`` (swept like a root when its
owner dies), and ``start_from`` starts a sandbox without ``RUN`` steps whose private directories are an
overlayfs on that copy, mounted in its own namespace (or a full copy where overlayfs cannot be mounted):
:mod:`.local_snapshots`. A directory the Dockerfile writes to (``WORKDIR``, ``COPY``
destination) becomes one more private mount, unless that would hide a system directory (``/usr``,
``/etc``…), the base dir or a directory on the host ``PATH``, which is refused.

Commands run as ``bash -lc`` entered into the namespace, each in its own process group: on timeout (and
cancellation) the group gets SIGTERM, then SIGKILL after ``kill_grace_s``. ``close`` (idempotent) kills
the namespace's init, and with it every process of the sandbox, then deletes the root. A sandbox also
closes itself when its lifetime runs out; a root left by a process that died hard (its processes die
with it) is deleted by the next backend's first start (each live root is ``flock``-ed by its owner). The
environment is scrubbed: a command sees only ``PATH`` (the host's, after ``~/.local/bin``), ``HOME``,
``LANG``, ``LC_ALL`` and ``TERM`` (from the host when set), the variables that point TLS clients at the
host's CA bundle and the host's proxy variables (:mod:`.host_trust`; ``inherit_host_trust=False`` leaves
them out), the names in ``passthrough_env``, the Dockerfile's ``ENV``, what ``start(env=…)`` gave, and its own
``env``. The login shell's ``/etc/profile`` would reset ``PATH``; a ``~/.bash_profile`` restores it.

Network. A task with ``allow_internet = true`` (the default) shares the host's network: the agent reaches
the capture proxy, and everything else, as any process here. With ``allow_internet = false`` the sandbox
gets a network namespace of its own (``unshare --net``; commands enter it with ``nsenter -n``) holding only
its loopback, and the capture proxy's URL (``proxy_url``, given by the runtime:
``capabilities.wants_proxy_url``), when it is on loopback, is relayed to the **same address** in it
(:mod:`.unix_relay`: a Unix socket in the sandbox's root, served here, and a relay process inside the
namespace), so the agent uses the URL unchanged and nothing else of this machine's loopback or network is
reachable. A ``proxy_url`` that is not loopback is not reachable then (as in the docker backend).
Dockerfile ``RUN`` steps run with the host's network either way, as Docker builds images with a network
whatever the task says.

Threat model: this is **not** a security boundary. It gives private task paths, a private process view,
reliable cleanup of every process, a scrubbed environment and, with ``allow_internet = false``, no
network but the capture proxy, which is what a trusted dev loop needs. It does not give: a different user
(commands run with the caller's powers: in root mode root's, all of them, enough to undo any of this; in
rootless mode the caller's own, shown as root in the namespace, which cannot leave the network
namespace), filesystem isolation beyond the private paths (the rest of the host is visible, and writable
as far as the caller may write it: in root mode ``RUN apt-get install`` installs on the host; a Unix
socket on the host's filesystem, a Docker daemon's say, stays reachable whatever the network), or
resource limits (``cpus``/``memory_mb`` are ignored). What rootless mode adds: commands never exceed the
caller's own rights, and the host gets no new directory. Use E2B for untrusted agents. Needs util-linux,
and root or unprivileged user namespaces.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import harness_trainer.sandboxes.dockerfile as dockerfile
from harness_trainer.finish import finish
from harness_trainer.sandboxes.base import (
    AgentProvision,
    Capabilities,
    ExecResult,
    Isolation,
    Lifetime,
    SandboxError,
    SandboxStartError,
    refuse_sidecars,
    resolve_path,
    sandbox_lifetime,
)
from harness_trainer.sandboxes.host_trust import NO_TRUST, HostTrust
from harness_trainer.sandboxes.local_snapshots import (
    Layers,
    Layout,
    SnapshotMethods,
    SnapshotStore,
    make_root,
    private_paths,
    remove_tree,
)
from harness_trainer.sandboxes.processes import Namespace, run_captured
from harness_trainer.sandboxes.rootless import MODES, Mode, choose_mode
from harness_trainer.sandboxes.unix_relay import ProxyRelay, loopback_target
from harness_trainer.tasks.task import HarborTask

FIXED_PATHS = ("/logs", "/tests", "/solution")
_OFFLINE = "[environment] allow_internet = false (a network namespace with only the capture proxy)"
_BASH_PROFILE = """\
# Written by harness-trainer's local sandbox: /etc/profile resets PATH in a login shell; restore ours.
if [ -n "${__HT_PATH-}" ]; then PATH=$__HT_PATH; export PATH; fi
unset __HT_PATH
if [ -f "$HOME/.profile" ]; then . "$HOME/.profile"; fi
"""


class LocalSandbox:
    """One running local sandbox; see the module docstring for what it isolates."""

    shares_host_filesystem = True  # outside its private paths it sees the host (agents run from host caches)

    def __init__(
        self,
        *,
        root: Path,
        layout: Layout,
        home: str,
        env: dict[str, str],
        namespace: Namespace,
        kill_grace_s: float,
        lock_fd: int,
    ) -> None:
        self.id = root.name
        self.root = root
        self.layout = layout
        self.mounts = layout.mounts
        self.workdir = layout.workdir
        self.files = root / "fs"  # where this process reaches the private directories (local_snapshots)
        self.home = home
        self._env = env
        self._namespace = namespace
        self._kill_grace_s = kill_grace_s
        self._lock_fd = lock_fd  # held while the sandbox lives: an unlocked root is a stale one
        self._closed = False
        self._lifetime = Lifetime()
        self.relay: ProxyRelay | None = None  # the capture proxy's, without internet; closed with the sandbox
        self.on_close: list[Callable[[LocalSandbox], object]] = []  # called once, when closed

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def env(self) -> dict[str, str]:
        """The environment every command starts from (before its own ``env``)."""
        return dict(self._env)

    @property
    def pid(self) -> int:
        """The host pid of the sandbox's init (every process of the sandbox is in its namespaces)."""
        return self._namespace.init_pid

    def sandbox_path(self, path: str) -> str:
        """``path`` made absolute: ``~`` is ``home``, relative paths are relative to ``workdir``."""
        return resolve_path(path, workdir=self.workdir, home=self.home)

    def host_path(self, path: str) -> Path:
        """Where sandbox ``path`` lives on the host; raises SandboxError outside the private paths."""
        absolute = self.sandbox_path(path)
        if any(absolute == m or absolute.startswith(m + "/") for m in self.mounts):
            return self.files / absolute.lstrip("/")
        raise SandboxError(
            f"{path!r} is outside the local sandbox's private paths {list(self.mounts)}; the rest of the "
            "filesystem is the host's, so the sandbox's file methods refuse it"
        )

    async def exec(
        self,
        command: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        return await self._run(command, timeout_s=timeout_s, env=env, cwd=cwd)

    async def _run(
        self,
        command: str,
        *,
        timeout_s: float | None,
        env: dict[str, str] | None,
        cwd: str | None,
        host_network: bool = False,
    ) -> ExecResult:
        if self._closed or not self._namespace.running():
            raise SandboxError(f"sandbox {self.id} is closed" if self._closed else f"sandbox {self.id} died")
        full_env = {**self._env, **(env or {})}
        full_env["__HT_PATH"] = full_env.get("PATH", os.defpath)
        directory = self.sandbox_path(cwd) if cwd else self.workdir
        argv = self._namespace.enter_argv(
            ["/bin/bash", "-lc", command], cwd=directory, host_network=host_network
        )
        return await run_captured(argv, env=full_env, timeout_s=timeout_s, grace_s=self._kill_grace_s)

    def _check_open(self) -> None:
        # The file methods work on the host side of the root: after close they would recreate a folder
        # under the base dir that no lock marks as live, so no sweep would ever remove it.
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self._check_open()
        target = self.host_path(path)
        payload = data.encode() if isinstance(data, str) else data
        await asyncio.to_thread(_write, target, payload, mode)

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        return await asyncio.to_thread(self.host_path(path).read_bytes)

    async def upload_dir(self, local: Path, remote: str) -> None:
        if not Path(local).is_dir():
            raise NotADirectoryError(f"{local} is not a directory")
        self._check_open()
        target = self.host_path(remote)
        await asyncio.to_thread(shutil.copytree, local, target, dirs_exist_ok=True)

    def expire_after(self, seconds: float) -> None:
        """Close this sandbox after ``seconds`` (its lifetime), unless it is closed before."""
        self._lifetime.start(seconds, self.close)

    async def close(self) -> None:
        """Kill every process of the sandbox and delete its root; idempotent, never raises, and finishes when
        its caller is cancelled meanwhile (:func:`~harness_trainer.finish.finish`)."""
        if self._closed:
            return
        self._closed = True
        self._lifetime.cancel()
        await finish(self._remove())

    async def _remove(self) -> None:
        try:
            await self._namespace.kill()
        finally:
            if self.relay is not None:  # after the kill: its inside half died with the namespace
                await self.relay.close()
            await asyncio.to_thread(remove_tree, self.root)
            os.close(self._lock_fd)
            for callback in self.on_close:
                callback(self)


def _write(target: Path, payload: bytes, mode: int) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(payload)
    os.chmod(target, mode)


class LocalSandboxBackend(SnapshotMethods):
    """Starts :class:`LocalSandbox` es. Options (all keyword, all optional):

    - ``base_dir``: where sandbox roots go (default: the system temp dir);
    - ``build_timeout_s``: the time all ``RUN`` steps of one start may take, when the task's
      ``[environment] build_timeout_sec`` does not say (default 600);
    - ``kill_grace_s``: SIGTERM → SIGKILL grace on timeouts (default 2);
    - ``lifetime_margin_s``: added to a sandbox's lifetime before it closes itself (default 60);
    - ``home``: the private ``HOME`` (default ``/home/user``, as in E2B);
    - ``passthrough_env``: host variable names commands may also see (e.g. ``("HF_TOKEN",)``);
    - ``mode``: ``"root"`` or ``"rootless"`` (default: the strongest that works here, :meth:`choose_mode`);
    - ``proxy_url``: the capture proxy's URL as agents are told it (the runtime passes it), relayed into
      each sandbox without internet when it is on loopback.
    """

    name = "local"
    capabilities = Capabilities(
        summary="Linux namespaces on this machine, as root or rootless (a user namespace), for the dev loop: "
        "not a security boundary",
        isolation=Isolation(network=True, filesystem=False, user=False, limits=False),
        wants_proxy_url=True,
        forks=True,
    )
    modes: tuple[Mode, ...] = MODES
    """How it can make its namespaces, strongest first (:mod:`~harness_trainer.sandboxes.rootless`)."""
    choose_mode = staticmethod(choose_mode)
    """The mode a backend takes here, logged once; raises LocalSandboxUnavailable saying why and what to do
    when none works (the dev loop asks it before anything else)."""

    def __init__(
        self,
        base_dir: Path | str | None = None,
        *,
        build_timeout_s: float = 600.0,
        kill_grace_s: float = 2.0,
        lifetime_margin_s: float = 60.0,
        home: str = "/home/user",
        passthrough_env: Sequence[str] = (),
        mode: str | None = None,
        inherit_host_trust: bool = True,
        proxy_url: str | None = None,
    ) -> None:
        self.base_dir = Path(base_dir or tempfile.gettempdir()).resolve()
        self.proxy_url = proxy_url
        self.build_timeout_s = build_timeout_s
        self.kill_grace_s = kill_grace_s
        self.lifetime_margin_s = lifetime_margin_s
        self.home = home
        self.passthrough_env = tuple(passthrough_env)
        self.requested_mode = mode
        self.trust = HostTrust.from_host() if inherit_host_trust else NO_TRUST
        self._live: set[LocalSandbox] = set()
        self._swept = False
        self._store = SnapshotStore(self.base_dir)

    @property
    def live(self) -> list[LocalSandbox]:
        """The sandboxes this backend started that are still open."""
        return list(self._live)

    def provide(self, agents: Sequence[AgentProvision]) -> None:
        """Nothing: a local sandbox sees this machine's files, where the bundles are."""

    async def prepare(self, task: HarborTask) -> None:
        """Nothing but refusing a task with sidecars: starts share nothing here (each runs the task's
        ``RUN`` steps in its own root)."""
        refuse_sidecars(task, self.name)

    async def start(
        self, task: HarborTask, *, lifetime_s: float, env: dict[str, str] | None = None
    ) -> LocalSandbox:
        mode = await self._mode(task)
        plan = _plan(task, self._base_env())
        workdir = task.environment.workdir or plan.workdir  # the task's own beats the Dockerfile's
        wanted = [workdir, *plan.written_dirs, *task.artifact_dirs, *FIXED_PATHS, self.home]
        mounts = private_paths(task, wanted, self.base_dir)
        layout = Layout(task.name, workdir, mounts, plan.env)
        sandbox = await self._launch(task, mode, layout, env, None)
        try:
            timeout = task.environment.build_timeout_sec or self.build_timeout_s
            await _build(sandbox, plan, task, time.monotonic() + timeout, mode)
        except BaseException:
            await sandbox.close()
            raise
        sandbox.expire_after(sandbox_lifetime(task, lifetime_s, self.lifetime_margin_s))
        return sandbox

    async def aclose(self) -> None:
        """Close every sandbox this backend started that is still open, then drop its snapshots."""
        await asyncio.gather(*(sandbox.close() for sandbox in self.live))
        await self._store.drop_all()

    async def _mode(self, task: HarborTask) -> Mode:
        """The mode of a start of ``task`` (refused with sidecars); the first start sweeps stale roots."""
        refuse_sidecars(task, self.name)
        mode = await asyncio.to_thread(choose_mode, self.requested_mode)
        if not self._swept:
            self._swept = True
            await asyncio.to_thread(sweep_stale_roots, self.base_dir)
        return mode

    async def _launch(
        self, task: HarborTask, mode: Mode, layout: Layout, env: dict[str, str] | None, layers: Layers | None
    ) -> LocalSandbox:
        """A running sandbox of ``layout``, its private directories fresh or from ``layers``, its relay
        open; the caller applies the Dockerfile (or not) and starts its lifetime."""
        base_env = self._base_env()
        root = self.base_dir / f"ht-{uuid.uuid4().hex[:12]}"
        offline = not task.environment.allow_internet
        lock_fd = -1
        try:
            fill = self._fresh if layers is None else layers.fill
            lock_fd = await asyncio.to_thread(make_root, root, layout.mounts, mode, fill)
            binds = [(root / "fs" / m.lstrip("/"), m) for m in layout.mounts]
            namespace = await Namespace.create(
                binds, base_env, mode=mode, new_root=root / "mnt", private_network=offline
            )
        except BaseException as exc:
            remove_tree(root)
            remove_tree(root.with_name(f".{root.name}.new"))
            if lock_fd >= 0:
                os.close(lock_fd)
            if isinstance(exc, OSError | SandboxError) and not isinstance(exc, SandboxStartError):
                raise SandboxStartError(f"{task.name}: cannot prepare the sandbox root: {exc}") from exc
            if offline and isinstance(exc, SandboxStartError):
                raise SandboxStartError(f"{task.name}: {_OFFLINE}: {exc}") from exc
            raise
        sandbox = LocalSandbox(
            root=root,
            layout=layout,
            home=self.home,
            env={**base_env, **layout.image_env, **(env or {})},
            namespace=namespace,
            kill_grace_s=self.kill_grace_s,
            lock_fd=lock_fd,
        )
        self._live.add(sandbox)
        sandbox.on_close.append(self._live.discard)
        try:
            if layers is not None:
                sandbox.files = await layers.mount(root, namespace, base_env, self.kill_grace_s)
            if offline and (target := loopback_target(self.proxy_url)) is not None:
                sandbox.relay = ProxyRelay(root, *target)
                try:
                    await sandbox.relay.open(namespace, base_env)
                except SandboxStartError as exc:
                    raise SandboxStartError(f"{task.name}: {_OFFLINE}: {exc}") from exc
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    def _base_env(self) -> dict[str, str]:
        host_path = os.environ.get("PATH") or os.defpath
        env = {
            "PATH": f"{self.home}/.local/bin:{host_path}",
            "HOME": self.home,
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "TERM": os.environ.get("TERM", "dumb"),
        }
        # The sandbox shares the host's filesystem, CA bundle included: point TLS clients (npm's too) at it.
        env.update(self.trust.env(str(self.trust.ca_bundle)))
        for name in ("LC_ALL", *self.passthrough_env):
            if name in os.environ:
                env[name] = os.environ[name]
        return env

    def _fresh(self, root: Path) -> None:
        """A fresh sandbox's private directories: the log folders, and a profile that restores PATH."""
        for sub in ("logs/agent", "logs/verifier"):
            (root / "fs" / sub).mkdir(parents=True, exist_ok=True)
        (root / "fs" / self.home.lstrip("/") / ".bash_profile").write_text(_BASH_PROFILE)


def sweep_stale_roots(base_dir: Path) -> list[Path]:
    """Delete the roots and snapshot folders in ``base_dir`` that no live backend holds (left by a process
    that died hard)."""
    removed = []
    for root in base_dir.glob("ht-*"):
        if not re.fullmatch(r"ht-(snap-)?[0-9a-f]{12}", root.name):
            continue
        try:
            fd = os.open(root / ".lock", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # not ours, or still being created
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # alive
        finally:
            os.close(fd)
        remove_tree(root)
        removed.append(root)
    return removed


def _plan(task: HarborTask, base_env: dict[str, str]) -> dockerfile.BuildPlan:
    path = task.dockerfile
    if path is None:
        return dockerfile.BuildPlan(base_image=task.environment.docker_image, workdir="/app", env={})
    try:
        instructions = dockerfile.parse(path.read_text())
        return dockerfile.plan(instructions, base_env=base_env, context=task.environment_dir)
    except (dockerfile.DockerfileError, OSError) as exc:
        raise SandboxStartError(f"{task.name}: {path}: {exc}") from exc


async def _build(
    sandbox: LocalSandbox, plan: dockerfile.BuildPlan, task: HarborTask, deadline: float, mode: Mode
) -> None:
    """Apply the plan's COPY and RUN steps in order; raises SandboxStartError with the failing line."""
    for step in plan.steps:
        if isinstance(step, dockerfile.CopyStep):
            try:
                await asyncio.to_thread(dockerfile.copy_into, step, task.environment_dir, sandbox.host_path)
            except (dockerfile.DockerfileError, OSError, SandboxError) as exc:
                raise SandboxStartError(f"{task.name}: Dockerfile: {exc}") from exc
            continue
        remaining = deadline - time.monotonic()
        result = await sandbox._run(  # with the host's network, as Docker builds an image
            step.command, timeout_s=max(remaining, 0.001), env=step.env, cwd=step.cwd, host_network=True
        )
        if result.exit_code == 0:
            continue
        tail = (result.stdout + result.stderr)[-2000:]
        what = "ran past the build timeout" if result.timed_out else f"exited with code {result.exit_code}"
        where = f"{task.name}: Dockerfile line {step.line}"
        raise SandboxStartError(f"{where}: RUN {what}{mode.run_failure_note}; output tail:\n{tail}")
