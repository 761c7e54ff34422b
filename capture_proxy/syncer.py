"""The fdatasync helper process (``python -I syncer.py FD``), started by :mod:`capture_proxy.writer`.

It owns no data: the proxy writes each journal line itself and sends the file descriptor once (over the
``AF_UNIX`` ``SOCK_SEQPACKET`` socket ``FD``), then one small message per line to make durable. The helper
reads every message waiting, fdatasyncs each file named in them once (several in parallel, so the file
system can fold them into fewer commits), and answers with the tokens it made durable. It exits when the
socket closes, which is also what happens when the proxy dies, however it dies.

Messages to the helper (one per datagram): ``o`` + id (8 bytes) with one descriptor attached: adopt it;
``s`` + (id, token) pairs (8 + 8 bytes each): make these files durable, then answer the tokens; ``c`` +
id: close that descriptor (after any sync asked before it). Answers: ``a`` + tokens (8 bytes each): done;
``e`` + token + the error's text: that token's file could not be synced.
"""

from __future__ import annotations

import array
import os
import signal
import socket
import struct
import sys
from concurrent.futures import ThreadPoolExecutor

ID = struct.Struct("<Q")
PAIR = struct.Struct("<QQ")
MAX_MESSAGE = 1 << 16
MAX_TOKENS_PER_ANSWER = 4096
FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize)


def main(argv: list[str]) -> int:
    # The proxy decides when this ends (by closing the socket); a Ctrl-C meant for it must not come first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    files: dict[int, int] = {}
    with ThreadPoolExecutor(8, thread_name_prefix="fdatasync") as pool:
        while True:
            messages = receive(sock)
            if messages is None:
                return 0
            wanted: dict[int, list[int]] = {}
            closing: list[int] = []
            for data, fds in messages:
                kind = data[:1]
                if kind == b"o" and fds:
                    files[ID.unpack_from(data, 1)[0]] = fds[0]
                elif kind == b"s":
                    for file_id, token in PAIR.iter_unpack(data[1:]):
                        wanted.setdefault(file_id, []).append(token)
                elif kind == b"c":
                    closing.append(ID.unpack_from(data, 1)[0])
            items = [(files.get(file_id), file_id) for file_id in wanted]
            # One file (the proxy's write-ahead log, nearly always) is synced here: a pool thread would
            # only add two thread wake-ups to every batch.
            errors = dict(pool.map(_sync, items) if len(items) > 1 else map(_sync, items))
            if not answer(sock, wanted, errors):
                return 0
            for file_id in closing:
                fd = files.pop(file_id, None)
                if fd is not None:
                    os.close(fd)


def receive(sock: socket.socket) -> list[tuple[bytes, list[int]]] | None:
    """Every message waiting (blocking for the first); None once the proxy has closed the socket."""
    messages = []
    flags = 0
    while True:
        try:
            # Not socket.recv_fds: in Python 3.11 it never passes ``flags`` on to recvmsg.
            data, ancillary, _, _ = sock.recvmsg(MAX_MESSAGE, FD_SPACE, flags)
        except BlockingIOError:
            return messages
        except ConnectionError:
            return None
        if not data:
            return None
        fds = array.array("i")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        messages.append((data, list(fds)))
        flags = socket.MSG_DONTWAIT


def _sync(item: tuple[int | None, int]) -> tuple[int, str | None]:
    fd, file_id = item
    if fd is None:
        return file_id, "the helper was never given this file"
    try:
        os.fdatasync(fd)
    except OSError as exc:
        return file_id, f"fdatasync failed: {exc}"
    return file_id, None


def answer(sock: socket.socket, wanted: dict[int, list[int]], errors: dict[int, str | None]) -> bool:
    """Send the answers; False if the proxy is gone."""
    done = [token for file_id, tokens in wanted.items() if errors[file_id] is None for token in tokens]
    try:
        for start in range(0, len(done), MAX_TOKENS_PER_ANSWER):
            chunk = done[start : start + MAX_TOKENS_PER_ANSWER]
            sock.sendall(b"a" + struct.pack(f"<{len(chunk)}Q", *chunk))
        for file_id, error in errors.items():
            if error is not None:
                for token in wanted[file_id]:
                    sock.sendall(b"e" + ID.pack(token) + error.encode("utf-8", "replace")[:4000])
    except OSError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
