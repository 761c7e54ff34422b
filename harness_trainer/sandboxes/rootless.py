"""The local sandbox's two modes, how one is chosen, and the private root of the rootless one.

- **root** (the caller is root): a mount + PID namespace; the task paths (``/app``, ``/logs``…) are bind
  mounts over mount points **created as empty directories on the host**.
- **rootless** (any user, where unprivileged user namespaces work): a user + mount + PID namespace
  (``unshare --user --map-root-user``), the caller mapped to root inside. The init builds a new root in
  a tmpfs: each entry of the host's ``/`` bind-mounted (recursively) into it, symlinks copied, the task
  paths bind-mounted from the sandbox's own directories, a fresh ``/proc``; then it ``pivot_root`` s into
  it and detaches the host's root. The host gets **no new directory**: a task path whose parent exists on
  the host (``/home/user``) gets a tmpfs parent holding binds of the host's other entries. Writes outside
  the private paths reach the host with the caller's own rights: a host system directory stays
  unwritable (``RUN apt-get install`` fails, with the task and the Dockerfile line), and a file the
  sandbox creates belongs to the caller.

:func:`choose_mode` tries them in that order (:data:`MODES`, strongest first), each by really making its
namespaces (a few milliseconds, once per process), logs the choice once, and raises
:class:`LocalSandboxUnavailable` saying why and what to do when neither works (user namespaces disabled,
a container without the rights, not Linux). :func:`new_root_ops` is the pure plan of the rootless root.
"""

from __future__ import annotations

import functools
import logging
import os
import posixpath
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness_trainer.sandboxes.base import SandboxStartError

log = logging.getLogger(__name__)


class LocalSandboxUnavailable(SandboxStartError):
    """No mode of the local sandbox works on this machine; the message says why and what to do."""


@dataclass(frozen=True)
class Mode:
    """One way the local sandbox makes its namespaces; ``summary`` is what the dev loop prints."""

    name: str
    summary: str
    unshare_flags: tuple[str, ...]
    """Flags of ``unshare`` that make the namespaces (with ``--fork --pid --mount``)."""
    nsenter_flags: tuple[str, ...]
    """Flags of ``nsenter`` that enter them."""
    run_failure_note: str = ""
    """Said after a failed Dockerfile ``RUN``: what this mode cannot do that the step may have needed."""
    needs_root: bool = False
    """Only root can make its namespaces."""
    private_root: bool = False
    """The sandbox runs in a new root of its own (``pivot_root``), so the task paths need no mount points
    on the host."""


ROOT = Mode(
    "root",
    "root: mount + PID namespaces; the task paths are empty mount points created on the host",
    ("--mount-proc",),
    ("-m", "-p"),
    needs_root=True,
)
ROOTLESS = Mode(
    "rootless",
    "rootless: user + mount + PID namespaces, you mapped to root in a private root; nothing is created on "
    "the host",
    ("--user", "--map-root-user"),
    ("-U", "--preserve-credentials", "-m", "-p"),  # setgroups is denied in the namespace: keep our ids
    " (rootless mode: the step ran as root of a user namespace, which is you on the host: it cannot write "
    "the host's system directories or change a file's owner; run as root, or write into the workspace)",
    private_root=True,
)
MODES = (ROOT, ROOTLESS)
"""Strongest first: :func:`choose_mode` takes the first that works."""

OLD_ROOT = "/.ht-old-root"
# $1 = the init's shell (unused), $2 = the tmpfs mount point, $3 = pivot_root, then new_root_ops' words.
# The tmpfs is unbindable, so the recursive binds of host directories do not copy it into itself.
ROOTLESS_INIT = f"""
R=$1; PIVOT=$2; shift 2
fail() {{ echo "cannot $*" >&2; exit 125; }}
mount -t tmpfs -o mode=755 ht-root "$R" && mount --make-unbindable "$R" || fail "mount a tmpfs on $R"
while [ "$#" -ge 2 ]; do
  case "$1" in
    dir) mkdir -p "$R$2" || fail "make $2"; shift 2 ;;
    link) ln -s "$3" "$R$2" || fail "link $2"; shift 3 ;;
    rbind) mkdir "$R$3" && mount --rbind "$2" "$R$3" || fail "bind $2 on $3"; shift 3 ;;
    file) : > "$R$3" && mount --bind "$2" "$R$3" || fail "bind $2 on $3"; shift 3 ;;
    bind) mkdir -p "$R$3" && mount --bind "$2" "$R$3" || fail "bind $2 on $3"; shift 3 ;;
    *) fail "read the plan at $1" ;;
  esac
done
mkdir "$R/proc" "$R{OLD_ROOT}" && mount -t proc proc "$R/proc" || fail "mount /proc"
cd "$R" && "$PIVOT" . "{OLD_ROOT.lstrip("/")}" || fail "pivot_root into the new root"
cd / && umount -l "{OLD_ROOT}" && rmdir "{OLD_ROOT}" || fail "detach the host's root"
echo ready
exec /bin/bash -c 'trap "" TERM INT HUP; while :; do sleep 86400 & wait; done'
"""


def tool(name: str) -> str | None:
    """``name``'s path: on ``PATH``, else in ``/usr/sbin`` or ``/sbin`` (not on an ordinary user's PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def new_root_ops(binds: Sequence[tuple[Path, str]], host_root: Path = Path("/")) -> list[str]:
    """The words :data:`ROOTLESS_INIT` reads: how to build a root holding the host's ``/`` and, at each
    sandbox path of ``binds``, its host directory.

    Each entry of the host's ``/`` is bound recursively (``rbind``), a symlink copied (``link``), a file
    bound (``file``); ``/proc`` is left out (the init mounts its own). A directory on the way to a
    sandbox path (``/home`` for ``/home/user``) is made in the tmpfs (``dir``) and filled the same way
    from the host's, the sandbox path itself left out; then each bind (``bind``)."""
    mounts = {path for _, path in binds}
    on_the_way = {posixpath.dirname(p) for p in mounts}
    for path in list(on_the_way):
        while path != "/":
            on_the_way.add(path)
            path = posixpath.dirname(path)
    ops: list[str] = []

    def fill(directory: str) -> None:
        host = host_root / directory.lstrip("/")
        try:
            names = sorted(os.listdir(host))
        except OSError:  # not on the host (or not a directory there): the tmpfs directory stays empty
            names = []
        for name in names:
            path = posixpath.join(directory, name)
            source = host / name
            if path in mounts or path in on_the_way or path == "/proc":
                continue
            if source.is_symlink():
                ops.extend(["link", path, os.readlink(source)])
            elif source.is_dir():
                ops.extend(["rbind", str(source), path])
            elif source.is_file():
                ops.extend(["file", str(source), path])
        for path in sorted(p for p in on_the_way if p != "/" and posixpath.dirname(p) == directory):
            ops.extend(["dir", path])
            fill(path)

    fill("/")
    for host_dir, path in binds:
        ops.extend(["bind", str(host_dir), path])
    return ops


def _run_probe(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit code {done.returncode}")


def probe(mode: Mode) -> str | None:
    """Why ``mode`` cannot work here, in a few words; None when it makes its namespaces for real."""
    if sys.platform != "linux":
        return f"it needs Linux, and this is {sys.platform}"
    needed = ["unshare", "nsenter", "setpriv", "mount", "bash"] + (
        ["pivot_root"] if mode.private_root else []
    )
    if missing := [name for name in needed if tool(name) is None]:
        return f"{', '.join(missing)} not found (util-linux)"
    unshare = [tool("unshare") or "unshare", "--fork", "--pid", "--mount", "--propagation", "private"]
    if not mode.private_root:
        if mode.needs_root and os.geteuid() != 0:
            return "not running as root"
        return _run_probe([*unshare, *mode.unshare_flags, "true"])
    with tempfile.TemporaryDirectory(prefix="ht-probe-") as scratch:
        script = 'mount -t tmpfs t "$1" && mkdir "$1/proc" "$1/old" && mount -t proc proc "$1/proc" && '
        script += 'cd "$1" && "$2" . old'
        pivot = tool("pivot_root") or "pivot_root"
        return _run_probe([*unshare, *mode.unshare_flags, "sh", "-c", script, "sh", scratch, pivot])


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def how_to_enable_user_namespaces() -> str:
    """The command that turns unprivileged user namespaces on here (the setting found off), or all three."""
    settings = {  # the setting, its value when off, its value when on
        "kernel.unprivileged_userns_clone": ("0", "1"),
        "user.max_user_namespaces": ("0", "15000"),
        "kernel.apparmor_restrict_unprivileged_userns": ("1", "0"),
    }
    off = [f"{name}={on}" for name, (no, on) in settings.items() if _read(_sysctl_path(name)) == no]
    every = [f"{name}={on}" for name, (_, on) in settings.items()]
    return " or ".join(f"`sudo sysctl -w {fix}`" for fix in (off or every))


def _sysctl_path(name: str) -> str:
    return "/proc/sys/" + name.replace(".", "/")


@functools.cache
def choose_mode(requested: str | None = None) -> Mode:
    """The strongest mode that works here (or ``requested``, checked); logged once.

    Raises:
        LocalSandboxUnavailable: none works (or not ``requested``), with why and what to do instead.
    """
    candidates = [m for m in MODES if requested in (None, m.name)]
    if not candidates:
        known = ", ".join(m.name for m in MODES)
        raise ValueError(f"unknown local sandbox mode {requested!r}; known: {known}")
    reasons = []
    for mode in candidates:
        if (why := probe(mode)) is None:
            log.info("local sandbox: %s", mode.summary)
            return mode
        reasons.append(f"{mode.name} mode: {why}")
    elsewhere = (
        "run the agents in Docker or E2B instead: `harness-trainer serve` and the training launcher "
        "(`harness-trainer train`) with `--sandbox docker`"
    )
    if sys.platform != "linux":
        raise LocalSandboxUnavailable(
            f"the local sandbox needs Linux, and this is {sys.platform}: {elsewhere}"
        )
    raise LocalSandboxUnavailable(
        f"the local sandbox cannot run on this machine ({'; '.join(reasons)}). Run as root, or allow "
        f"unprivileged user namespaces ({how_to_enable_user_namespaces()}), or {elsewhere}"
    )


def unavailable() -> str | None:
    """Why no mode of the local sandbox works here (what :class:`LocalSandboxUnavailable` says), or None."""
    try:
        choose_mode()
    except LocalSandboxUnavailable as exc:
        return str(exc)
    return None
