"""A relay into a container's network namespace: a listener on an address **inside** the namespace of a
running process (a container's), each connection to it relayed to the same address on this machine.

The docker sandbox uses it to give a container without network (or on a bridge) the capture proxy at the
very loopback URL the agent is told, while nothing else on this machine's loopback is reachable from the
container. ``setns`` needs root (``CAP_SYS_ADMIN``) and the process to be on this machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

_CLONE_NEWNET = 0x40000000


class NetnsRelay:
    """The relays of one sandbox. ``run_blocking(function, *args)`` runs a blocking call off the event loop
    (the backend's threads): entering a namespace takes a thread of its own."""

    def __init__(self, run_blocking: Callable[..., Awaitable[Any]]) -> None:
        self._run_blocking = run_blocking
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: set[asyncio.StreamWriter] = set()

    async def open(self, pid: int, host: str, port: int) -> None:
        """Listen on ``host:port`` inside the network namespace of ``pid``; relay to the same here."""
        sock = await self._run_blocking(_listen_in_netns, pid, host, port)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._connections.add(writer)
            try:
                up_reader, up_writer = await asyncio.open_connection(host, port)
            except OSError:
                writer.close()
                self._connections.discard(writer)
                return
            self._connections.add(up_writer)
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                for w in (writer, up_writer):
                    w.close()
                    self._connections.discard(w)

        self._servers.append(await asyncio.start_server(handle, sock=sock))

    def close(self) -> None:
        """Stop listening and drop every relayed connection; idempotent."""
        for server in self._servers:
            server.close()
        self._servers.clear()
        for writer in list(self._connections):
            writer.close()
        self._connections.clear()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


def _listen_in_netns(pid: int, host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` in the network namespace of process ``pid``. ``setns`` moves
    only the calling thread, so a throwaway thread does it; the socket stays in that namespace."""
    result: dict[str, Any] = {}

    def work() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        try:
            if libc.setns(target, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into the network namespace of pid {pid}")
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
                sock.listen(128)
                sock.setblocking(False)
                result["sock"] = sock
            finally:
                libc.setns(own, _CLONE_NEWNET)  # the thread ends here anyway
        except BaseException as exc:
            result["error"] = exc
        finally:
            os.close(own)
            os.close(target)

    thread = threading.Thread(target=work, name="ht-docker-netns", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["sock"]
