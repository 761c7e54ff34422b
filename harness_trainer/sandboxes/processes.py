"""Process plumbing for the local sandbox: a private namespace per sandbox, and commands run in it.

:class:`Namespace` starts one long-lived init process in a fresh **mount + PID namespace** (``unshare
--fork --pid --mount --propagation private --mount-proc``) after bind-mounting the sandbox's private
directories over their absolute paths; in the rootless mode (:mod:`.rootless`) also a **user namespace**
(``--user --map-root-user``), and the binds go into a new root that the init ``pivot_root`` s into; with
``private_network``, also a **network namespace** (``--net``) whose loopback is brought up and which has
nothing else. Every command then enters those namespaces with ``nsenter``, so:

- ``/logs``, ``/tests``, the workspace… resolve to this sandbox's own directories (mounts are made once,
  at start, and vanish with the namespace: nothing is ever mounted on the host's own mount table);
- ``ps`` inside shows only the sandbox's processes, and orphans are reaped by the sandbox's init;
- killing the init (``SIGKILL``) makes the kernel kill every process in the namespace, whatever it did
  to escape (``setsid``, double fork, a scrubbed environment). That is how a sandbox is closed.
- the init is chained to the creating thread with ``setpriv --pdeathsig KILL`` and ``unshare
  --kill-child``: if this Python process dies hard, the namespace dies with it;
- with a private network, a command reaches only the namespace's own loopback, unless it is entered with
  ``host_network`` (the Dockerfile's ``RUN`` steps: images are built with a network in Docker too).

:func:`run_captured` runs one command in its own process group (``start_new_session``) and on timeout
or cancellation kills the whole group (``SIGTERM``, then ``SIGKILL`` after a grace). Output is captured
up to a cap per stream (the tail is kept). Needs util-linux (``unshare``, ``nsenter``, ``setpriv``,
``mount``; ``pivot_root`` when rootless), and root or unprivileged user namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from harness_trainer.sandboxes.base import ExecResult, SandboxError, SandboxStartError
from harness_trainer.sandboxes.rootless import ROOT, ROOTLESS_INIT, Mode, new_root_ops, tool

# After the main process exits, how long to wait for its output pipes to close: a background child that
# inherited them would otherwise hold the call open until it exits.
DRAIN_S = 0.5
MAX_OUTPUT_BYTES = 16 << 20

# $1 = the init's shell (unused), then pairs of (host dir, sandbox path). The init ignores SIGTERM; only
# SIGKILL (close) ends it. `wait` keeps it reaping every orphan the namespace hands it.
_INIT_SCRIPT = """
while [ "$#" -ge 2 ]; do
  mount --bind "$1" "$2" || { echo "cannot bind $1 on $2" >&2; exit 125; }
  shift 2
done
echo ready
exec /bin/bash -c 'trap "" TERM INT HUP; while :; do sleep 86400 & wait; done'
"""

# A new network namespace's loopback is down (so it has no 127.0.0.1 either): bring it up with the
# SIOCGIFFLAGS/SIOCSIFFLAGS ioctls, run by the host's Python, so that iproute2 is not needed.
_LOOPBACK_UP = """
import fcntl, socket, struct
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))
"""


class Namespace:
    """A mount + PID (+ network) namespace kept alive by one init process; ``enter_argv`` runs a command
    inside."""

    def __init__(
        self, launcher: asyncio.subprocess.Process, init_pid: int, mode: Mode, private_network: bool = False
    ) -> None:
        self._launcher = launcher
        self.init_pid = init_pid
        self.mode = mode
        self.private_network = private_network
        self.alive = True
        self._tools = {name: tool(name) or name for name in ("nsenter", "env")}

    @classmethod
    async def create(
        cls,
        binds: Sequence[tuple[Path, str]],
        env: Mapping[str, str],
        *,
        mode: Mode = ROOT,
        new_root: Path | None = None,
        private_network: bool = False,
        timeout_s: float = 10.0,
    ) -> Namespace:
        """Bind each host directory over its sandbox path in a new namespace made as ``mode`` says (for
        :data:`ROOTLESS`, in a new root mounted on the empty directory ``new_root``), with a network
        namespace of its own holding only its loopback (up) when ``private_network``; raises
        SandboxStartError."""
        if mode.needs_root and os.geteuid() != 0:
            raise SandboxStartError("the local sandbox's root mode needs root (mount and PID namespaces)")
        setpriv, unshare = (tool(name) or name for name in ("setpriv", "unshare"))
        argv = [setpriv, "--pdeathsig", "KILL", unshare, "--fork", "--kill-child=KILL", "--pid", "--mount"]
        argv += ["--propagation", "private", *mode.unshare_flags, *(["--net"] if private_network else [])]
        argv += ["--", "/bin/sh", "-c"]
        if mode.private_root:
            if new_root is None:
                raise ValueError("the rootless mode needs new_root, an empty directory to mount it on")
            pivot = tool("pivot_root") or "pivot_root"
            argv += [ROOTLESS_INIT, "ht-init", str(new_root), pivot, *new_root_ops(binds)]
        else:
            argv += [_INIT_SCRIPT, "ht-init", *(part for host, path in binds for part in (str(host), path))]
        namespace = await cls.launch(
            argv, env, mode=mode, timeout_s=timeout_s, private_network=private_network
        )
        if private_network:
            try:
                await namespace._bring_up_loopback(env, timeout_s)
            except BaseException:
                await namespace.kill()
                raise
        return namespace

    @classmethod
    async def launch(
        cls,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        mode: Mode,
        timeout_s: float = 10.0,
        private_network: bool = False,
    ) -> Namespace:
        """Run ``argv`` (``unshare`` … an init that prints ``ready`` once its namespaces are set up, then
        stays) as the namespace's launcher; raises SandboxStartError with the launcher's stderr when no
        ``ready`` comes within ``timeout_s``."""
        try:
            launcher = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=dict(env),
                start_new_session=True,
            )
        except OSError as exc:
            raise SandboxStartError(f"cannot launch the sandbox namespace: {exc}") from exc
        assert launcher.stdout is not None and launcher.stderr is not None
        try:
            line = await asyncio.wait_for(launcher.stdout.readline(), timeout_s)
        except TimeoutError:
            line = b""
        if line != b"ready\n":
            await _reap(launcher)
            err = (await launcher.stderr.read()).decode(errors="replace").strip()
            raise SandboxStartError(f"the sandbox namespace did not start: {err or 'no output'}")
        return cls(launcher, _only_child(launcher.pid), mode, private_network)

    async def _bring_up_loopback(self, env: Mapping[str, str], timeout_s: float) -> None:
        # -I -S: the host's Python with its standard library only (no site, no PYTHON* variables).
        argv = self.enter_argv([sys.executable, "-I", "-S", "-c", _LOOPBACK_UP], cwd="/")
        done = await run_captured(argv, env=env, timeout_s=timeout_s, grace_s=0.5)
        if done.exit_code != 0:
            why = done.stderr.strip()[-1000:] or f"exit code {done.exit_code}"
            why = "it timed out" if done.timed_out else why
            raise SandboxStartError(f"cannot bring up the loopback of the sandbox's own network: {why}")

    def enter_argv(self, argv: Sequence[str], *, cwd: str, host_network: bool = False) -> list[str]:
        """``argv`` run inside the namespace with working directory ``cwd`` (a sandbox path); with
        ``host_network``, in this machine's network instead of the namespace's own (when it has one)."""
        nsenter, env = self._tools["nsenter"], self._tools["env"]
        flags = [*self.mode.nsenter_flags, *(["-n"] if self.private_network and not host_network else [])]
        return [nsenter, "-t", str(self.init_pid), *flags, "--", env, f"--chdir={cwd}", *argv]

    def running(self) -> bool:
        """Whether the init still runs (it can only die by close or from outside the sandbox)."""
        if not self.alive:
            return False
        try:
            os.kill(self.init_pid, 0)
        except ProcessLookupError:
            return False
        return True

    async def kill(self) -> None:
        """Kill every process in the namespace (idempotent)."""
        if not self.alive:
            return
        self.alive = False
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.init_pid, signal.SIGKILL)
        await _reap(self._launcher)


def _only_child(pid: int) -> int:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        return int(children.read_text().split()[0])
    for status in Path("/proc").glob("[0-9]*/status"):  # kernels without CONFIG_PROC_CHILDREN
        with contextlib.suppress(OSError):
            if f"\nPPid:\t{pid}\n" in status.read_text():
                return int(status.parent.name)
    raise SandboxStartError(f"cannot find the sandbox init under process {pid}")


async def _reap(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    await process.wait()


class _Tail:
    """Keeps at most ``limit`` bytes, the most recent ones, and counts what it dropped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        excess = len(self.data) - self.limit
        if excess > self.limit:  # trim in big steps, not on every chunk
            del self.data[:excess]
            self.dropped += excess

    def text(self) -> str:
        excess = max(0, len(self.data) - self.limit)
        body = bytes(self.data[excess:]).decode(errors="replace")
        dropped = self.dropped + excess
        return f"[… {dropped} earlier bytes dropped]\n{body}" if dropped else body


async def _pump(stream: asyncio.StreamReader, sink: _Tail) -> None:
    while chunk := await stream.read(1 << 16):
        sink.add(chunk)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def kill_group(pgid: int, grace_s: float) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while group_alive(pgid) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def exit_status(returncode: int) -> int:
    """A shell-style exit status: a process killed by signal N exits with 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Resolves ``exited`` when the process exits, even while a background child still holds its pipes
    (Python 3.11's ``Process.wait()`` waits for the pipes to close too)."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


class Spawned:
    """A running process with piped stdout/stderr; ``exited`` resolves when it exits."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        transport: asyncio.SubprocessTransport,
        exited: asyncio.Future[None],
    ) -> None:
        self.process = process
        self.transport = transport
        self.exited = exited

    @property
    def returncode(self) -> int | None:
        return self.transport.get_returncode()

    def close_pipes(self) -> None:
        """Stop reading: a background child that still writes gets EPIPE, as when envd's stream ends.
        (Also kills the process if it still runs; callers kill its group first.)"""
        self.transport.close()


async def spawn(argv: Sequence[str], *, env: Mapping[str, str], new_session: bool = True) -> Spawned:
    """Start ``argv`` (stdin from /dev/null, stdout and stderr piped); raises SandboxError if it cannot."""
    loop = asyncio.get_running_loop()
    try:
        transport, protocol = await loop.subprocess_exec(
            lambda: _ExitProtocol(limit=1 << 16, loop=loop),
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env),
            start_new_session=new_session,
        )
    except OSError as exc:
        raise SandboxError(f"cannot run {argv[0]}: {exc}") from exc
    return Spawned(asyncio.subprocess.Process(transport, protocol, loop), transport, protocol.exited)


async def run_captured(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    timeout_s: float | None,
    grace_s: float,
    max_output_bytes: int = MAX_OUTPUT_BYTES,
) -> ExecResult:
    """Run ``argv`` in a new process group; on timeout or cancellation kill the whole group.

    The call returns when the process exits (plus up to ``DRAIN_S`` for its output); background
    children that outlive it keep running (they die with the namespace).
    """
    spawned = await spawn(argv, env=env)
    process, pgid = spawned.process, spawned.process.pid
    out, err = _Tail(max_output_bytes), _Tail(max_output_bytes)
    assert process.stdout is not None and process.stderr is not None
    pumps = [asyncio.create_task(_pump(process.stdout, out)), asyncio.create_task(_pump(process.stderr, err))]
    timed_out = False
    try:
        try:
            await asyncio.wait_for(asyncio.shield(spawned.exited), timeout_s)
        except TimeoutError:
            timed_out = True
            await kill_group(pgid, grace_s)
            await spawned.exited
        await asyncio.wait(pumps, timeout=DRAIN_S)
    finally:
        for pump in pumps:
            pump.cancel()
        if spawned.returncode is None:  # cancelled: leave nothing running behind us
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        spawned.close_pipes()
    code = None if timed_out else exit_status(spawned.returncode or 0)
    return ExecResult(exit_code=code, stdout=out.text(), stderr=err.text(), timed_out=timed_out)
