"""The capture proxy relayed into a local sandbox's own network namespace through a Unix socket.

A local sandbox of a task with ``allow_internet = false`` has a network namespace of its own holding only
its loopback (:class:`~.processes.Namespace`). The agent must still reach the capture proxy at the URL it is
told, which is on this machine's loopback. :mod:`.netns_relay` (the docker backend's) listens inside the
namespace by ``setns``, which the rootless mode cannot do: its network namespace belongs to the sandbox's
user namespace, over which this process has no rights. Unix sockets are files, and files cross network
namespaces, so :class:`ProxyRelay` works in both modes with two halves:

- here, an asyncio server on a Unix socket in the sandbox's root directory relays each connection to the
  proxy's ``host:port``;
- inside, one process started in the sandbox's namespaces (:data:`INSIDE`: the host's Python, standard
  library only) listens on that same ``host:port`` in the sandbox's loopback and forwards each connection
  to the Unix socket. It is a process of the sandbox, so it dies with the namespace.

So the agent uses the proxy's URL unchanged, and nothing else of this machine's network is reachable
through the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import signal
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

from harness_trainer.sandboxes.base import SandboxStartError
from harness_trainer.sandboxes.processes import Namespace

SOCKET_NAME = "proxy.sock"
"""The relay's Unix socket, in the sandbox's root directory (``<base_dir>/ht-<id>/``)."""

LABEL = "ht-proxy-relay"
"""The inside half's first argument: what ``ps`` shows of it in the sandbox."""

# Read from stdin (its command line stays short). argv: LABEL, the socket's directory, its name, the port,
# the addresses to listen on (the first must work; the others, ::1 for "localhost", are best effort: IPv6
# may be off). Prints "ready" once it listens, then writes nothing (its output goes to /dev/null).
INSIDE = """
import os, socket, sys, threading, time
directory, name, port, hosts = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]
os.chdir(directory)  # the socket is then connected to by its name: a Unix socket path has 107 bytes at most
listeners = []
for host in hosts:
    try:
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    except OSError as exc:
        if not listeners:
            sys.exit(f"cannot listen on {host}:{port} in the sandbox: {exc}")
        continue
    listeners.append(listener)

def pipe(source, target):
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        pass
    try:
        target.shutdown(socket.SHUT_WR)
    except OSError:
        pass

def relay(client):
    with client:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with upstream:
            try:
                upstream.connect(name)
            except OSError:
                return
            back = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
            back.start()
            pipe(client, upstream)
            back.join()

def accept(listener):
    while True:
        try:
            client, _ = listener.accept()
        except OSError:  # out of descriptors, say: wait, do not spin
            time.sleep(0.1)
            continue
        threading.Thread(target=relay, args=(client,), daemon=True).start()

for listener in listeners[1:]:
    threading.Thread(target=accept, args=(listener,), daemon=True).start()
print("ready", flush=True)
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 1)
os.dup2(null, 2)
accept(listeners[0])
"""


def loopback_target(url: str | None) -> tuple[str, int] | None:
    """``url``'s host and port (80 or 443 when it names none) when its host is this machine's loopback
    (``localhost``, ``127.0.0.0/8``, ``::1``); None otherwise (no URL, or a host reached by network)."""
    parts = urlsplit(url or "")
    host = parts.hostname
    if host is None:
        return None
    if host != "localhost":
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return None
        except ValueError:
            return None
    return host, parts.port or (443 if parts.scheme == "https" else 80)


class ProxyRelay:
    """Makes ``host:port`` of this machine reachable at the same address inside one sandbox's network
    namespace, and nothing else (see the module docstring). :meth:`open` once, :meth:`close` always (also
    after a failed open)."""

    def __init__(self, root: Path, host: str, port: int) -> None:
        self.socket_path = root / SOCKET_NAME
        self.host, self.port = host, port
        self._server: asyncio.AbstractServer | None = None
        self._inside: asyncio.subprocess.Process | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def open(self, namespace: Namespace, env: dict[str, str], *, timeout_s: float = 10.0) -> None:
        """Listen on the Unix socket here, then start the inside half in ``namespace`` and wait until it
        listens; raises SandboxStartError saying why it did not."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _bind(sock, self.socket_path)
            self._server = await asyncio.start_unix_server(self._handle, sock=sock)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, OSError):
                raise SandboxStartError(f"cannot listen on {self.socket_path}: {exc}") from exc
            raise
        hosts = ["127.0.0.1", "::1"] if self.host == "localhost" else [self.host]
        inside = [sys.executable, "-I", "-S", "-", LABEL, str(self.socket_path.parent), SOCKET_NAME]
        argv = namespace.enter_argv([*inside, str(self.port), *hosts], cwd="/")
        try:
            self._inside = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,  # its own group: a signal to ours (Ctrl-C) is not for it
            )
        except OSError as exc:
            raise SandboxStartError(f"cannot start the proxy relay in the sandbox: {exc}") from exc
        assert self._inside.stdin and self._inside.stdout and self._inside.stderr
        try:
            self._inside.stdin.write(INSIDE.encode())
            self._inside.stdin.close()
            line = await asyncio.wait_for(self._inside.stdout.readline(), timeout_s)
        except (TimeoutError, OSError):
            line = b""
        if line != b"ready\n":
            _kill(self._inside)
            err = (await self._inside.stderr.read()).decode(errors="replace").strip()[-1000:]
            why = err or "no output"
            raise SandboxStartError(f"the proxy relay did not start in the sandbox ({sys.executable}): {why}")

    async def close(self) -> None:
        """Stop listening, drop every relayed connection, remove the socket and reap the inside half (killed
        if it still runs: it normally dies with the namespace first); idempotent, never raises."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._connections):
            writer.close()
        self._connections.clear()
        with contextlib.suppress(OSError):
            self.socket_path.unlink()
        inside, self._inside = self._inside, None
        if inside is not None:
            _kill(inside)
            await inside.wait()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            up_reader, upstream = await asyncio.open_connection(self.host, self.port)
            self._connections.add(upstream)
            await asyncio.gather(_pipe(reader, upstream), _pipe(up_reader, writer))
        except OSError:
            pass  # the proxy refused: the client sees its connection closed
        finally:
            for w in (writer, upstream):
                if w is not None:
                    w.close()
                    self._connections.discard(w)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


def _bind(sock: socket.socket, path: Path) -> None:
    """Bind ``sock`` to ``path``, through ``/proc/self/fd`` when ``path`` is longer than a Unix socket
    address may be (a deep ``base_dir``)."""
    if len(os.fsencode(path)) < 100:
        sock.bind(str(path))
        return
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sock.bind(f"/proc/self/fd/{directory}/{path.name}")
    finally:
        os.close(directory)


def _kill(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
