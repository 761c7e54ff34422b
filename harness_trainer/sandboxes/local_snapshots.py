"""The local sandbox's snapshots (:class:`~harness_trainer.sandboxes.base.ForkingBackend`): one prepared
sandbox's private directories frozen once, many sandboxes started from them without the task's ``RUN`` steps.

A snapshot is a folder ``<base_dir>/ht-snap-<id>`` holding a copy (``cp -a --reflink=auto``: a reflink where
the filesystem has them) of each private directory of the source sandbox, as the source's namespace sees it,
under ``fs/<path>``. Like a sandbox root it is ``flock``-ed by the backend that made it until ``drop``, so the
sweep of stale roots (:func:`~harness_trainer.sandboxes.local.sweep_stale_roots`) deletes one whose owner
died. What a start from it needs that is not files (the task, its workdir, its mounts, the Dockerfile's
``ENV``: its :class:`Layout`) stays in the backend's :class:`SnapshotStore`.

A sandbox started from a snapshot (a member) sees each private directory as a **copy-on-write view** of the
snapshot's: an overlayfs mounted inside the member's own mount namespace (lower: the snapshot's copy, upper
and work: in the member's root), so a member writes only its own layer and nothing is mounted on the host's
mount table; the member's file methods reach its files through its init's root (``/proc/<pid>/root``).
Where an overlay cannot be mounted (:func:`overlay_works`: a kernel without overlayfs in user namespaces in
the rootless mode, a base dir on a filesystem overlayfs cannot use as upper layer, or a path that overlayfs
options cannot spell), the member gets a **full copy** of the snapshot in its root instead, bind-mounted as a
fresh sandbox's directories are. Either way members are independent of each other and of the snapshot.

Sandbox roots and snapshot folders share their making here (:func:`claim`, :func:`make_root`,
:func:`private_paths`, :func:`remove_tree`), used by :mod:`.local`'s ``start`` and ``start_from`` alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import posixpath
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

from harness_trainer.sandboxes.base import (
    Sandbox,
    SandboxError,
    SandboxSnapshot,
    SandboxStartError,
    sandbox_lifetime,
)
from harness_trainer.sandboxes.processes import Namespace, run_captured
from harness_trainer.sandboxes.rootless import Mode, tool

if TYPE_CHECKING:
    from harness_trainer.sandboxes.local import LocalSandbox
    from harness_trainer.tasks.task import HarborTask

# $1 = mount, then (lower, upper, work, sandbox path) per private directory; run inside the namespace.
_MOUNT_LAYERS = """
MOUNT=$1; shift
while [ "$#" -ge 4 ]; do
  "$MOUNT" -t overlay ht-layer -o "lowerdir=$1,upperdir=$2,workdir=$3" "$4" || exit 125
  shift 4
done
"""
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run")
SYSTEM_DIRS += ("/sbin", "/sys", "/usr", "/var")
# Characters that overlayfs' mount options would read as separators.
_UNSPELLABLE = (",", ":", "\\", "=")


@dataclass(frozen=True)
class Layout:
    """What a sandbox is besides its files: the task it runs, its workdir, its private directories (the
    mount points) and the Dockerfile's ``ENV``; a snapshot keeps its source's."""

    task_name: str
    workdir: str
    mounts: tuple[str, ...]
    image_env: dict[str, str] = field(hash=False)


def private_paths(task: HarborTask, paths: Iterable[str], base_dir: Path) -> tuple[str, ...]:
    """A sandbox's mount points (its :class:`Layout`'s): each path not inside an earlier one, checked not to
    hide the host's; raises SandboxStartError."""
    chosen: list[str] = []
    for path in sorted({posixpath.normpath(p) for p in paths}, key=lambda p: (p.count("/"), p)):
        if not any(path == c or path.startswith(c + "/") for c in chosen):
            _check_mount_point(task, path, base_dir)
            chosen.append(path)
    return tuple(chosen)


def _check_mount_point(task: HarborTask, path: str, base_dir: Path) -> None:
    needed = [str(base_dir), sys.prefix, *os.environ.get("PATH", "").split(os.pathsep)]
    hidden = [n for n in needed if n.startswith("/") and (n == path or n.startswith(path.rstrip("/") + "/"))]
    system = path == "/" or any(path == s or path.startswith(s + "/") for s in SYSTEM_DIRS)
    if system or hidden:
        why = "it is a system directory" if system else f"it would hide {hidden[0]}, which commands need"
        raise SandboxStartError(
            f"{task.name}: the local sandbox cannot make {path} private ({why}); its Dockerfile "
            "should write into the workspace instead"
        )


@dataclass
class Held:
    """A snapshot this backend holds: its folder (locked by ``lock_fd`` until dropped) and its layout."""

    snapshot: SandboxSnapshot
    folder: Path
    lock_fd: int
    layout: Layout

    def lower(self, mount: str) -> Path:
        return self.folder / "fs" / mount.lstrip("/")


def claim(folder: Path) -> int:
    """Create ``folder`` and return the fd holding its ``.lock``, taken before the folder has its name: a
    sweep (this process's or another's) deletes any ``ht-*`` folder whose lock it can take, so one must
    never be visible under that name unlocked."""
    unnamed = folder.with_name(f".{folder.name}.new")
    unnamed.mkdir(parents=True)
    lock_fd = os.open(unnamed / ".lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(unnamed, folder)
    return lock_fd


def make_root(root: Path, mounts: tuple[str, ...], mode: Mode, fill: Callable[[Path], None]) -> int:
    """Creates a sandbox's root (locked: :func:`claim`), its mount points (on the host in root mode; the
    rootless mode mounts its new root on ``mnt``) and ``fs/<path>`` for each, then ``fill`` s it; returns
    the fd holding the root's lock."""
    lock_fd = claim(root)
    if mode.private_root:
        (root / "mnt").mkdir()
    for mount in mounts:
        try:
            if not mode.private_root:
                os.makedirs(mount, exist_ok=True)  # the mount point on the host: stays empty
        except FileExistsError:
            raise SandboxStartError(f"cannot mount over {mount}: it is a file on the host") from None
        (root / "fs" / mount.lstrip("/")).mkdir(parents=True, exist_ok=True)
    fill(root)
    return lock_fd


def remove_tree(path: Path) -> None:
    """Delete ``path`` whatever is in it, never raising: overlayfs leaves mode-000 directories in its work
    directory, which a caller who is not root must open up before it can delete them."""
    if os.geteuid() != 0:
        for directory, names, _ in os.walk(path):
            for name in names:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(directory, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)


def copy_tree(source: Path, target: Path) -> None:
    """``source``'s contents into the directory ``target``, with owners, modes and times (reflinks where
    the filesystem has them); raises SandboxError with cp's message."""
    target.mkdir(parents=True, exist_ok=True)
    argv = [tool("cp") or "cp", "-a", "--reflink=auto", f"{source}/.", str(target)]
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SandboxError(f"cannot copy {source}: {done.stderr.strip()[-1000:]}")


@functools.cache
def overlay_works(mode: Mode, base_dir: Path) -> bool:
    """Whether a sandbox made as ``mode`` can mount an overlayfs whose layers are in ``base_dir``, deleting a
    lower file included (a whiteout): tried for real once per process, in a throwaway namespace."""
    if any(c in str(base_dir) for c in _UNSPELLABLE) or tool("unshare") is None or tool("mount") is None:
        return False
    if mode.needs_root and os.geteuid() != 0:
        return False
    base_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".ht-overlay-probe-", dir=base_dir) as scratch:
        layers = [Path(scratch, name) for name in ("lower", "upper", "work", "merged")]
        for layer in layers:
            layer.mkdir()
        (layers[0] / "file").touch()
        options = f"lowerdir={layers[0]},upperdir={layers[1]},workdir={layers[2]}"
        script = '"$1" -t overlay ht-probe -o "$2" "$3" && rm "$3/file" && touch "$3/new"'
        argv = [tool("unshare") or "unshare", "--mount", "--propagation", "private", *mode.unshare_flags]
        argv += ["sh", "-c", script, "sh", tool("mount") or "mount", options, str(layers[3])]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=10, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return False
    return done.returncode == 0


class SnapshotStore:
    """The snapshots one backend made and holds, each a locked folder in ``base_dir``."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self._held: dict[str, Held] = {}

    @property
    def snapshots(self) -> list[SandboxSnapshot]:
        return [held.snapshot for held in self._held.values()]

    async def take(self, sandbox: LocalSandbox) -> SandboxSnapshot:
        """Copy ``sandbox``'s private directories, as it sees them now, into a new snapshot folder."""
        if sandbox.closed:
            raise SandboxError(f"cannot snapshot sandbox {sandbox.id}: it is closed")
        folder = self.base_dir / f"ht-snap-{uuid.uuid4().hex[:12]}"
        lock_fd = -1
        try:
            lock_fd = await asyncio.to_thread(claim, folder)
            for mount in sandbox.mounts:
                await asyncio.to_thread(
                    copy_tree, sandbox.host_path(mount), folder / "fs" / mount.lstrip("/")
                )
        except BaseException as exc:
            await asyncio.to_thread(remove_tree, folder)
            await asyncio.to_thread(remove_tree, folder.with_name(f".{folder.name}.new"))
            if lock_fd >= 0:
                os.close(lock_fd)
            if isinstance(exc, OSError):
                raise SandboxError(f"cannot snapshot sandbox {sandbox.id}: {exc}") from exc
            raise
        snapshot = SandboxSnapshot(id=folder.name, source=sandbox.id, task_name=sandbox.layout.task_name)
        self._held[snapshot.id] = Held(snapshot, folder, lock_fd, sandbox.layout)
        return snapshot

    def held(self, snapshot: SandboxSnapshot) -> Held:
        """The snapshot's record; raises SandboxStartError when this store does not hold it (dropped)."""
        if (held := self._held.get(snapshot.id)) is None:
            raise SandboxStartError(f"snapshot {snapshot.id} is not held by this backend (dropped?)")
        return held

    async def drop(self, snapshot: SandboxSnapshot) -> None:
        """Delete the snapshot's folder; idempotent, never raises."""
        held = self._held.pop(snapshot.id, None)
        if held is not None:
            await asyncio.to_thread(remove_tree, held.folder)
            os.close(held.lock_fd)

    async def drop_all(self) -> None:
        for snapshot in self.snapshots:
            await self.drop(snapshot)


class Layers:
    """How a member's private directories come from ``held``: overlays (``overlay``) or a full copy."""

    def __init__(self, held: Held, overlay: bool) -> None:
        self.held = held
        self.overlay = overlay and not any(
            c in f"{held.folder}{m}" for m in held.layout.mounts for c in _UNSPELLABLE
        )

    def fill(self, root: Path) -> None:
        """Prepare the member's root (its ``fs/<path>`` mount points exist): the overlays' upper and work
        directories, or the copy."""
        for mount in self.held.layout.mounts:
            relative = mount.lstrip("/")
            if self.overlay:
                (root / "upper" / relative).mkdir(parents=True)
                (root / "work" / relative).mkdir(parents=True)
            else:
                copy_tree(self.held.lower(mount), root / "fs" / relative)

    async def mount(self, root: Path, namespace: Namespace, env: Mapping[str, str], grace_s: float) -> Path:
        """Mount the overlays inside the member's namespace (over its empty binds); returns where this
        process reaches the member's private directories (its init's root then, else ``root/fs``).
        Raises SandboxStartError."""
        if not self.overlay:
            return root / "fs"
        words: list[str] = []
        for mount in self.held.layout.mounts:
            relative = mount.lstrip("/")
            words += [
                str(self.held.lower(mount)),
                str(root / "upper" / relative),
                str(root / "work" / relative),
            ]
            words.append(mount)
        argv = namespace.enter_argv(
            ["/bin/sh", "-c", _MOUNT_LAYERS, "sh", tool("mount") or "mount", *words], cwd="/"
        )
        done = await run_captured(argv, env=env, timeout_s=30, grace_s=grace_s)
        if done.exit_code != 0:
            why = "it timed out" if done.timed_out else done.stderr.strip()[-1000:]
            raise SandboxStartError(f"cannot mount the snapshot's layers: {why}")
        return Path(f"/proc/{namespace.init_pid}/root")


class SnapshotMethods:
    """The :class:`~harness_trainer.sandboxes.base.ForkingBackend` half of
    :class:`~harness_trainer.sandboxes.local.LocalSandboxBackend`, on its store, its sweep-once mode choice
    and its shared launch."""

    base_dir: Path
    lifetime_margin_s: float
    _store: SnapshotStore
    _live: set[LocalSandbox]
    _mode: Callable[[HarborTask], Awaitable[Mode]]
    _launch: Callable[..., Awaitable[LocalSandbox]]

    @property
    def snapshots(self) -> list[SandboxSnapshot]:
        """The snapshots this backend made that are not dropped yet."""
        return self._store.snapshots

    async def snapshot(self, sandbox: Sandbox) -> SandboxSnapshot:
        """Copy ``sandbox``'s private directories, as they are now, into a snapshot folder in ``base_dir``;
        it keeps running. Raises SandboxError (not an open sandbox of this backend, or the copy failed)."""
        if sandbox not in self._live:
            raise SandboxError(f"sandbox {sandbox.id} is not an open sandbox of this backend")
        return await self._store.take(cast("LocalSandbox", sandbox))

    async def start_from(
        self,
        snapshot: SandboxSnapshot,
        task: HarborTask,
        *,
        lifetime_s: float,
        env: dict[str, str] | None = None,
    ) -> LocalSandbox:
        """A sandbox as ``start`` gives it (the source's workdir, mounts and Dockerfile ``ENV``; ``env``, the
        network and the lifetime as ``task`` and the caller say) without the Dockerfile's steps: its private
        directories are an overlay of the snapshot's, or a full copy where no overlay can be mounted.
        Raises SandboxStartError, also for a snapshot this backend does not hold (dropped)."""
        mode = await self._mode(task)
        held = self._store.held(snapshot)
        overlay = await asyncio.to_thread(overlay_works, mode, self.base_dir)
        sandbox = await self._launch(task, mode, held.layout, env, Layers(held, overlay))
        sandbox.expire_after(sandbox_lifetime(task, lifetime_s, self.lifetime_margin_s))
        return sandbox

    async def drop(self, snapshot: SandboxSnapshot) -> None:
        """Delete the snapshot's folder; idempotent, never raises (its sandboxes are closed first)."""
        await self._store.drop(snapshot)
