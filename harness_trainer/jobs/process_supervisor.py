"""A small process supervisor for the job launcher: children in their own process groups, stopped as one.

Each child is started with ``start_new_session=True``, so it leads its own process group and everything
it spawns (vLLM's workers, the rollout server's sandbox helpers) stays in that group; stopping a child
signals the whole group: SIGTERM, a bounded wait until no process of the group is left, then SIGKILL.
Children are stopped in the reverse order of their start (the trainer before the rollout server, so its
SIGTERM checkpoint can still close its sessions; the server before vLLM). Each child also gets SIGTERM
from the kernel if the launcher dies without stopping it (``PR_SET_PDEATHSIG``).

SIGTERM and SIGINT to the launcher only set a flag; :meth:`Supervisor.check` turns it into
:class:`Interrupted` at the next poll, so stopping never races a half-started child.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import FrameType

_PR_SET_PDEATHSIG = 1
_KILL_WAIT_S = 5.0  # after SIGKILL, how long a group's zombies may wait for a parent other than us to reap


class LaunchError(Exception):
    """A component of the run did not come up or died; the message names it."""


class Interrupted(LaunchError):
    """The launcher got SIGTERM or SIGINT."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopping on {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class Child:
    """A started child: its name in messages, its process (the leader of its own process group)."""

    name: str
    process: subprocess.Popen[bytes]
    stop_timeout_s: float
    service: bool = True
    """A service must stay up until the run ends; a one-shot child (the warm-up) may exit."""

    @property
    def pid(self) -> int:
        return self.process.pid


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel for SIGTERM when the launcher dies, so a
    # SIGKILLed launcher does not leave vLLM holding the GPUs.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Supervisor:
    """Starts children, notices when one dies or the launcher is signalled, and stops them all."""

    poll_s: float = 0.1
    children: list[Child] = field(default_factory=list)
    signalled: int | None = None

    def install_signal_handlers(self) -> None:
        """Turn SIGTERM / SIGINT into a flag that :meth:`check` raises as :class:`Interrupted`."""

        def handle(signum: int, frame: FrameType | None) -> None:
            self.signalled = signum

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def start(
        self, name: str, argv: list[str], env: dict[str, str], *, stop_timeout_s: float, service: bool = True
    ) -> Child:
        """Start ``argv`` with exactly ``env`` (nothing inherited) in a new process group."""
        self.check()
        log(f"starting {name}: {' '.join(argv)}")
        try:
            process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        except OSError as exc:
            raise LaunchError(f"cannot start {name} ({argv[0]}): {exc}") from exc
        child = Child(name, process, stop_timeout_s, service)
        self.children.append(child)
        return child

    def check(self) -> None:
        """Raise :class:`Interrupted` if signalled, :class:`LaunchError` if a service has exited."""
        if self.signalled is not None:
            raise Interrupted(self.signalled)
        self._reap_orphans()
        for child in self.children:
            code = child.process.poll()
            if child.service and code is not None:
                raise LaunchError(f"{child.name} exited with code {code} (its output is above)")

    def _reap_orphans(self) -> None:
        """Reap exited processes that are not our children's leaders: orphans re-parented to the launcher
        when it is the job's PID 1, which would otherwise stay zombies for the whole run."""
        ours = {child.pid for child in self.children}
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid in ours:  # a leader is Popen's to reap, with its status
                return
            os.waitpid(info.si_pid, 0)

    def sleep(self, seconds: float) -> None:
        """Sleep up to ``seconds``, checking for signals and dead services every poll."""
        deadline = time.monotonic() + seconds
        while True:
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(self.poll_s, left))

    def wait(self, child: Child, timeout_s: float | None = None) -> int | None:
        """Wait for ``child`` to exit (other services and signals still checked); its code, or None."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (code := child.process.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            self.sleep(self.poll_s)
        return code

    def forget(self, child: Child) -> None:
        """Drop a finished one-shot child (its group is stopped first, in case it left anything behind)."""
        _stop_group(child)
        self.children.remove(child)

    def stop_all(self) -> None:
        """Stop every child's process group, last started first."""
        for child in reversed(self.children):
            if _group_alive(child):
                log(f"stopping {child.name}")
            _stop_group(child)
        self.children.clear()


def log(message: str) -> None:
    print(f"[job-launcher] {message}", file=sys.stderr, flush=True)


def _stop_group(child: Child) -> None:
    _signal_group(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + child.stop_timeout_s
    while _group_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _group_alive(child):
        log(f"{child.name} did not stop within {child.stop_timeout_s:g}s: SIGKILL")
        _signal_group(child.pid, signal.SIGKILL)
        child.process.wait()
        deadline = time.monotonic() + _KILL_WAIT_S
        while _group_alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:  # the whole group is already gone
        pass


def _group_alive(child: Child) -> bool:
    """Whether any process of ``child``'s group is left (its exited members reaped where they are ours)."""
    if child.process.poll() is not None:
        # Only once the leader is reaped by Popen, or this could take its exit status from it.
        try:
            while os.waitpid(-child.pid, os.WNOHANG)[0] > 0:  # orphans re-parented to us (launcher as PID 1)
                pass
        except ChildProcessError:
            pass
    try:
        os.killpg(child.pid, 0)
    except ProcessLookupError:
        return False
    return True
