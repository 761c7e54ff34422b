"""Run tests as an ordinary user from a test suite that runs as root (the rootless local sandbox's tests).

The user is ``nobody`` (on every Debian-like machine; nothing is added to ``/etc/passwd``). It must reach
the checkout, the venv and the venv's interpreter, which may sit under directories it cannot enter: a CI
clone under ``mktemp -d`` (mode 700), a pyenv interpreter under ``/root``. Nothing on the machine is
chmod-ed for it: the command runs in a private mount namespace (as root, before dropping to the user) in
which each such directory is covered by a tmpfs of mode 755 holding binds of just the entries on the way
to what it needs, so every path stays the same and only those entries become reachable. The user gets a
fresh ``HOME`` and ``TMPDIR`` of its own (deleted afterwards), ``PYTHONPATH`` set to the checkout, and no
bytecode writes (the checkout is not its).
"""

from __future__ import annotations

import os
import posixpath
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
USER = "nobody"


def why_not_available() -> str | None:
    """Why tests cannot run as an ordinary user here (or None)."""
    if os.geteuid() != 0:
        return "runs as root to switch to an ordinary user (as an ordinary user, run the tests directly)"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"no user {USER!r} on this machine"
    missing = [t for t in ("unshare", "setpriv", "mount") if shutil.which(t) is None]
    return f"{', '.join(missing)} not found" if missing else None


def needed_paths() -> list[str]:
    """What a Python test run needs to reach: the checkout and the venv (whole), and its interpreter."""
    return [str(REPO), sys.prefix, sys.base_prefix, os.path.realpath(sys.executable)]


EVERYTHING = "*"
"""In :func:`blocked_steps`' answer: every entry of that directory is needed."""


def blocked_steps(paths: Sequence[str]) -> dict[str, set[str]]:
    """Each directory others cannot enter on the way to ``paths`` (or cannot list, for a path itself),
    with the entries needed inside it (:data:`EVERYTHING` for a path itself)."""
    blocked: dict[str, set[str]] = {}
    for path in paths:
        parts = posixpath.normpath(path).strip("/").split("/")
        for depth in range(len(parts)):
            directory = "/" + "/".join(parts[:depth])
            if not os.stat(directory).st_mode & stat.S_IXOTH:
                blocked.setdefault(directory, set()).add(parts[depth])
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode) and (mode & 0o005) != 0o005:
            blocked.setdefault(path, set()).add(EVERYTHING)
    return {d: set(os.listdir(d)) if EVERYTHING in names else names for d, names in blocked.items()}


def expose_script(blocked: Mapping[str, set[str]], stash: str) -> str:
    """Shell lines (run as root in a private mount namespace) covering each blocked directory with a
    755 tmpfs that holds binds of the needed entries; deepest first, so the outer covers keep the inner."""
    lines = ["set -e"]
    for number, (directory, names) in enumerate(sorted(blocked.items(), key=lambda d: -d[0].count("/"))):
        entries = [
            (f"{directory}/{n}", f"{stash}/{number}/{n}", os.path.isdir(f"{directory}/{n}")) for n in names
        ]
        for source, kept, is_dir in entries:
            make = "mkdir -p" if is_dir else "install -D /dev/null"
            lines.append(
                f"{make} {shlex.quote(kept)} && mount --rbind {shlex.quote(source)} {shlex.quote(kept)}"
            )
        lines.append(f"mount -t tmpfs -o mode=755 ht-expose {shlex.quote(directory)}")
        for target, kept, is_dir in entries:
            make = "mkdir" if is_dir else "touch"
            lines.append(
                f"{make} {shlex.quote(target)} && mount --rbind {shlex.quote(kept)} {shlex.quote(target)}"
            )
    return "\n".join(lines)


@contextmanager
def user_workspace() -> Iterator[Path]:
    """A directory the ordinary user owns (``home/`` and ``tmp/`` inside), deleted afterwards."""
    entry = pwd.getpwnam(USER)
    workspace = Path(tempfile.mkdtemp(prefix="ht-as-user-"))
    try:
        for sub in ("home", "tmp", "stash"):
            (workspace / sub).mkdir()
        for path in (workspace, workspace / "home", workspace / "tmp"):
            os.chown(path, entry.pw_uid, entry.pw_gid)
        yield workspace
    finally:
        shutil.rmtree(workspace, ignore_errors=True)


# Runs "$@" in a new user namespace (ids 0-65535 mapped to themselves, written from outside since only root
# outside may map a range) whose limit on nested user namespaces is 0: the per-namespace
# user.max_user_namespaces, so the machine's own setting and the tests running beside are untouched. The
# inner shell re-executes once the map is written, to hold root's capabilities in the namespace.
_NO_USER_NAMESPACES = """
unshare --user -- sh -c 'while [ -z "$(cat /proc/self/uid_map)" ]; do sleep 0.01; done
exec sh -c "echo 0 > /proc/sys/user/max_user_namespaces && exec \\"\\$@\\"" sh "$@"' sh "$@" &
pid=$!
while [ "$(readlink /proc/$pid/ns/user)" = "$(readlink /proc/self/ns/user)" ]; do sleep 0.01; done
echo '0 0 65536' > /proc/$pid/uid_map && echo '0 0 65536' > /proc/$pid/gid_map
wait $pid
"""


def run_as_user(
    argv: Sequence[str],
    workspace: Path,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600,
    user_namespaces: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in the checkout as the ordinary user (see the module docstring); output captured.
    ``user_namespaces=0``: where it may not create user namespaces (see ``_NO_USER_NAMESPACES``)."""
    entry = pwd.getpwnam(USER)
    user_env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",  # an ordinary user's: no /usr/sbin
        "HOME": str(workspace / "home"),
        "TMPDIR": str(workspace / "tmp"),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(REPO),
        "PYTHONDONTWRITEBYTECODE": "1",
        **(env or {}),
    }
    script = expose_script(blocked_steps(needed_paths()), str(workspace / "stash"))
    drop = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups", "--"]
    if user_namespaces is None:
        command = f'{script}\nexec {shlex.join(drop)} "$@"'
    elif user_namespaces == 0:
        command = f'{script}\nset -- {shlex.join(drop)} "$@"\n{_NO_USER_NAMESPACES}'
    else:
        raise ValueError(f"user_namespaces: only 0 (none allowed) is supported, not {user_namespaces}")
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", command, "sh", *argv],
        cwd=REPO,
        env=user_env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


def pytest_as_user(
    args: Sequence[str], workspace: Path, **options: object
) -> subprocess.CompletedProcess[str]:
    """``python -m pytest ARGS`` as the ordinary user, with the venv's python."""
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    return run_as_user(argv, workspace, **options)  # type: ignore[arg-type]
